"""In-process vLLM API server for the retry tests, and a fault injector at the
engine-output boundary.

`InProcessServer` builds what `vllm serve` builds -- AsyncLLM (engine core in its
own process, so the P0/P1 cache split is real), vLLM's FastAPI app with its
routers, exception handlers and serving objects -- and talks to it over HTTP with
httpx's ASGI transport instead of a socket. Everything runs on one event loop in a
background thread; tests call `server.run(coro)`.

`EngineFaults` rewrites chosen requests' EngineCoreOutputs into
`finish_reason=ERROR` (+ `mm_cache_miss_hashes` for a cache miss) before the output
processor sees them, exactly what the engine core sends on a P1 miss."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import logging
import os
import pathlib
import sys
import threading
from collections.abc import Awaitable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import servers  # noqa: E402
from tiny_model import ensure_tiny_model  # noqa: E402

T = TypeVar("T")

MM_MISS = "multimodal_cache_miss"


def set_offline_env() -> None:
    for key, value in servers.server_env().items():
        if key.startswith(("HF_", "TRANSFORMERS_", "VLLM_", "DO_NOT")):
            os.environ[key] = value
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)


def png_data_url(seed: int = 0, size: int = 32) -> str:
    """A small deterministic RGB PNG as a data: URL."""
    from PIL import Image

    img = Image.new("RGB", (size, size))
    img.putdata([((x * 7 + seed * 31) % 256, (y * 5 + seed * 17) % 256, (x * y + seed) % 256)
                 for y in range(size) for x in range(size)])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_messages(text: str, seed: int = 0) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png_data_url(seed)}},
        {"type": "text", "text": text}]}]


@dataclass
class Fault:
    """Fail the first `times` engine requests whose external id contains `marker`.

    kind: "mm_miss"   -> ERROR + mm_cache_miss_hashes (a P1 cache miss);
          "transient" -> ERROR, structured error with another retryable code;
          "fatal"     -> ERROR, nothing else (stock: an internal error).
    at_output: which EngineCoreOutput of the request to rewrite (0 = the first).
    """

    marker: str
    kind: str = "mm_miss"
    times: int = 1
    at_output: int = 0
    delay_s: float = 0.0  # hold the rewritten batch back (lets a stream flush first)
    hits: list[str] = field(default_factory=list)  # external ids we failed
    seen: dict[str, int] = field(default_factory=dict)  # internal id -> outputs seen


class EngineFaults:
    """Wraps one AsyncLLM's output path; install before the first request."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.faults: list[Fault] = []
        self.external: dict[str, str] = {}  # internal request id -> external id
        self.queues: dict[str, Any] = {}  # internal id -> RequestOutputCollector
        self.shimmed: list[str] = []  # ids whose structured error this module added
        self.submitted: list[str] = []  # external ids, in submission order
        self.renders: list[bool] = []  # skip_mm_cache of every render, in order
        self.mm_hashes: dict[str, list[str]] = {}  # internal id -> its mm hashes
        self._planned: dict[str, tuple[str, Fault]] = {}  # internal id -> (kind, fault)
        self._failed: set[str] = set()  # internal ids we ended
        self._wrap()

    def add(self, fault: Fault) -> Fault:
        self.faults.append(fault)
        return fault

    def clear(self) -> None:
        self.faults.clear()
        self.submitted.clear()
        self.renders.clear()
        self.shimmed.clear()

    def _wrap(self) -> None:
        engine = self.engine
        handler = engine.output_handler
        if handler is not None:
            # Started during start-up (reset_mm_cache): it is already waiting in an
            # unwrapped get_output_async(). Stop it; the next request starts a new one.
            handler.cancel()
            engine.output_handler = None
        core = engine.engine_core
        get_output = core.get_output_async
        op = engine.output_processor
        add_request = op.add_request
        process_outputs = op.process_outputs
        abort = core.abort_requests_async

        def tracked_add(request: Any, *args: Any, **kwargs: Any) -> Any:
            ext = request.external_req_id or request.request_id
            self.external[request.request_id] = ext
            queue = args[3] if len(args) > 3 else kwargs.get("queue")
            self.queues[request.request_id] = queue
            self.mm_hashes[request.request_id] = [
                f.mm_hash for f in request.mm_features or [] if f.mm_hash]
            self.submitted.append(ext)
            return add_request(request, *args, **kwargs)

        async def faulty_get_output() -> Any:
            outputs = await get_output()
            from vllm.v1.engine import FinishReason

            delay = 0.0
            # A request P1 failed produces nothing more: drop what the engine core
            # still sends for it until our abort lands.
            outputs.outputs = [eco for eco in outputs.outputs
                               if eco.request_id not in self._failed]
            for eco in outputs.outputs:
                fault = self._match(eco.request_id)
                if fault is None:
                    continue
                n = fault.seen.get(eco.request_id, 0)
                fault.seen[eco.request_id] = n + 1
                if n != fault.at_output:
                    continue
                fault.hits.append(self.external[eco.request_id])
                self._failed.add(eco.request_id)
                self._planned[eco.request_id] = (fault.kind, fault)
                eco.finish_reason = FinishReason.ERROR
                eco.new_token_ids = []
                eco.new_logprobs = None
                if fault.kind == "mm_miss":  # P0 drops these from its shadow cache
                    eco.mm_cache_miss_hashes = (self.mm_hashes.get(eco.request_id)
                                                or ["injected-miss"])
                # The engine core still runs this request: stop it there too.
                asyncio.get_running_loop().create_task(abort([eco.request_id]))
                delay = max(delay, fault.delay_s)
            if delay:
                await asyncio.sleep(delay)
            return outputs

        def process_with_shim(engine_core_outputs: Any, *args: Any, **kwargs: Any) -> Any:
            result = process_outputs(engine_core_outputs, *args, **kwargs)
            for eco in engine_core_outputs:
                planned = self._planned.pop(eco.request_id, None)
                if planned is not None:
                    self._shim_error(eco.request_id, planned[0])
            return result

        renderer = engine.renderer
        for name in ("render_chat", "render_chat_async", "render_cmpl", "render_cmpl_async"):
            setattr(renderer, name, self._recording(getattr(renderer, name)))
        core.get_output_async = faulty_get_output
        op.add_request = tracked_add
        op.process_outputs = process_with_shim

    def _recording(self, render: Any) -> Any:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.renders.append(bool(kwargs.get("skip_mm_cache", False)))
            return render(*args, **kwargs)

        return recorded

    def _match(self, internal_id: str) -> Fault | None:
        ext = self.external.get(internal_id, "")
        for fault in self.faults:
            if fault.marker in ext:
                if internal_id in fault.seen or len(fault.hits) < fault.times:
                    return fault
        return None

    def _shim_error(self, internal_id: str, kind: str) -> None:
        """Until the structured-error output processor is installed, give the
        terminal output the `RequestOutput.error` it will carry."""
        from vllm.outputs import RequestError, RequestOutput

        queue = self.queues.get(internal_id)
        out = getattr(queue, "output", None)
        if not isinstance(out, RequestOutput) or getattr(out, "error", None) is not None:
            return
        if kind == "mm_miss":
            out.error = RequestError(code=MM_MISS, message="Multi-modal processor cache miss.",
                                     retryable=True)
        elif kind == "transient":
            out.error = RequestError(code="test_transient", message="transient test fault",
                                     retryable=True)
        else:
            return
        self.shimmed.append(self.external.get(internal_id, internal_id))


class InProcessServer:
    """`vllm serve MODEL *args` without a socket; see the module docstring."""

    def __init__(self, *serve_args: str) -> None:
        self.serve_args = serve_args
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._stack = contextlib.AsyncExitStack()
        self.engine: Any = None
        self.app: Any = None
        self.client: Any = None
        self.faults: EngineFaults | None = None

    def run(self, coro: Coroutine[Any, Any, T] | Awaitable[T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    def start(self) -> InProcessServer:
        set_offline_env()
        self._thread.start()
        self.run(self._start(), timeout=600)
        return self

    async def _start(self) -> None:
        import httpx
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
        from vllm.entrypoints.launchers.app import build_app
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = make_arg_parser(FlexibleArgumentParser())
        args = parser.parse_args(["--model", str(ensure_tiny_model()),
                                  *servers.TINY_SERVE_ARGS, *self.serve_args])
        self.engine = await self._stack.enter_async_context(build_async_engine_client(args))
        self.faults = EngineFaults(self.engine)
        tasks = await self.engine.get_supported_tasks()
        self.app = build_app(args, tasks, self.engine.model_config)
        await init_app_state(self.engine, self.app.state, args, tasks)
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app),
                                        base_url="http://vllm.test", timeout=120)
        self.model = args.model

    def stop(self) -> None:
        async def _stop() -> None:
            if self.client is not None:
                await self.client.aclose()
            await self._stack.aclose()

        try:
            if self._thread.is_alive():
                self.run(_stop(), timeout=120)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=30)

    # --- HTTP helpers -------------------------------------------------------
    def post(self, path: str, body: dict[str, Any]) -> Any:
        return self.run(self.client.post(path, json={"model": self.model, **body}))

    def stream(self, path: str, body: dict[str, Any]) -> tuple[int, list[Any]]:
        """POST with stream=True; returns (status, events) where an event is the
        parsed JSON of a `data:` line, or the string "[DONE]"."""
        resp = self.post(path, {**body, "stream": True})
        events: list[Any] = []
        for line in resp.text.splitlines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
        return resp.status_code, events


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def retry_log_lines() -> Iterator[list[str]]:
    """The messages the retry module logs while the block runs."""
    handler = _Lines()
    log = logging.getLogger("vllm.vllm_mmretry.retry")
    log.addHandler(handler)
    try:
        yield handler.lines
    finally:
        log.removeHandler(handler)


@contextlib.contextmanager
def in_process_server(*serve_args: str) -> Iterator[InProcessServer]:
    server = InProcessServer(*serve_args)
    try:
        yield server.start()
    finally:
        server.stop()
