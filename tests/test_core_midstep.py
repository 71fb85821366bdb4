"""A step that raises part-way, and finish reasons that are not vLLM's members: what
was processed before the failing output stays processed as in stock vLLM (no request
left in the table, none lost, no ids replayed twice, no miss carried into the next
step), and an output the core cannot prove it handles like stock goes to vLLM's code."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from output_processor_support import ReqSpec, Side, eco, norm
from vllm.v1.engine import EngineCoreOutput, FinishReason
from vllm.v1.engine.output_processor import OutputProcessor as StockOP

from vllm_mmretry.output_processor import OutputProcessor as OurOP


def sides(tokenizer: Any, async_mode: bool) -> tuple[Side, Side]:
    """Stock vLLM's OutputProcessor and ours, side by side."""
    return (Side(StockOP(tokenizer, log_stats=False), async_mode),
            Side(OurOP(tokenizer, log_stats=False), async_mode))


def both_raise_on_a_malformed_miss(stock: Side, ours: Side, rid: str) -> None:
    """A miss output whose new_token_ids is not a list: both sides raise."""
    for side in (stock, ours):
        with pytest.raises(TypeError):
            side.step([EngineCoreOutput(request_id=rid, new_token_ids=5,  # type: ignore[arg-type]
                                        finish_reason=FinishReason.ERROR, mm_cache_miss_hashes=["h"])])


@pytest.mark.parametrize("async_mode", [True, False])
def test_output_raising_after_a_stock_owned_final_output_still_finishes_that(
        tiny_tokenizer: Any, async_mode: bool) -> None:
    """[A (stock-owned: logprobs) finishes, then an output whose request id is no str]:
    ours raises TypeError at the second output, having finished A as stock's loop
    does before it reaches the second one (A's output is waiting for vLLM's code
    when the second output raises)."""
    stock, ours = sides(tiny_tokenizer, async_mode)
    for side in (stock, ours):
        side.add(ReqSpec("A", "ext-A", [1, 2], logprobs=1))
    batch = lambda: [eco("A", [450], FinishReason.LENGTH, logprobs=1),  # noqa: E731
                     EngineCoreOutput(request_id=7, new_token_ids=[272])]  # type: ignore[arg-type]
    stock.op.process_outputs(batch(), 2000.0, None)  # stock skips an id it does not track
    with pytest.raises(TypeError, match="request_id"):
        ours.op.process_outputs(batch(), 2000.0, None)
    assert not stock.op.has_request("A")
    assert not ours.op.has_request("A"), "A's final output was dropped"
    if async_mode:
        assert [norm(o) for o in ours.drain().values()] == [norm(o) for o in stock.drain().values()]


@pytest.mark.parametrize("async_mode", [True, False])
def test_vllms_code_raising_part_way_still_forgets_what_it_finished(tiny_tokenizer: Any,
                                                                   async_mode: bool) -> None:
    """[A finishes, C raises] both stock-owned: vLLM's own process_outputs finishes
    A, then raises on C. Our table must forget A as stock's does."""
    stock, ours = sides(tiny_tokenizer, async_mode)
    for side in (stock, ours):
        side.add(ReqSpec("A", "ext-A", [1, 2], logprobs=1))
        side.add(ReqSpec("C", "ext-C", [1, 3], logprobs=1))
    batch = lambda: [eco("A", [450], FinishReason.LENGTH, logprobs=1),  # noqa: E731
                     EngineCoreOutput(request_id="C", new_token_ids=5)]
    with pytest.raises(TypeError):
        stock.op.process_outputs(batch(), 2000.0, None)
    with pytest.raises(TypeError):
        ours.op.process_outputs(batch(), 2000.0, None)
    assert set(stock.op.request_states) == {"C"}
    assert set(ours.op._stock.op.request_states) == {"C"}
    assert set(ours.op.request_states) == set(stock.op.request_states)
    assert ours.op.get_num_unfinished_requests() == stock.op.get_num_unfinished_requests()
    assert ours.op.abort_requests(["A"], internal=True) == stock.op.abort_requests(["A"], internal=True)


@pytest.mark.parametrize("kind", ["cumulative", "delta"])
def test_failed_miss_step_then_demotion_replays_the_ids_once(tiny_tokenizer: Any, kind: str) -> None:
    """A miss step replays a native request's ids into vLLM's detokenizer before its
    error output is built; when that raises, the request goes on with vLLM's
    detokenizer, so a later demotion does not replay the ids a second time."""
    from vllm.sampling_params import RequestOutputKind

    k = RequestOutputKind.CUMULATIVE if kind == "cumulative" else RequestOutputKind.DELTA
    stock, ours = sides(tiny_tokenizer, False)
    for side in (stock, ours):
        side.add(ReqSpec("r", "ext-r", [1, 2], kind=k))
    assert ours.op._core.is_native("r")
    s1, _ = stock.step([eco("r", [450, 4996])])
    o1, _ = ours.step([eco("r", [450, 4996])])
    assert [norm(o) for o in o1] == [norm(o) for o in s1]
    both_raise_on_a_malformed_miss(stock, ours, "r")
    # Next step: an output that sends the request to vLLM's code (routed experts).
    step3 = lambda: [EngineCoreOutput(request_id="r", new_token_ids=[272], finish_reason=FinishReason.LENGTH,  # noqa: E731
                                      routed_experts=np.zeros((1, 2), dtype=np.int32))]
    s3, _ = stock.step(step3())
    o3, _ = ours.step(step3())
    st = [dict(dict(o[1])["outputs"][0][1])["text"] for o in map(norm, s3)]
    ot = [dict(dict(o[1])["outputs"][0][1])["text"] for o in map(norm, o3)]
    assert ot == st


@pytest.mark.parametrize("async_mode", [True, False])
def test_failed_miss_step_leaves_a_stock_owned_request_with_vllm(tiny_tokenizer: Any, async_mode: bool) -> None:
    """A stock-owned request leaves the embedded stock processor only once its miss
    step's error output is built: when that raises, vLLM's code still steps it and
    its next output finishes it, as in stock."""
    stock, ours = sides(tiny_tokenizer, async_mode)
    for side in (stock, ours):
        side.add(ReqSpec("L", "ext-L", [1, 2], logprobs=1))
    both_raise_on_a_malformed_miss(stock, ours, "L")
    s_outs, _ = stock.step([eco("L", [450], FinishReason.LENGTH, logprobs=1)])
    o_outs, _ = ours.step([eco("L", [450], FinishReason.LENGTH, logprobs=1)])
    s_seen = [norm(o) for o in s_outs] + [norm(o) for o in stock.drain().values()]
    o_seen = [norm(o) for o in o_outs] + [norm(o) for o in ours.drain().values()]
    assert o_seen == s_seen


@pytest.fixture(scope="module")
def model_config(tiny_model_path: str) -> Any:
    from vllm.config import ModelConfig

    return ModelConfig(model=tiny_model_path, dtype="float32", max_model_len=512)


def _put(cache: Any, h: str) -> None:
    from vllm.multimodal.inputs import MultiModalKwargsItem

    cache.get_and_update_item((MultiModalKwargsItem.dummy(), []), h)


def test_misses_of_a_failed_step_are_not_invalidated_by_the_next(tiny_tokenizer: Any, model_config: Any) -> None:
    from vllm.multimodal.cache.lru import LruKeyReplicatedSenderCache

    cache = LruKeyReplicatedSenderCache(model_config)
    _put(cache, "h1")
    ours = Side(OurOP(tiny_tokenizer, log_stats=False), True)
    ours.op.mm_processor_cache = cache
    ours.add(ReqSpec("a", "ext-a", [1, 2]))
    ours.add(ReqSpec("b", "ext-b", [1, 3]))
    ours.add(ReqSpec("c", "ext-c", [1, 4]))
    with pytest.raises(TypeError):
        ours.step([eco("a", [], FinishReason.ERROR, mm_cache_miss_hashes=["h1"]),
                   EngineCoreOutput(request_id="b", new_token_ids=[], finish_reason=FinishReason.ERROR,
                                    mm_cache_miss_hashes=[3])])
    # P0 (re)caches h1 for a new request; P1 gets the data with it.
    _put(cache, "h1")
    # An ordinary step with no miss at all.
    ours.step([eco("c", [450])])
    assert cache.is_cached_item("h1"), "a step without any miss invalidated h1 (left over from the failed step)"



@pytest.mark.parametrize("fr", [0, 1, True, np.int64(1), "done"], ids=["int0", "int1", "bool", "np1", "str"])
def test_finish_reason_that_is_no_member_is_vllms_to_handle(tiny_tokenizer: Any, fr: Any) -> None:
    res = {}
    for name, op in (("stock", StockOP(tiny_tokenizer, log_stats=False)),
                     ("ours", OurOP(tiny_tokenizer, log_stats=False))):
        side = Side(op, False)
        side.add(ReqSpec("r", "ext-r", [1, 2]))
        try:
            outs, aborts = side.step([EngineCoreOutput(request_id="r", new_token_ids=[450, 272],
                                                       finish_reason=fr)])
            res[name] = ([norm(o) for o in outs], aborts, op.has_request("r"))
        except Exception as e:  # noqa: BLE001
            res[name] = ("raised", type(e).__name__)
    fr_of = {k: (v if v[0] == "raised" else
                 [dict(dict(o[1])["outputs"][0][1])["finish_reason"] for o in v[0]]) for k, v in res.items()}
    assert fr_of["ours"] == fr_of["stock"]
    assert res["ours"] == res["stock"]
