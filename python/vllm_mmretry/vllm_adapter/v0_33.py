"""vLLM 0.33: what changed since 0.32 at the package's seams (everything else is
inherited from `v0_32`). See docs/vllm-0.33-seams.md for the line-by-line reading.

- `EngineCoreOutput` has a trailing `error: RequestError | None`. With a queue
  (AsyncLLM), vLLM puts `error.to_exception()` into it and finishes the request
  without an output or stats; that runs here, before the core sees the step.
  Without a queue (LLMEngine) the output goes the ordinary way (finish ERROR).
- A streaming-input request whose sub-request finishes with ERROR or ABORT ends
  (0.32 kept it alive), and a finished streaming-input request is always aborted
  in the engine (an in-flight chunk may re-create the session): such requests are
  owned by the embedded stock processor, so vLLM 0.33's own code does this.
- Parents discard finished children (`_finish_request`).
- AsyncLLM's output handler queues miss invalidations on the renderer
  (`queue_mm_cache_invalidations`) before `process_outputs`; the renderer drains
  them before its next cache lookup. So on AsyncLLM the output loop invalidates
  nothing itself (touching the sender cache from the output handler is the race
  0.33 removed); LLMEngine still invalidates directly, as in 0.32.
- Streaming input uses `StreamingInputOutputCollector` (a subclass: the core
  calls its own `put`).
- Pooling outputs are returned before the `stream_interval` check: pooling runs
  vLLM's `make_request_output`, so nothing to do here.
"""

from __future__ import annotations

from operator import attrgetter
from types import ModuleType
from typing import Any, ClassVar

from vllm.v1.engine import EngineCoreOutput
from vllm.v1.engine.output_processor import StreamingInputOutputCollector

from vllm_mmretry.vllm_adapter import v0_32
from vllm_mmretry.vllm_adapter.base import CoreSpec

# EngineCoreOutput's fields in 0.33, in declaration order (slot order).
ECO_STRUCT_FIELDS: tuple[str, ...] = (*v0_32.ECO_STRUCT_FIELDS, "error")
_error_of = attrgetter("error")


def _reject(core: Any, eco: EngineCoreOutput, aborts: list[str]) -> bool:
    """vLLM 0.33's handling of `EngineCoreOutput.error` for a request with a
    queue: the exception goes into the queue, the request finishes without an
    output or stats. False when the output goes the ordinary way instead."""
    rid = eco.request_id
    if not core.has(rid):
        return True  # output for an already-aborted request: ignored
    state = core.state(rid)
    if state.queue is None:
        return False
    state.queue.put(eco.error.to_exception())
    if state.parent_req is not None:
        state.parent_req.child_requests.discard(rid)
    core.finish_request(rid)
    if state.streaming_input:
        aborts.append(rid)
    return True


class Adapter(v0_32.Adapter):
    """vLLM 0.33.x."""

    version = "0.33.0"
    ECO_STRUCT_FIELDS = ECO_STRUCT_FIELDS


    # --- doctor
    @staticmethod
    def serve_cli_args() -> ModuleType:
        """0.33 moved `vllm serve`'s parser and checks to entrypoints.common."""
        from vllm.entrypoints.common import cli_args

        module: ModuleType = cli_args
        return module

    def process_outputs(self, core: Any, spec: CoreSpec, engine_core_outputs: Any,
                        engine_core_timestamp: float | None, iteration_stats: Any,
                        weight_version: str | None) -> tuple[list[Any], list[Any]]:
        # The scan runs in C (map); outputs with `error` are rare (a paused engine).
        if not any(map(_error_of, engine_core_outputs)):
            outs: tuple[list[Any], list[Any]] = core.process(
                engine_core_outputs, engine_core_timestamp, iteration_stats, weight_version)
            return outs
        return self._process_with_errors(core, engine_core_outputs, engine_core_timestamp,
                                         iteration_stats, weight_version)

    @staticmethod
    def _process_with_errors(core: Any, ecos: Any, ts: float | None, stats: Any,
                             weight_version: str | None) -> tuple[list[Any], list[Any]]:
        """The step in order: runs of ordinary outputs go to the core, rejected
        requests are finished in between (so outputs and aborts keep vLLM's order)."""
        outs: list[Any] = []
        aborts: list[Any] = []
        run: list[Any] = []

        def flush() -> None:
            if run:
                o, a = core.process(list(run), ts, stats, weight_version)
                outs.extend(o)
                aborts.extend(a)
                run.clear()

        for eco in ecos:
            if eco.error is None:
                run.append(eco)
                continue
            flush()
            if not _reject(core, eco, aborts):
                run.append(eco)
        flush()
        return outs, aborts

    HANDLER_DIGESTS: ClassVar[dict[str, str]] = {
        **v0_32.Adapter.HANDLER_DIGESTS,
        "AsyncLLM._run_output_handler": "5e7ca70415063aa8",
        "IterationStats": "f5c7742972cf8833",
    }

    def streaming_input_collector(self) -> type:
        collector: type = StreamingInputOutputCollector
        return collector

    def engine_renderer(self, engine: Any) -> Any:
        """What the output loop invalidates missed hashes in: nothing on AsyncLLM
        (its output handler queues them on the renderer before `process_outputs`),
        the renderer on LLMEngine (it still invalidates after `process_outputs`)."""
        from vllm.v1.engine.async_llm import AsyncLLM

        return None if isinstance(engine, AsyncLLM) else engine.renderer
