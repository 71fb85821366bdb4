"""Fuzz the native detokenizer's Python entry points (`_core.NativeVocab`,
`_core.NativeDetokenizer`, `native_detok_fallback_reason`) with wrong types, wrong
shapes, huge and negative token ids: each call either works or raises an ordinary
exception (TypeError / ValueError / RuntimeError for token ids and internal errors;
PyO3's OverflowError for an out-of-range plain int argument; all `Exception`s),
never PyO3's PanicException (a BaseException), and a detokenizer fed bad input
keeps giving the same text as a fresh one fed only the good input."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_mmretry import _core

ORDINARY = (TypeError, ValueError, RuntimeError, OverflowError)
SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def vocab(tiny_tokenizer: Any) -> Any:
    return _core.NativeVocab(tiny_tokenizer._tokenizer.to_str())


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """The call's result, or the ordinary exception it raised; anything else
    (PanicException, SystemExit, ...) fails the test."""
    try:
        return fn(*args, **kwargs)
    except ORDINARY as exc:
        return exc
    except BaseException as exc:  # noqa: BLE001 - the point of the test
        pytest.fail(f"{fn!r} raised {type(exc).__name__} (not an ordinary Exception): {exc}")


good_id = st.integers(0, 31999)
odd_id = st.one_of(
    st.integers(-(2**70), -1), st.integers(2**32, 2**70), st.integers(32000, 2**32 - 1),
    st.just(2**32 - 1), st.floats(allow_nan=True), st.text(max_size=3), st.none(),
    st.booleans(), st.binary(max_size=3), st.just(np.int64(5)), st.just(np.int64(-5)),
    st.just(np.uint64(2**63)), st.just([1, 2]))
ids_arg = st.one_of(
    st.lists(st.one_of(good_id, odd_id), max_size=12),
    st.tuples(good_id, good_id), st.text(max_size=5), st.binary(max_size=5), st.none(),
    st.integers(), st.dictionaries(st.integers(0, 5), st.integers(0, 5), max_size=3),
    st.just(np.array([1, 2, 3], dtype=np.int64)), st.just(np.array([[1, 2], [3, 4]])),
    st.just(np.array([-1], dtype=np.int64)), st.just(iter([1, 2, 3])),
    st.just(range(5)))


@SETTINGS
@given(ids=ids_arg, skip=st.one_of(st.booleans(), st.none(), st.integers(), st.text(max_size=2)))
def test_vocab_decode(vocab: Any, ids: Any, skip: Any) -> None:
    out = _call(vocab.decode, ids, skip)
    if not isinstance(out, Exception):
        assert isinstance(out, str)


def test_out_of_range_ids_name_the_problem(vocab: Any) -> None:
    with pytest.raises(ValueError, match="outside"):
        vocab.decode([1, -1])
    with pytest.raises(ValueError, match="outside"):
        vocab.decode([2**40])
    with pytest.raises(TypeError, match="str"):
        vocab.decode("hello")
    with pytest.raises(TypeError, match="ints"):
        vocab.decode([1.5])
    # Ids past the vocabulary are valid u32s: they decode to nothing, as in vLLM.
    assert vocab.decode([2**32 - 1]) == ""


@SETTINGS
@given(json=st.one_of(st.text(max_size=50), st.just("{}"), st.just('{"model": 1}'),
                      st.just("[]"), st.integers(), st.none(), st.binary(max_size=5)))
def test_vocab_construction(json: Any) -> None:
    out = _call(_core.NativeVocab, json)
    assert isinstance(out, Exception)


@SETTINGS
@given(path=st.one_of(st.text(max_size=20), st.just("/"), st.just("/dev/null"),
                      st.just("/nonexistent/tokenizer.json"), st.none(), st.integers()))
def test_vocab_from_file(path: Any) -> None:
    assert isinstance(_call(_core.NativeVocab.from_file, path), Exception)


@SETTINGS
@given(n=st.one_of(st.integers(-5, 50), st.integers(10**8, 10**30)),
       max_len=st.one_of(st.integers(-5, 40), st.integers(10**6, 10**30)),
       seed=st.one_of(st.integers(-(2**70), 2**70), st.text(max_size=2)))
def test_vocab_self_check(vocab: Any, n: Any, max_len: Any, seed: Any) -> None:
    out = _call(vocab.self_check, n, max_len, seed)
    if not isinstance(out, Exception):
        assert out == []


detok_kwargs = st.fixed_dictionaries({}, optional={
    "skip_special_tokens": st.one_of(st.booleans(), st.integers()),
    "spaces_between_special_tokens": st.booleans(),
    "stop": st.one_of(st.none(), st.lists(st.text(max_size=4), max_size=3), st.text(max_size=3),
                      st.lists(st.integers(), max_size=2)),
    "include_stop_str_in_output": st.booleans(),
    "min_tokens": st.one_of(st.integers(-3, 5), st.integers(2**64, 2**65)),
})


@SETTINGS
@given(prompt=ids_arg, kwargs=detok_kwargs)
def test_detokenizer_construction(vocab: Any, prompt: Any, kwargs: dict) -> None:
    out = _call(_core.NativeDetokenizer, vocab, prompt, **kwargs)
    if not isinstance(out, Exception):
        assert out.num_output_tokens() == 0
    assert isinstance(_call(_core.NativeDetokenizer, "not a vocab", [1]), Exception)


@SETTINGS
@given(steps=st.lists(st.tuples(ids_arg, st.one_of(st.booleans(), st.none(), st.integers())),
                      max_size=8),
       text=st.lists(good_id, min_size=1, max_size=6))
def test_detokenizer_survives_bad_updates(vocab: Any, steps: list, text: list[int]) -> None:
    """Bad updates raise before touching the state: interleaved with good steps,
    the detokenizer ends exactly where one fed only the good steps ends."""
    fuzzed = _core.NativeDetokenizer(vocab, [1, 2])
    clean = _core.NativeDetokenizer(vocab, [1, 2])
    for ids, stop_terminated in steps:
        out = _call(fuzzed.update, ids, stop_terminated)
        if not isinstance(out, Exception):  # a valid update: do the same on the clean one
            clean.update(list(ids), bool(stop_terminated))
        _call(fuzzed.get_next_output_text, ids, stop_terminated)
    for tok in text:
        assert fuzzed.update([tok], False) == clean.update([tok], False)
        assert fuzzed.get_next_output_text(False, True) == clean.get_next_output_text(False, True)
    assert fuzzed.output_text == clean.output_text
    assert fuzzed.output_token_ids == clean.output_token_ids
    assert fuzzed.num_output_tokens() == clean.num_output_tokens()


@SETTINGS
@given(stop=st.one_of(st.none(), st.lists(st.text(max_size=4), max_size=3), st.text(max_size=3),
                      st.integers(), st.lists(st.one_of(st.integers(), st.none()), max_size=2)))
def test_fallback_reason(stop: Any) -> None:
    out = _call(_core.native_detok_fallback_reason, stop)
    assert out is None or isinstance(out, (str, Exception))
