"""Fuzz `vllm_mmretry.OutputProcessor`'s public methods (add_request,
process_outputs, abort_requests, has_request, ...) with wrong types, wrong shapes,
huge and negative token ids, unknown and duplicate ids. Each call either works or
raises an ordinary exception (one `except Exception` catches); afterwards the
processor still works: every request the fuzz managed to add can be aborted, the
table ends empty, and a normal request completes with exactly the outputs stock
vLLM's OutputProcessor gives it.

Kept apart from the other output-processor tests so it can grow with the core
(every `_core` entry point under `guarded()`, the forced-panic recovery test)."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from output_processor_support import ReqSpec, Side, eco, engine_request, norm
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine import EngineCoreOutput, FinishReason
from vllm.v1.engine.output_processor import OutputProcessor as StockOutputProcessor
from vllm.v1.engine.output_processor import RequestOutputCollector
from vllm.v1.engine.parallel_sampling import ParentRequest

from vllm_mmretry import OutputProcessor

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])

NORMAL = ReqSpec("normal", "normal-ext", [1, 450, 4996, 29892], stop=["zebra"])
NORMAL_STEPS = [[306], [626, 263], [1243, 29889], [13]]


def _expected(tokenizer: Any) -> list[Any]:
    stock = Side(StockOutputProcessor(tokenizer, log_stats=False), True)
    return _run_normal(stock)


def _run_normal(side: Side) -> list[Any]:
    side.add(NORMAL)
    outs = []
    for i, toks in enumerate(NORMAL_STEPS):
        last = i == len(NORMAL_STEPS) - 1
        side.step([eco(NORMAL.request_id, toks, FinishReason.LENGTH if last else None)])
        outs.append(norm(side.drain().get(NORMAL.request_id)))
    return outs


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - an ordinary exception is the contract
        return exc
    except BaseException as exc:  # noqa: BLE001 - PanicException and friends fail
        pytest.fail(f"{getattr(fn, '__name__', fn)} raised {type(exc).__name__}, "
                    f"which `except Exception` does not catch: {exc}")


ids = st.sampled_from(["a", "b", "a", "normal", "", "x" * 300, "\x00", "é", "a-ext"])
odd_token = st.one_of(st.integers(-(2**70), -1), st.integers(2**32, 2**70),
                      st.integers(32000, 2**32 - 1), st.text(max_size=2), st.none(),
                      st.floats(allow_nan=True))
tokens = st.one_of(st.lists(st.integers(0, 31999), max_size=4),
                   st.lists(st.one_of(st.integers(0, 31999), odd_token), max_size=4),
                   st.text(max_size=3), st.none(), st.integers(),
                   st.just(np.array([5, 6])), st.just(np.array([[5, 6]])))
finish = st.one_of(st.none(), st.sampled_from(list(FinishReason)), st.integers(-3, 9),
                   st.text(max_size=3))


@st.composite
def engine_output(draw: Any) -> Any:
    kw: dict[str, Any] = {}
    if draw(st.booleans()):
        kw["stop_reason"] = draw(st.one_of(st.none(), st.integers(), st.text(max_size=3)))
    if draw(st.booleans()):
        kw["mm_cache_miss_hashes"] = draw(st.one_of(
            st.none(), st.lists(st.text(max_size=4), max_size=2), st.lists(st.integers(), max_size=2)))
    return EngineCoreOutput(request_id=draw(st.one_of(ids, st.integers(), st.none())),
                            new_token_ids=draw(tokens), finish_reason=draw(finish), **kw)


@st.composite
def add_call(draw: Any) -> tuple:
    kind = draw(st.sampled_from(["good", "n2", "bad_request", "bad_fields", "bad_args"]))
    rid = draw(ids)
    spec = ReqSpec(rid, rid + "-ext", draw(st.lists(st.integers(0, 31999), min_size=1, max_size=4)),
                   kind=draw(st.sampled_from(list(RequestOutputKind))),
                   stop=draw(st.one_of(st.none(), st.lists(st.text(min_size=1, max_size=3), max_size=2))))
    if kind == "good":
        return ("add", engine_request(spec), "prompt", None, 0, True)
    if kind == "n2":
        return ("add_n", spec)
    if kind == "bad_request":
        return ("add", draw(st.one_of(st.none(), st.text(max_size=3), st.integers(),
                                      st.just({"request_id": "a"}))), None, None, 0, True)
    req = engine_request(spec)
    if kind == "bad_fields":
        field = draw(st.sampled_from(["request_id", "prompt_token_ids", "sampling_params",
                                      "external_req_id", "arrival_time"]))
        setattr(req, field, draw(st.one_of(st.none(), st.integers(-5, 2**65), st.text(max_size=3),
                                           st.lists(odd_token, max_size=3))))
        return ("add", req, "prompt", None, 0, True)
    return ("add", req,
            draw(st.one_of(st.none(), st.integers(), st.text(max_size=3))),
            draw(st.one_of(st.none(), st.integers(), st.text(max_size=2))),
            draw(st.one_of(st.integers(-(2**65), 2**65), st.text(max_size=2), st.none())),
            draw(st.booleans()))


call = st.one_of(
    add_call(),
    st.tuples(st.just("process"),
              st.one_of(st.lists(engine_output(), max_size=4), st.none(), st.integers(),
                        st.text(max_size=3), st.lists(st.integers(), max_size=2))),
    st.tuples(st.just("abort"),
              st.one_of(st.lists(st.one_of(ids, st.integers(), st.none()), max_size=3),
                        ids, st.none(), st.integers()),
              st.one_of(st.booleans(), st.none(), st.integers(-1, 2))),
    st.tuples(st.just("query"), st.one_of(ids, st.integers(), st.none())),
)


def _apply(op: Any, c: tuple, added: set[str]) -> None:
    if c[0] == "add":
        _, req, prompt, parent, index, with_queue = c
        kind = getattr(getattr(req, "sampling_params", None), "output_kind", RequestOutputKind.DELTA)
        queue = RequestOutputCollector(kind, "q") if with_queue else None
        if not isinstance(_call(op.add_request, req, prompt, parent, index, queue), Exception):
            added.add(req.request_id)
    elif c[0] == "add_n":
        spec = copy.copy(c[1])
        spec.n = 2
        req = engine_request(spec)
        parent = ParentRequest(req)
        queue = RequestOutputCollector(spec.kind, spec.request_id)
        for idx in range(2):
            cid, csp = parent.get_child_info(idx)
            child = copy.copy(req)
            child.request_id, child.sampling_params = cid, csp
            if not isinstance(_call(op.add_request, child, "p", parent, idx, queue), Exception):
                added.add(cid)
    elif c[0] == "process":
        _call(op.process_outputs, c[1])
    elif c[0] == "abort":
        _call(op.abort_requests, c[1], c[2])
    else:
        _call(op.has_request, c[1])
        for method in (op.get_num_unfinished_requests, op.has_unfinished_requests,
                       op.get_num_queued_tokens):
            _call(method)


@pytest.fixture(scope="module")
def expected(tiny_tokenizer: Any) -> list[Any]:
    return _expected(tiny_tokenizer)


@SETTINGS
@given(calls=st.lists(call, max_size=12))
def test_fuzzed_calls_leave_a_working_processor(tiny_tokenizer: Any, expected: list[Any],
                                               calls: list[tuple]) -> None:
    op = OutputProcessor(tiny_tokenizer, log_stats=False)
    added: set[str] = set()
    for c in calls:
        _apply(op, c, added)
    # Whatever got in can be stopped, and then nothing is left.
    _call(op.abort_requests, sorted(added), True)
    assert op.get_num_unfinished_requests() == 0, op.request_states
    assert not op.has_unfinished_requests()
    # ... and a normal request still runs exactly as on stock vLLM.
    assert _run_normal(Side(op, True)) == expected
    assert op.get_num_unfinished_requests() == 0


def test_unknown_and_duplicate_ids_are_harmless(tiny_tokenizer: Any, expected: list[Any]) -> None:
    op = OutputProcessor(tiny_tokenizer, log_stats=False)
    side = Side(op, True)
    side.add(ReqSpec("dup", "dup-ext", [1, 2]))
    with pytest.raises(ValueError, match="already tracked"):
        side.add(ReqSpec("dup", "other-ext", [3]))
    assert op.abort_requests(["nope", "nope"], internal=False) == []
    assert op.abort_requests(["dup-ext", "dup-ext"], internal=False) == ["dup"]
    assert op.abort_requests(["dup", "dup"], internal=True) == []
    outs = op.process_outputs([EngineCoreOutput(request_id="dup", new_token_ids=[5]),
                               EngineCoreOutput(request_id="nope", new_token_ids=[5])])
    assert outs.request_outputs == [] and op.get_num_unfinished_requests() == 0
    assert _run_normal(side) == expected
