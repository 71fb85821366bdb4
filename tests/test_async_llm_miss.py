"""A P1 miss through vLLM's own `AsyncLLM` output handler (`_run_output_handler`),
driven by a stand-in engine whose `EngineCoreOutputs` come from a queue (as vLLM
0.33's tests/multimodal/test_cache.py drives it), with our OutputProcessor wired
the way the plugin wires it (`_wire_cache`, through the adapter).

At the moment the error output becomes visible to the consumer (the collector's
`ready` is set) P0 must no longer serve any missed hash: on vLLM 0.33 the hash is in
the renderer's own invalidation queue (`queue_mm_cache_invalidations`, filled by
vLLM's handler before `process_outputs`) and the sender cache is not touched from
the output handler; the next render drains it. On 0.32 (no queue) it is already
invalidated in the sender cache. n = 1 and n = 3, DELTA and FINAL_ONLY; siblings
are aborted in the engine through the handler's `abort_requests_async`."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from output_processor_support import ReqSpec, Side, eco
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine import EngineCoreOutputs, FinishReason
from vllm.v1.engine.async_llm import AsyncLLM

from vllm_mmretry import vllm_adapter
from vllm_mmretry.output_processor import MISS_CODE
from vllm_mmretry.output_processor import OutputProcessor as OurOP

KINDS = [RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY]


@pytest.fixture(scope="module")
def model_config(tiny_model_path: str) -> Any:
    from vllm.config import ModelConfig

    return ModelConfig(model=tiny_model_path, dtype="float32", max_model_len=512)


@pytest.fixture
def renderer(model_config: Any) -> Any:
    """vLLM's HF renderer (its real invalidation queue where the version has one)
    holding P0's real LRU sender cache with three items; built without a model
    processor (only its multimodal cache state is used here)."""
    from vllm.multimodal.cache.lru import LruKeyReplicatedSenderCache
    from vllm.multimodal.inputs import MultiModalKwargsItem
    from vllm.renderers.hf import HfRenderer

    cache = LruKeyReplicatedSenderCache(model_config)
    for h in ("h1", "h2", "h3"):
        cache.get_and_update_item((MultiModalKwargsItem.dummy(), []), h)
    r = object.__new__(HfRenderer)
    r._mm_processor_cache = cache
    r._mm_cache_stats = None
    r._pending_mm_cache_invalidations = set()
    r._mm_cache_invalidation_lock = threading.Lock()
    return r


def p0_serves(renderer: Any, h: str) -> bool:
    """P0 would still send `h` by hash only at its next render."""
    pending = getattr(renderer, "_pending_mm_cache_invalidations", set())
    return renderer.mm_processor_cache.is_cached_item(h) and h not in pending


class StandInEngine:
    """The engine client's two calls the output handler makes."""

    def __init__(self) -> None:
        self.outputs: asyncio.Queue[EngineCoreOutputs] = asyncio.Queue()
        self.aborted: list[str] = []

    async def get_output_async(self) -> EngineCoreOutputs:
        return await self.outputs.get()

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)


class WatchedEvent(asyncio.Event):
    """A collector's `ready`: records whether P0 still served each hash when an
    output became visible."""

    def __init__(self, renderer: Any, hashes: tuple[str, ...]) -> None:
        super().__init__()
        self.renderer, self.hashes, self.seen = renderer, hashes, []

    def set(self) -> None:
        self.seen.append({h: p0_serves(self.renderer, h) for h in self.hashes})
        super().set()


def async_llm(renderer: Any, op: OurOP, engine: StandInEngine) -> AsyncLLM:
    """An AsyncLLM with only what `_run_output_handler` reads, wired like the plugin."""
    llm = object.__new__(AsyncLLM)
    llm.engine_core = engine
    llm.output_processor = op
    llm.renderer = renderer
    llm.log_stats = False
    llm.logger_manager = None
    llm.output_handler = None
    op.mm_processor_cache = vllm_adapter.adapter().engine_renderer(llm)
    return llm


def outputs(*ecos: Any) -> EngineCoreOutputs:
    return EngineCoreOutputs(outputs=list(ecos), timestamp=2000.0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 3])
def test_miss_through_async_llm_output_handler(tiny_tokenizer: Any, renderer: Any,
                                               kind: RequestOutputKind, n: int) -> None:
    async def run() -> None:
        engine = StandInEngine()
        op = OurOP(tiny_tokenizer, log_stats=False)
        side = Side(op, async_mode=True)
        llm = async_llm(renderer, op, engine)
        ids = side.add(ReqSpec("r1", "ext-r1", [1, 415, 2936], n=n, kind=kind))
        q = side.collectors["r1"]
        watch = WatchedEvent(renderer, ("h1", "h2"))
        q.ready = watch
        llm._run_output_handler()
        try:
            await engine.outputs.put(outputs(*(eco(cid, [272]) for cid in ids)))
            if kind == RequestOutputKind.DELTA:
                first = await asyncio.wait_for(q.get(), 60)
                assert first.error is None and not first.finished
            miss = eco(ids[0], [], FinishReason.ERROR, mm_cache_miss_hashes=["h2", "h1"])
            await engine.outputs.put(outputs(miss))
            out = await asyncio.wait_for(q.get(), 60)
            for _ in range(100):  # the handler aborts after publishing
                if len(engine.aborted) >= n - 1:
                    break
                await asyncio.sleep(0.01)
        finally:
            llm.output_handler.cancel()
            llm.shutdown = lambda: None  # nothing of AsyncLLM's own was started
        assert out.finished and out.request_id == "ext-r1"
        assert out.error is not None and out.error.code == MISS_CODE and out.error.retryable
        assert [c.finish_reason for c in out.outputs if c.finish_reason == "error"] == ["error"]
        # P0 stopped serving both hashes before the error output was visible.
        assert watch.seen[-1] == {"h1": False, "h2": False}
        assert sorted(engine.aborted) == sorted(ids[1:])
        assert not op.has_unfinished_requests()
        if hasattr(renderer, "queue_mm_cache_invalidations"):
            # vLLM 0.33: through the renderer's queue, drained at the next render;
            # the output loop itself touched no cache.
            assert renderer._pending_mm_cache_invalidations == {"h1", "h2"}
            assert renderer.mm_processor_cache.is_cached_item("h1")
            assert op.counters()["invalidations"] == 0
            renderer._drain_mm_cache_invalidations()
        assert not renderer.mm_processor_cache.is_cached_item("h1")
        assert not renderer.mm_processor_cache.is_cached_item("h2")
        assert renderer.mm_processor_cache.is_cached_item("h3")

    asyncio.run(run())
