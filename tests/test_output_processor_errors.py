"""Behaviours 1-3: a P1 multimodal cache miss becomes one terminal RequestOutput
with a retryable RequestError; n>1 siblings are aborted; every missing hash of
the step is invalidated in P0's real sender cache, once, before the error is
visible. Real vLLM classes throughout (LruKeyReplicatedSenderCache, collectors)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from output_processor_support import ReqSpec, Side, eco
from vllm.outputs import PoolingRequestOutput, RequestOutput
from vllm.pooling_params import PoolingParams
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
from vllm.v1.engine.output_processor import OutputProcessor as StockOP
from vllm.v1.engine.output_processor import RequestOutputCollector

from vllm_mmretry.output_processor import MISS_CODE
from vllm_mmretry.output_processor import OutputProcessor as OurOP

KINDS = [RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY]
MODES = ["async", "engine"]


@pytest.fixture(scope="module")
def model_config(tiny_model_path: str) -> Any:
    from vllm.config import ModelConfig

    return ModelConfig(model=tiny_model_path, dtype="float32", max_model_len=512)


@pytest.fixture
def sender_cache(model_config: Any) -> Any:
    """P0's real LRU sender cache, holding three items."""
    from vllm.multimodal.cache.lru import LruKeyReplicatedSenderCache
    from vllm.multimodal.inputs import MultiModalKwargsItem

    cache = LruKeyReplicatedSenderCache(model_config)
    for h in ("h1", "h2", "h3"):
        cache.get_and_update_item((MultiModalKwargsItem.dummy(), []), h)
        assert cache.is_cached_item(h)
    return cache


class WatchedEvent(asyncio.Event):
    """The collector's real `ready` event, recording what P0's cache held at the
    moment an output became visible to the consumer."""

    def __init__(self, cache: Any, hashes: tuple[str, ...]) -> None:
        super().__init__()
        self.cache, self.hashes, self.seen = cache, hashes, []

    def set(self) -> None:
        self.seen.append({h: self.cache.is_cached_item(h) for h in self.hashes})
        super().set()


def _ours(tok: Any, cache: Any, async_mode: bool) -> Side:
    side = Side(OurOP(tok, log_stats=True), async_mode)
    side.op.mm_processor_cache = cache
    return side


def _published(side: Side, rid: str, outs: list) -> list[RequestOutput]:
    """Outputs for request `rid` (collector in AsyncLLM mode, else the list)."""
    if side.async_mode:
        o = side.collectors[rid].get_nowait()
        return [] if o is None else [o]
    return [o for o in outs if o.request_id == f"ext-{rid}"]


def _assert_error_output(o: RequestOutput, ext: str, index: int) -> None:
    assert o.request_id == ext
    assert o.finished is True
    assert o.error is not None and o.error.code == MISS_CODE and o.error.retryable is True
    assert "cache miss" in o.error.message
    errs = [c for c in o.outputs if c.finish_reason == "error"]
    assert [c.index for c in errs] == [index]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_n1_miss_is_one_terminal_retryable_error(
    tiny_tokenizer: Any, sender_cache: Any, mode: str, kind: RequestOutputKind
) -> None:
    side = _ours(tiny_tokenizer, sender_cache, mode == "async")
    spec = ReqSpec("r1", "ext-r1", [1, 415, 2936], kind=kind)
    side.add(spec)
    watch = None
    if side.async_mode:
        watch = WatchedEvent(sender_cache, ("h1", "h2"))
        side.collectors["r1"].ready = watch
    outs, aborts = side.step([eco("r1", [272, 285])], stats=None)
    first = _published(side, "r1", outs)
    assert len(first) == (1 if kind == RequestOutputKind.DELTA else 0)
    miss = eco("r1", [], FinishReason.ERROR, mm_cache_miss_hashes=["h2", "h1", "h2"])
    outs, aborts = side.step([miss], stats=None)
    assert aborts == []
    [o] = _published(side, "r1", outs)
    _assert_error_output(o, "ext-r1", 0)
    if kind == RequestOutputKind.FINAL_ONLY:
        assert o.outputs[0].token_ids == [272, 285]
    # Invalidated in P0, each hash once, before the error became visible.
    assert not sender_cache.is_cached_item("h1") and not sender_cache.is_cached_item("h2")
    assert sender_cache.is_cached_item("h3")
    assert side.op.counters()["invalidations"] == 2
    if watch is not None:
        assert watch.seen[-1] == {"h1": False, "h2": False}
    # Consumed: the stock AsyncLLM/LLMEngine loop after process_outputs finds nothing.
    assert miss.mm_cache_miss_hashes is None
    assert not side.op.has_request("r1") and side.op.get_num_unfinished_requests() == 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("miss_child, finished_before", [(0, None), (1, None), (2, None), (2, 0), (0, 1)])
def test_n3_miss_aborts_siblings_and_answers_once(
    tiny_tokenizer: Any,
    sender_cache: Any,
    mode: str,
    kind: RequestOutputKind,
    miss_child: int,
    finished_before: int | None,
) -> None:
    side = _ours(tiny_tokenizer, sender_cache, mode == "async")
    spec = ReqSpec("p", "ext-p", [1, 415], n=3, kind=kind)
    kids = side.add(spec)
    assert kids == ["0_p", "1_p", "2_p"]
    live = list(kids)
    outs, _ = side.step([eco(k, [272]) for k in live], stats=None)
    if finished_before is not None:
        done = kids[finished_before]
        outs, aborts = side.step([eco(done, [285], FinishReason.LENGTH)], stats=None)
        live.remove(done)
    if side.async_mode:
        side.collectors["p"].get_nowait()  # what the consumer already saw
    bad = kids[miss_child]
    step = [eco(k, [285]) for k in live if k != bad] + [eco(bad, [], FinishReason.ERROR, mm_cache_miss_hashes=["h3"])]
    outs, aborts = side.step(step, stats=None)
    siblings = [k for k in live if k != bad]
    assert sorted(aborts) == sorted(siblings)
    published = _published(side, "p", outs)
    errors = [o for o in published if o.error is not None]
    assert len(errors) == 1
    _assert_error_output(errors[-1], "ext-p", miss_child)
    if side.async_mode:
        assert len(published) == 1  # merged into the one pending output
    else:
        # In LLMEngine mode the siblings' earlier outputs of this step come first.
        assert published[-1] is errors[0]
    assert not sender_cache.is_cached_item("h3")
    # Nothing reaches the parent afterwards: late engine outputs, an abort.
    outs, aborts = side.step([eco(k, [13], FinishReason.LENGTH) for k in siblings], stats=None)
    assert outs == [] and aborts == []
    assert side.op.abort_requests(["ext-p"], internal=False) == []
    assert side.op.abort_requests(["p"], internal=True) == []
    if side.async_mode:
        assert side.collectors["p"].get_nowait() is None
    assert side.op.get_num_unfinished_requests() == 0
    assert side.op.parent_requests == {}


def test_every_miss_of_the_step_is_invalidated_before_any_error_is_visible(
    tiny_tokenizer: Any, sender_cache: Any
) -> None:
    side = _ours(tiny_tokenizer, sender_cache, True)
    for rid in ("a", "b", "c"):
        side.add(ReqSpec(rid, f"ext-{rid}", [1, 415]))
    watch = WatchedEvent(sender_cache, ("h1", "h2"))
    side.collectors["a"].ready = watch
    step = [
        eco("a", [], FinishReason.ERROR, mm_cache_miss_hashes=["h1"]),
        eco("b", [272]),
        eco("c", [], FinishReason.ERROR, mm_cache_miss_hashes=["h2", "h1"]),
        # A miss for a request this processor no longer tracks is still invalidated.
        eco("gone", [], FinishReason.ERROR, mm_cache_miss_hashes=["h3"]),
    ]
    side.step(step, stats=None)
    assert watch.seen == [{"h1": False, "h2": False}]
    assert side.op.counters()["invalidations"] == 3
    assert all(e.mm_cache_miss_hashes is None for e in step)
    assert side.collectors["c"].get_nowait().error.code == MISS_CODE
    assert side.collectors["b"].get_nowait().error is None


def test_renderer_as_cache_source_is_read_at_the_miss(tiny_tokenizer: Any, sender_cache: Any) -> None:
    class Renderer:  # the attribute AsyncLLM/LLMEngine's renderer exposes
        mm_processor_cache = None

    renderer = Renderer()
    side = Side(OurOP(tiny_tokenizer, log_stats=False), True)
    side.op.mm_processor_cache = renderer
    side.add(ReqSpec("r", "r", [1]))
    renderer.mm_processor_cache = sender_cache
    side.step([eco("r", [], FinishReason.ERROR, mm_cache_miss_hashes=["h1"])], stats=None)
    assert not sender_cache.is_cached_item("h1")


@pytest.mark.parametrize("mode", MODES)
def test_pooling_miss_keeps_stock_behaviour(tiny_tokenizer: Any, sender_cache: Any, mode: str) -> None:
    results = []
    for cls in (StockOP, OurOP):
        op = cls(tiny_tokenizer, log_stats=False)
        q = RequestOutputCollector(RequestOutputKind.FINAL_ONLY, "e") if mode == "async" else None
        req = EngineCoreRequest(
            request_id="e",
            prompt_token_ids=[1, 415],
            mm_features=None,
            sampling_params=None,
            pooling_params=PoolingParams(task="embed"),
            arrival_time=0.0,
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
            external_req_id="ext-e",
        )
        op.add_request(req, None, None, 0, q)
        res = op.process_outputs(
            [
                EngineCoreOutput(
                    request_id="e", new_token_ids=[], finish_reason=FinishReason.ERROR, mm_cache_miss_hashes=["h1"]
                )
            ]
        )
        [o] = [q.get_nowait()] if q is not None else res.request_outputs
        assert isinstance(o, PoolingRequestOutput)
        results.append((o.request_id, o.finished, o.error, list(o.prompt_token_ids), res.reqs_to_abort))
    assert results[1] == results[0]
    assert results[0][2].code == MISS_CODE and results[0][2].retryable


def test_error_without_miss_is_stock(tiny_tokenizer: Any) -> None:
    got = []
    for cls in (StockOP, OurOP):
        side = Side(cls(tiny_tokenizer, log_stats=False), False)
        side.add(ReqSpec("r", "r", [1]))
        outs, _ = side.step([eco("r", [272], FinishReason.ERROR, mm_cache_miss_hashes=[])], stats=None)
        got.append([(o.finished, o.outputs[0].finish_reason, getattr(o, "error", None)) for o in outs])
    assert got[0] == got[1] == [(True, "error", None)]
