"""Differential suite for request statistics (log_stats=True): stock vLLM's
OutputProcessor and ours, driven side by side with the same hypothesis-generated
requests and EngineCoreOutput streams, must produce the same statistics field by
field: the IterationStats of every step (finished-request records included), every
live request's RequestStateStats, and the `metrics` of every RequestOutput.

Every timestamp is injected (arrival, iteration, engine core, event stamps) as a
random float (now and then an int), and values are compared by repr: exactly,
and by type (0 != 0.0). Ours records plain decode steps (past prefill, no events,
no NaN count) natively and hands every other output to vLLM's update_from_output;
both paths must give stock's values.
Outputs carry what drives the stats: QUEUED/SCHEDULED/PREEMPTED events, prefill
stats, NaN counts (with VLLM_COMPUTE_NANS_IN_LOGITS off and on), finish reasons,
stop strings, aborts, n>1 parents, logprobs (vLLM's own path inside ours), and on vLLM
0.34 the engine's `watermarking` verdict (usually on the first output, now and then on a
later one, where ours must not count the output natively)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import vllm.envs as envs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from output_processor_support import ReqSpec, Side, eco, new_iteration_stats, norm
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine import EngineCoreEvent, EngineCoreEventType, EngineCoreOutput, FinishReason
from vllm.v1.engine.output_processor import OutputProcessor as StockOP
from vllm.v1.metrics.stats import PrefillStats

from vllm_mmretry import prom
from vllm_mmretry.output_processor import OutputProcessor as OurOP

TEXT = "The quick brown fox jumps over the lazy dog.\nA cab of zzz, the end."
STOPS = ["fox", " the", "og."]
FINISHES = [None] * 8 + [FinishReason.LENGTH, FinishReason.STOP, FinishReason.ABORT, FinishReason.ERROR]
QUEUED, SCHEDULED, PREEMPTED = EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED, EngineCoreEventType.PREEMPTED
NANS_ENV = "VLLM_COMPUTE_NANS_IN_LOGITS"
# vLLM 0.34's EngineCoreOutput says whether the sampler watermarked the request.
HAS_WATERMARKING = "watermarking" in EngineCoreOutput.__struct_fields__


@dataclass
class StatsSpec(ReqSpec):
    """A request with the watermark settings vLLM copies into its RequestStateStats."""

    watermarking: bool | None = None
    watermark_skipped: bool = False

    def sampling_params(self) -> SamplingParams:
        sp = super().sampling_params()
        # Set after construction, as vLLM's InputProcessor leaves them.
        sp.watermarking = self.watermarking
        sp._watermarking_skipped = self.watermark_skipped
        return sp


def _clear_envs_cache() -> None:
    """vllm.envs may cache every variable (enable_envs_cache); forget the values."""
    if envs._is_envs_cache_enabled():
        envs.__getattr__.cache_clear()


@pytest.fixture(params=[False, True], ids=["nans_off", "nans_on"])
def compute_nans(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[bool]:
    """VLLM_COMPUTE_NANS_IN_LOGITS as vLLM's stats code sees it (checked: a cached
    value would silently test one setting only)."""
    monkeypatch.setenv(NANS_ENV, "1" if request.param else "0")
    monkeypatch.delenv("VLLM_RAISE_ON_LOGIT_NANS", raising=False)  # implies it
    _clear_envs_cache()
    prom.unpin_envs()  # an engine built earlier in this process pinned its value
    assert envs.VLLM_COMPUTE_NANS_IN_LOGITS is request.param
    yield request.param
    monkeypatch.undo()
    _clear_envs_cache()


@pytest.fixture(scope="module")
def text_tokens(tiny_tokenizer: Any) -> list[int]:
    return tiny_tokenizer.encode(TEXT, add_special_tokens=False)


# ------------------------------------------------------------------ comparable forms


def _exact(obj: Any) -> str:
    """Every attribute by repr: exact floats, and int/float/bool told apart."""
    return repr(sorted(vars(obj).items()))


def iteration_stats_form(its: Any) -> str:
    d = dict(vars(its))
    d["prompt_token_stats"] = _exact(d["prompt_token_stats"])
    d["finished_requests"] = [(type(f).__name__, _exact(f)) for f in d["finished_requests"]]
    return repr(sorted(d.items()))


def request_stats_form(op: Any) -> dict[str, Any]:
    """Per live request: its RequestStateStats and the prefill facts kept beside them."""
    return {
        rid: (_exact(s.stats), repr((s.is_prefilling, s.num_cached_tokens, s.num_cache_creation_tokens)))
        for rid, s in op.request_states.items()
    }


def outputs_form(outs: Any) -> list[Any]:
    """norm() (every field) plus the exact form of `metrics` (norm compares by ==)."""
    return [(norm(o), None if getattr(o, "metrics", None) is None else _exact(o.metrics)) for o in outs]


# ------------------------------------------------------------------ stream generation


def _events(data: st.DataObject, first: bool, lo: float, hi: float) -> list[tuple[Any, float]] | None:
    """(type, stamp) of one output's engine core events, stamped within [lo, hi]:
    usually QUEUED+SCHEDULED on a request's first output, sometimes PREEMPTED+
    SCHEDULED on a later one, now and then any sequence (empty included)."""
    usual = [QUEUED, SCHEDULED] if first else [PREEMPTED, SCHEDULED]
    choice = data.draw(st.sampled_from(["usual"] * (6 if first else 1) + ["none"] * (1 if first else 5) + ["any"]))
    if choice == "none":
        return None
    types = usual if choice == "usual" else data.draw(st.lists(st.sampled_from(list(EngineCoreEventType)), max_size=3))
    stamps = sorted(data.draw(st.lists(st.floats(lo, hi), min_size=len(types), max_size=len(types))))
    return list(zip(types, stamps, strict=True))


def _prefill(data: st.DataObject, first: bool, prompt_len: int) -> tuple[int, int, int, int] | None:
    """(prompt, local cached, external cached, finalize's cached) of a consistent
    PrefillStats: usually on a request's first output, rarely on a later one."""
    if not data.draw(st.sampled_from([True] * 4 + [False] if first else [False] * 9 + [True])):
        return None
    local = data.draw(st.integers(0, prompt_len))
    external = data.draw(st.integers(0, prompt_len - local))
    return prompt_len, local, external, data.draw(st.integers(0, prompt_len + 2))


def _watermarking(data: st.DataObject, first: bool) -> bool | None:
    """The engine's watermarking verdict on one output (0.34; None elsewhere): sent on
    a request's first output when a watermark config is set, rarely on a later one."""
    if not HAS_WATERMARKING or not data.draw(st.sampled_from([True, False] if first else [False] * 9 + [True])):
        return None
    return data.draw(st.booleans())


class TextWalk:
    """Where each request is in the text its outputs walk through (so stop strings
    match), and which requests are past their first output (prefill)."""

    def __init__(self, tokens: list[int], prompt_len: dict[str, int]) -> None:
        self.tokens, self.prompt_len = tokens, prompt_len
        self.at: dict[str, int] = {}
        self.started: set[str] = set()

    def step(self, data: st.DataObject, rid: str, lo: float, hi: float, max_new: int,
             nans: st.SearchStrategy[Any]) -> dict[str, Any]:
        """`rid`'s output in one engine step stamped between `lo` and `hi`: its next 0 to
        `max_new` tokens of the text (from a random start), a finish (with a token unless
        aborted), events, prefill statistics on its first output, a NaN count from `nans`."""
        first = rid not in self.started
        self.started.add(rid)
        at = self.at.setdefault(rid, data.draw(st.integers(0, len(self.tokens) - 1)))
        k = data.draw(st.integers(0, max_new))
        self.at[rid] = at + k
        step = {
            "tokens": [self.tokens[(at + j) % len(self.tokens)] for j in range(k)],
            "finish": data.draw(st.sampled_from(FINISHES)),
            "events": _events(data, first, lo, hi),
            "prefill": _prefill(data, first, self.prompt_len[rid]),
            "nans": data.draw(nans),
            "watermarking": _watermarking(data, first),
        }
        if step["finish"] not in (None, FinishReason.ABORT) and not step["tokens"]:
            step["tokens"] = [self.tokens[0]]
        return step


def _build(rid: str, step: dict[str, Any], logprobs: int | None) -> Any:
    """A fresh EngineCoreOutput for one side (the processors may mutate them)."""
    kw: dict[str, Any] = {"num_nans_in_logits": step["nans"]}
    if step["events"] is not None:
        kw["events"] = [EngineCoreEvent(type=t, timestamp=ts) for t, ts in step["events"]]
    if step.get("watermarking") is not None:
        kw["watermarking"] = step["watermarking"]
    if step["prefill"] is not None:
        prompt, local, external, cached = step["prefill"]
        ps = PrefillStats()
        ps.set(prompt, local, external)
        ps.finalize(cached)
        kw["prefill_stats"] = ps
    return eco(rid, step["tokens"], step["finish"], logprobs=logprobs, **kw)


def _specs(data: st.DataObject, vocab: list[int]) -> list[StatsSpec]:
    return [
        StatsSpec(
            request_id=f"req{i}",
            external_id=data.draw(st.sampled_from([f"ext{i}", "shared"])),
            prompt_ids=data.draw(st.lists(st.sampled_from(vocab), min_size=1, max_size=8)),
            n=data.draw(st.sampled_from([1, 1, 2, 3])),
            kind=data.draw(st.sampled_from([RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY])),
            stop=data.draw(st.sampled_from([None, None, STOPS])),
            logprobs=data.draw(st.sampled_from([None, None, None, 0, 2])),
            watermarking=data.draw(st.sampled_from([None, False, True])),
            watermark_skipped=data.draw(st.booleans()),
        )
        for i in range(data.draw(st.integers(1, 4), label="num_requests"))
    ]


# ------------------------------------------------------------------ the test


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(data=st.data())
def test_same_stats_as_stock(
    tiny_tokenizer: Any, text_tokens: list[int], compute_nans: bool, data: st.DataObject
) -> None:
    assert envs.VLLM_COMPUTE_NANS_IN_LOGITS is compute_nans
    async_mode = data.draw(st.booleans(), label="async_mode")
    stock = Side(StockOP(tiny_tokenizer, log_stats=True), async_mode)
    ours = Side(OurOP(tiny_tokenizer, log_stats=True), async_mode)
    specs = _specs(data, text_tokens)

    wall = 1000.0  # frontend wall clock: arrivals, iteration timestamps
    engine = 5000.0  # engine core monotonic clock: step and event stamps
    live: list[str] = []
    logprobs_of: dict[str, int | None] = {}
    prompt_len: dict[str, int] = {}
    for spec in specs:
        arrival = wall + data.draw(st.floats(0.0, 1.0), label="arrival")
        ids = stock.add(spec, arrival=arrival)
        assert ours.add(spec, arrival=arrival) == ids
        live += ids
        logprobs_of.update(dict.fromkeys(ids, spec.logprobs))
        prompt_len.update(dict.fromkeys(ids, len(spec.prompt_ids)))
    parents = [s.request_id for s in specs if s.n > 1]
    externals = sorted({s.external_id for s in specs})
    walk = TextWalk(text_tokens, prompt_len)

    def compare_live() -> None:
        assert request_stats_form(ours.op) == request_stats_form(stock.op)
        # What each external id still maps to: a mapping an abort forgot to unlink
        # answers the same aborts but grows without bound.
        for ext in externals:
            assert sorted(ours.op._core.external_ids(ext)) == sorted(
                stock.op.external_req_ids.get(ext, [])), ext
        a, b = stock.drain(), ours.drain()
        assert {k: outputs_form([v]) for k, v in b.items()} == {k: outputs_form([v]) for k, v in a.items()}

    compare_live()
    for _ in range(data.draw(st.integers(1, 12), label="num_steps")):
        if data.draw(st.sampled_from(["step"] * 5 + ["abort"])) == "abort":
            internal = data.draw(st.booleans())
            # Never a parent together with one of its children: stock raises on
            # that (it unlinks the child twice), and AsyncLLM never does it.
            pool = data.draw(st.sampled_from([live, parents])) if internal else externals
            ids = data.draw(st.lists(st.sampled_from(pool or ["unknown"]), min_size=1, max_size=3, unique=True))
            a = stock.op.abort_requests(list(ids), internal=internal)
            assert ours.op.abort_requests(list(ids), internal=internal) == a
            live = [x for x in live if x not in a]
            compare_live()
            continue

        wall += data.draw(st.floats(0.001, 2.0), label="wall_step")
        new_engine: float = engine + data.draw(st.floats(0.001, 2.0), label="engine_step")
        if data.draw(st.integers(0, 9)) == 9:
            # vLLM's stamps are floats; an int one must still give stock's values and types.
            new_engine = int(new_engine) + 1
        plan: list[tuple[str, dict[str, Any]]] = []
        for rid in [r for r in live if data.draw(st.sampled_from([True, True, False]))]:
            # np.int64(0): a NaN count of another type than the engine's int.
            nans = st.sampled_from([0] * 6 + [np.int64(0), 1, 7])
            plan.append((rid, walk.step(data, rid, engine, new_engine, 4, nans)))
        if data.draw(st.integers(0, 4)) == 4:  # an output for a request no longer tracked
            plan.append(
                ("gone", {"tokens": [text_tokens[0]], "finish": None, "events": None, "prefill": None, "nans": 1})
            )
        engine = new_engine

        results = []
        for side in (stock, ours):
            its = new_iteration_stats()
            its.iteration_timestamp = wall
            outs, aborts = side.step([_build(r, s, logprobs_of.get(r)) for r, s in plan], ts=engine, stats=its)
            results.append((outputs_form(outs), aborts, iteration_stats_form(its)))
        (outs_a, aborts_a, its_a), (outs_b, aborts_b, its_b) = results
        assert outs_b == outs_a
        assert aborts_b == aborts_a
        assert its_b == its_a
        done = set(aborts_a) | {r for r, s in plan if s["finish"] is not None}
        live = [x for x in live if x not in done]
        compare_live()

    # The rest is aborted by external id (what serving does on disconnect).
    assert ours.op.abort_requests(externals, internal=False) == stock.op.abort_requests(externals, internal=False)
    compare_live()
    assert not ours.op.has_unfinished_requests() and not stock.op.has_unfinished_requests()


@dataclass
class RemotePrefillSpec(ReqSpec):
    """A decode instance's request whose prompt was prefilled remotely (2 tokens cached)."""

    def sampling_params(self) -> SamplingParams:
        sp = super().sampling_params()
        sp.extra_args = {"kv_transfer_params": {"do_remote_prefill": True,
                                                "remote_prefill_cached_tokens": 2}}
        return sp


@pytest.mark.parametrize("remote", [True, False], ids=["remote-prefill", "prefill-stats"])
@pytest.mark.parametrize("kind", [None, "logprobs"], ids=["fast", "stock-owned"])
def test_miss_on_the_first_output_ends_prefill_as_stock(tiny_tokenizer: Any, remote: bool,
                                                        kind: str | None) -> None:
    """A miss error as a request's first output: its cached-token counts (remote, or
    the engine's prefill statistics) are in its finished statistics and its output."""
    toks = tiny_tokenizer.encode("The quick brown fox", add_special_tokens=False)
    spec_cls = RemotePrefillSpec if remote else ReqSpec
    logprobs = 1 if kind else None
    prefill = None
    if not remote:
        prefill = PrefillStats()
        prefill.set(3, 2, 1)
        prefill.finalize(2)
    forms, outs = [], []
    for op in (StockOP(tiny_tokenizer, log_stats=True), OurOP(tiny_tokenizer, log_stats=True)):
        side = Side(op, True)
        side.add(spec_cls("r0", "e0", toks[:3], logprobs=logprobs))
        its = new_iteration_stats()
        side.step([eco("r0", [], finish=FinishReason.ERROR, mm_cache_miss_hashes=["h"],
                       prefill_stats=prefill)], ts=5000.0, stats=its)
        forms.append(iteration_stats_form(its))
        outs.append([dict(norm(o)[1])["num_cached_tokens"] for o in side.drain().values()])
    assert forms[1] == forms[0]
    cached = 2 if prefill is None else prefill.num_cached_tokens
    assert cached > 0
    assert outs[1] == outs[0] == [cached]  # the rest differs on purpose: ours carries the error
