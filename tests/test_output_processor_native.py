"""The native detokenizer inside the output loop: when it is used (and why not),
a native request leaving the fast path mid-stream (its ids replayed into vLLM's
detokenizer), the miss error text, and odd token ids, each against stock vLLM or
against our own loop with vLLM's Python detokenizer."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from output_processor_support import ReqSpec, Side, eco, engine_request, norm
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine import EngineCoreOutput, FinishReason
from vllm.v1.engine.output_processor import OutputProcessor as StockOP

from vllm_mmretry.output_processor import OutputProcessor as OurOP

TEXT = "Hello world, the quick brown fox jumps over the lazy dog. 東京 ✓ done"


def _pair(tok: Any, async_mode: bool = True) -> tuple[Side, Side]:
    return Side(StockOP(tok, log_stats=True), async_mode), Side(OurOP(tok, log_stats=True), async_mode)


def _step_both(stock: Side, ours: Side, plan: list[tuple[str, list[int], Any]]) -> None:
    a = stock.step([eco(r, t, **kw) for r, t, kw in plan])
    b = ours.step([eco(r, t, **kw) for r, t, kw in plan])
    assert [norm(o) for o in b[0]] == [norm(o) for o in a[0]] and b[1] == a[1]
    sa, sb = stock.drain(), ours.drain()
    assert {k: norm(v) for k, v in sb.items()} == {k: norm(v) for k, v in sa.items()}


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_native_request_leaving_the_fast_path_continues_like_stock(
    tiny_tokenizer: Any, kind: RequestOutputKind
) -> None:
    ids = tiny_tokenizer.encode(TEXT, add_special_tokens=False)
    stock, ours = _pair(tiny_tokenizer, async_mode=kind == RequestOutputKind.DELTA)
    # A stop string with a hold-back buffer: the replay must restore the offset of
    # text already handed out, not only the ids.
    spec = ReqSpec("r", "r", [1, 415], kind=kind, stop=["lazy dog", "zzz"], stream_interval=None)
    stock.add(spec)
    ours.add(spec)
    assert ours.op._core.is_native("r")
    for k in range(0, 6, 2):
        _step_both(stock, ours, [("r", ids[k : k + 2], {})])
    # Routed experts only vLLM's Python RequestState collects.
    _step_both(stock, ours, [("r", ids[6:7], {"routed_experts": np.zeros((1, 2, 2), dtype=np.int32)})])
    assert ours.op.counters()["fallbacks"] == {"routed_experts": 1}
    assert not ours.op._core.is_fast("r")
    # The rest of the text, including the stop string, in Python now.
    for k in range(7, len(ids), 3):
        _step_both(stock, ours, [("r", ids[k : k + 3], {})])
    assert not ours.op.has_request("r") and not stock.op.has_request("r")


def test_miss_error_text_is_the_same_native_or_python(tiny_tokenizer: Any) -> None:
    ids = tiny_tokenizer.encode(TEXT, add_special_tokens=False)
    results, texts = [], []
    for native in (True, False):
        side = Side(OurOP(tiny_tokenizer, log_stats=False, native_detok=native), True)
        side.add(ReqSpec("r", "r", [1], kind=RequestOutputKind.CUMULATIVE, stop=["never seen"]))
        assert side.op._core.is_native("r") == native
        side.step([eco("r", ids[:5])])
        side.step([eco("r", ids[5:9], FinishReason.ERROR, mm_cache_miss_hashes=["h"])])
        out = side.drain()["r"]
        assert out.error is not None and out.finished
        results.append(norm(out))
        texts.append(out.outputs[0].text)
    assert results[0] == results[1]
    assert texts[0] and tiny_tokenizer.decode(ids[:9]).startswith(texts[0])


def test_which_detokenizer_and_why(tiny_tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    op = OurOP(tiny_tokenizer, log_stats=False)
    side = Side(op, False)
    side.add(ReqSpec("a", "a", [1]))
    side.add(ReqSpec("b", "b", [1], detokenize=False))
    # SamplingParams rejects an empty stop string; should one get through, the
    # request is detokenized by vLLM rather than guessed at.
    req = engine_request(ReqSpec("c", "c", [1], stop=["x"]))
    req.sampling_params.stop = ["x", ""]
    op.add_request(req, None, None, 0, None)
    side.add(ReqSpec("d", "d", [1], logprobs=1))
    c = op.counters()
    assert c["native_detok"] == 1 and op._core.is_native("a")
    assert c["python_detok"] == {"no_detokenize": 1, "empty_stop_string": 1}
    assert c["fallbacks"] == {"logprobs": 1}

    monkeypatch.setenv("VLLM_MMRETRY_NATIVE_DETOK", "0")
    off = OurOP(tiny_tokenizer, log_stats=False)
    Side(off, False).add(ReqSpec("a", "a", [1]))
    assert not off._core.has_native_vocab and off.counters()["python_detok"] == {"disabled": 1}
    # The constructor switch wins over the environment.
    assert OurOP(tiny_tokenizer, log_stats=False, native_detok=True)._core.has_native_vocab

    none = OurOP(None, log_stats=False, native_detok=True)
    Side(none, False).add(ReqSpec("a", "a", [1]))
    assert none.counters()["python_detok"] == {"no_tokenizer": 1}


def test_vocabulary_is_loaded_once_per_tokenizer(tiny_tokenizer: Any) -> None:
    from vllm_mmretry.output_processor import native_vocab

    v1, r1 = native_vocab(tiny_tokenizer)
    v2, r2 = native_vocab(tiny_tokenizer)
    assert r1 is None and r2 is None and v1 is v2 and v1.fast_decoder


def test_odd_token_ids_are_handled_like_stock(tiny_tokenizer: Any) -> None:
    """Ids that are no u32 decode to nothing (vLLM logs and skips them), ids past
    the vocabulary decode to nothing; both still count as output tokens."""
    ids = tiny_tokenizer.encode(TEXT, add_special_tokens=False)
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        stock, ours = _pair(tiny_tokenizer)
        spec = ReqSpec("r", "r", [1], kind=kind, stop=["fox"])
        stock.add(spec)
        ours.add(spec)
        _step_both(stock, ours, [("r", ids[:2], {})])
        _step_both(stock, ours, [("r", [-1, ids[2], 2**40], {})])
        _step_both(stock, ours, [("r", [10**6, ids[3]], {})])
        _step_both(stock, ours, [("r", ids[4:12], {})])
        assert not ours.op.has_request("r")


def test_a_stop_string_with_a_lone_surrogate_runs_on_vllms_code(tiny_tokenizer: Any) -> None:
    """The native detokenizer holds UTF-8 text only: such a request falls back (counted)
    and is answered as stock answers it."""
    ids = tiny_tokenizer.encode(TEXT, add_special_tokens=False)
    stock, ours = _pair(tiny_tokenizer)
    spec = ReqSpec("r", "r", [1], stop=["\ud800", "fox"])
    stock.add(spec)
    ours.add(spec)
    assert ours.op.counters()["fallbacks"] == {"unencodable_stop": 1}
    for k in range(0, len(ids), 3):
        if not stock.op.has_request("r"):
            break
        _step_both(stock, ours, [("r", ids[k : k + 3], {})])
    assert not ours.op.has_request("r") and not stock.op.has_request("r")


def _outcome(side: Side, ecos: list[Any]) -> Any:
    """A step's outputs, aborts and collector contents, or the exception it raised."""
    try:
        outs, aborts = side.step(ecos)
    except Exception as e:  # noqa: BLE001 - compared with stock's
        return ("raised", type(e).__name__, str(e), {k: norm(v) for k, v in side.drain().items()})
    return [norm(o) for o in outs], aborts, {k: norm(v) for k, v in side.drain().items()}


@pytest.mark.parametrize("log_stats", [False, True])
@pytest.mark.parametrize("detokenize", [True, False])
@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE,
                                  RequestOutputKind.FINAL_ONLY])
@pytest.mark.parametrize("odd", [None, (9, 10)], ids=["none", "tuple"])
def test_token_ids_that_are_not_a_list_are_answered_by_vllms_code(
    tiny_tokenizer: Any, log_stats: bool, detokenize: bool, kind: RequestOutputKind, odd: Any
) -> None:
    """The decoder always gives a list; an engine of the caller's own may give None or a
    tuple. That request leaves the native loop (counted) and vLLM's Python answers the
    step as stock does, whatever that is (an output, or the same exception), with the
    requests before and after it in the step and the steps after it unchanged."""
    stock = Side(StockOP(tiny_tokenizer, log_stats=log_stats), True)
    ours = Side(OurOP(tiny_tokenizer, log_stats=log_stats), True)
    for rid in "abc":
        spec = ReqSpec(rid, rid, [1], kind=kind, detokenize=detokenize)
        stock.add(spec)
        ours.add(spec)
    steps = [
        [eco(r, [5, 6]) for r in "abc"],
        [eco("a", [7]), EngineCoreOutput(request_id="b", new_token_ids=odd), eco("c", [7])],
        [eco(r, [8], FinishReason.LENGTH) for r in "abc"],
    ]
    for ecos in steps:
        assert _outcome(ours, ecos) == _outcome(stock, ecos)
    assert ours.op.counters()["fallbacks"] == {"token_ids_type": 1}
    assert not ours.op.has_request("b") and not stock.op.has_request("b")
