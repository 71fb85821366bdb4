"""A Rust panic inside one request's step (forced with the test-only
VLLM_MMRETRY_TEST_PANIC_ON_REQUEST) is recovered in `process_outputs`: no
exception reaches the caller, that request (n>1: its parent) gets exactly one
terminal, non-retryable error output and is listed in `reqs_to_abort`, the
step's miss hashes are still invalidated in P0, and the other requests (in the
same step and later) produce exactly what stock vLLM's OutputProcessor produces."""

from __future__ import annotations

from typing import Any

import pytest
from output_processor_support import ReqSpec, Side, eco, norm
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine import FinishReason
from vllm.v1.engine.output_processor import OutputProcessor as StockOP

from vllm_mmretry.output_processor import OutputProcessor as OurOP

PANIC_ENV = "VLLM_MMRETRY_TEST_PANIC_ON_REQUEST"
KINDS = [RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY]
MODES = ["async", "engine"]
# The requests that go on, on both sides: "ok" was added long before, "same" has an
# output in the panicked step too.
HEALTHY = ("ok", "same")


@pytest.fixture(scope="module")
def model_config(tiny_model_path: str) -> Any:
    from vllm.config import ModelConfig

    return ModelConfig(model=tiny_model_path, dtype="float32", max_model_len=512)


@pytest.fixture
def sender_cache(model_config: Any) -> Any:
    """P0's real LRU sender cache, holding "h1" and "h2"."""
    from vllm.multimodal.cache.lru import LruKeyReplicatedSenderCache
    from vllm.multimodal.inputs import MultiModalKwargsItem

    cache = LruKeyReplicatedSenderCache(model_config)
    for h in ("h1", "h2"):
        cache.get_and_update_item((MultiModalKwargsItem.dummy(), []), h)
        assert cache.is_cached_item(h)
    return cache


def _outputs(side: Side, outs: list, ext: str) -> list[Any]:
    """What the consumer of `ext` sees after one step (collector or returned list)."""
    if side.async_mode:
        o = side.collectors[ext.removeprefix("ext-")].get_nowait()
        return [] if o is None else [o]
    return [o for o in outs if o.request_id == ext]


def _healthy_step(stock: Side, ours: Side, ecos_both: list, ecos_ours_only: list) -> tuple[list, list[str]]:
    """One step on both sides; the healthy requests' outputs must be equal.
    Returns our outputs and reqs_to_abort."""
    s_outs, s_aborts = stock.step(ecos_both, stats=None)
    o_outs, o_aborts = ours.step(ecos_both + ecos_ours_only, stats=None)
    assert s_aborts == []
    for rid in (r for r in HEALTHY if r in stock.children):
        assert [norm(o) for o in _outputs(ours, o_outs, f"ext-{rid}")] == \
            [norm(o) for o in _outputs(stock, s_outs, f"ext-{rid}")]
    return o_outs, o_aborts


def _assert_internal_error(o: Any) -> None:
    assert isinstance(o, RequestOutput)
    assert o.request_id == "ext-b" and o.finished is True
    assert o.error is not None and o.error.code == "internal_error" and o.error.retryable is False
    assert PANIC_ENV in o.error.message
    assert any(c.finish_reason == "error" for c in o.outputs)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n, logprobs", [(1, None), (1, 1), (3, None)])
def test_panic_in_step_fails_only_its_request(
    tiny_tokenizer: Any, sender_cache: Any, monkeypatch: pytest.MonkeyPatch,
    mode: str, kind: RequestOutputKind, n: int, logprobs: int | None,
) -> None:
    panicking = "b" if n == 1 else "1_b"
    monkeypatch.setenv(PANIC_ENV, f"unknown-id, {panicking}")
    async_mode = mode == "async"
    stock = Side(StockOP(tiny_tokenizer, log_stats=False), async_mode)
    ours = Side(OurOP(tiny_tokenizer, log_stats=False), async_mode)
    ours.op.mm_processor_cache = sender_cache
    for side in (stock, ours):
        side.add(ReqSpec("ok", "ext-ok", [1, 415, 2936], kind=kind))
    _healthy_step(stock, ours, [eco("ok", [272])], [])

    # "b" (n>1: its children) and "same" arrive; b's panicking request is not
    # stepped until the panicked step.
    kids = ours.add(ReqSpec("b", "ext-b", [1, 450], n=n, kind=kind, logprobs=logprobs))
    stock.add(ReqSpec("same", "ext-same", [1, 910], kind=kind))
    ours.add(ReqSpec("same", "ext-same", [1, 910], kind=kind))
    early = [eco(k, [285], logprobs=logprobs) for k in kids if k != panicking]
    _healthy_step(stock, ours, [eco("ok", [285]), eco("same", [338])], early)
    if async_mode:
        ours.collectors["b"].get_nowait()  # what b's consumer already saw

    # The panicked step: b's panicking output also reports a P1 miss.
    miss = eco(panicking, [], FinishReason.ERROR, mm_cache_miss_hashes=["h1"])
    kid_ecos = [miss if k == panicking else eco(k, [13]) for k in kids]
    outs, aborts = _healthy_step(stock, ours, [eco("ok", [263]), eco("same", [1781])], kid_ecos)
    assert sorted(aborts) == sorted(kids)
    published = _outputs(ours, outs, "ext-b")
    errors = [o for o in published if getattr(o, "error", None) is not None]
    assert len(errors) == 1 and published[-1] is errors[0]
    _assert_internal_error(errors[0])
    if async_mode:
        assert len(published) == 1
    # The miss is handled as without the panic: invalidated in P0, consumed.
    assert not sender_cache.is_cached_item("h1") and sender_cache.is_cached_item("h2")
    assert miss.mm_cache_miss_hashes is None
    assert ours.op.counters()["failed_steps"] == 1
    assert not any(ours.op.has_request(k) for k in kids)
    assert "b" not in ours.op.parent_requests

    # Nothing more for b (late engine outputs, an abort); the others finish as stock.
    outs, aborts = _healthy_step(
        stock, ours, [eco("ok", [29889], FinishReason.LENGTH), eco("same", [29889])],
        [eco(k, [29889], FinishReason.LENGTH) for k in kids])
    assert aborts == [] and _outputs(ours, outs, "ext-b") == []
    assert ours.op.abort_requests(["ext-b"], internal=False) == []
    _healthy_step(stock, ours, [eco("same", [2], FinishReason.STOP, stop_reason=None)], [])
    assert ours.op.get_num_unfinished_requests() == stock.op.get_num_unfinished_requests() == 0
    if async_mode:
        assert ours.collectors["b"].get_nowait() is None


def test_panic_variable_is_read_when_a_processor_is_built(tiny_tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the test variable nothing panics, and the variable is read when a
    processor is built (a processor built before it was set is unaffected)."""
    before = Side(OurOP(tiny_tokenizer, log_stats=False), False)
    monkeypatch.setenv(PANIC_ENV, "x")
    before.add(ReqSpec("x", "ext-x", [1, 415]))
    outs, aborts = before.step([eco("x", [272], FinishReason.LENGTH)], stats=None)
    assert aborts == [] and [o.error for o in outs] == [None]
    assert before.op.counters()["failed_steps"] == 0
