"""Requests that need vLLM's own per-request code (here: logprobs) are owned by an
embedded stock OutputProcessor: its `process_outputs` steps them, one call per run
of their outputs in a step, and the results equal a stock processor's; a miss on
such a request still gets our contract, and nothing is left behind in either table."""

from __future__ import annotations

from typing import Any

import pytest
from output_processor_support import ReqSpec, Side, eco, norm
from vllm.v1.engine import FinishReason
from vllm.v1.engine.output_processor import OutputProcessor as StockOP

from vllm_mmretry.output_processor import OutputProcessor as OurOP

MISS_CODE = "multimodal_cache_miss"


@pytest.fixture
def batches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, list[str]]]:
    """Every call of vLLM's `OutputProcessor.process_outputs`: (id of the
    processor, request ids of the batch)."""
    calls: list[tuple[int, list[str]]] = []
    original = StockOP.process_outputs

    def recording(self: Any, ecos: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append((id(self), [e.request_id for e in ecos]))
        return original(self, ecos, *args, **kwargs)

    monkeypatch.setattr(StockOP, "process_outputs", recording)
    return calls


def _embedded(ours: Side) -> Any:
    return ours.op._stock.op


@pytest.mark.parametrize("async_mode", [True, False])
def test_fallback_requests_run_in_vllms_own_loop(tiny_tokenizer: Any, async_mode: bool,
                                                 batches: list[tuple[int, list[str]]]) -> None:
    stock = Side(StockOP(tiny_tokenizer, log_stats=False), async_mode)
    ours = Side(OurOP(tiny_tokenizer, log_stats=False), async_mode)
    specs = [ReqSpec("plain", "e1", [1, 2]), ReqSpec("lp1", "e2", [1, 2], logprobs=1),
             ReqSpec("lp2", "e3", [1, 2], logprobs=2)]
    for spec in specs:
        stock.add(spec)
        ours.add(spec)
    assert set(_embedded(ours).request_states) == {"lp1", "lp2"}
    assert set(ours.op.request_states) == {"plain", "lp1", "lp2"}
    steps = [
        [eco("plain", [450]), eco("lp1", [272], logprobs=1), eco("lp2", [306], logprobs=2)],
        [eco("lp1", [450], logprobs=1), eco("plain", [272]), eco("lp2", [450], logprobs=2)],
        [eco("lp2", [272], FinishReason.LENGTH, logprobs=2), eco("plain", [306], FinishReason.LENGTH)],
    ]
    expected_batches = [[["lp1", "lp2"]], [["lp1"], ["lp2"]], [["lp2"]]]
    for ecos, expected in zip(steps, expected_batches, strict=True):
        batches.clear()
        want, want_aborts = stock.step(ecos)
        got, got_aborts = ours.step(ecos)
        embedded = [b for who, b in batches if who == id(_embedded(ours))]
        assert embedded == expected  # one call per run, in the engine's order
        assert [norm(o) for o in got] == [norm(o) for o in want] and got_aborts == want_aborts
        assert {k: norm(v) for k, v in ours.drain().items()} == {
            k: norm(v) for k, v in stock.drain().items()}
    assert set(_embedded(ours).request_states) == {"lp1"}
    assert ours.op.abort_requests(["e2"], internal=False) == stock.op.abort_requests(["e2"], internal=False)
    assert {k: norm(v) for k, v in ours.drain().items()} == {k: norm(v) for k, v in stock.drain().items()}
    assert not ours.op.has_unfinished_requests() and not _embedded(ours).request_states
    assert not _embedded(ours).external_req_ids and not _embedded(ours).parent_requests


def test_miss_on_a_fallback_child_answers_the_parent_once(tiny_tokenizer: Any) -> None:
    ours = Side(OurOP(tiny_tokenizer, log_stats=False), True)
    ids = ours.add(ReqSpec("r", "e", [1, 2], n=3, logprobs=1))
    assert set(_embedded(ours).request_states) == set(ids)
    ours.step([eco(ids[0], [450], logprobs=1)])
    ours.drain()
    miss = eco(ids[1], [], FinishReason.ERROR, mm_cache_miss_hashes=["h"])
    # ids[0] runs on (aborted), ids[2] finishes in this very step (not aborted).
    _, reqs_to_abort = ours.step([eco(ids[0], [272], logprobs=1), miss,
                                  eco(ids[2], [306], FinishReason.LENGTH, logprobs=1)])
    assert reqs_to_abort == [ids[0]]
    out = ours.drain()["r"]
    assert out.finished and out.error is not None and out.error.code == MISS_CODE
    assert [c.finish_reason for c in out.outputs if c.index == 1] == ["error"]
    assert not ours.op.has_unfinished_requests() and not ours.op.parent_requests
    embedded = _embedded(ours)
    assert not embedded.request_states and not embedded.external_req_ids and not embedded.parent_requests


def test_fast_request_handed_over_mid_stream_is_stepped_by_vllm(
        tiny_tokenizer: Any, batches: list[tuple[int, list[str]]]) -> None:
    import numpy as np

    stock = Side(StockOP(tiny_tokenizer, log_stats=False), True)
    ours = Side(OurOP(tiny_tokenizer, log_stats=False), True)
    for side in (stock, ours):
        side.add(ReqSpec("r", "e", [1, 2]))
    experts = {"routed_experts": np.zeros((1, 2, 2), dtype=np.int32)}
    for ecos in ([eco("r", [450])], [eco("r", [272], **experts)], [eco("r", [306], FinishReason.LENGTH)]):
        ours.step(ecos)
        stock.step(ecos)
        assert {k: norm(v) for k, v in ours.drain().items()} == {k: norm(v) for k, v in stock.drain().items()}
    embedded = [b for who, b in batches if who == id(_embedded(ours))]
    assert embedded == [["r"], ["r"]]  # from the hand-over on
    assert not ours.op.has_unfinished_requests() and not _embedded(ours).request_states
