"""Native prometheus_client updates (prom.py, rust/src/prom): a metric child given
the native `inc`/`set`/`observe` must end in the same samples and raise the same
errors as prometheus_client's own method, call by call, on hypothesis-generated
calls (odd values and call forms included); and vLLM's real PrometheusStatLogger,
recording the same generated stream of statistics once stock and once with its
metrics sped up, must leave the same `vllm:` samples in the registry."""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY, Counter, Gauge, Histogram, Summary
from prometheus_client.values import MutexValue

from vllm_mmretry import _core, prom

NUMBERS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 0.0, -0.0, 1, True, False, 2**53 + 1, -(2**53) - 1, 0.001, 0.5, 10.0]),
)
ODD = st.sampled_from(["2.5", "x", None, Decimal("1.5"), Fraction(1, 3), b"1", [], 1j])
VALUES = st.one_of(NUMBERS, NUMBERS, NUMBERS, ODD)
EXEMPLAR = st.sampled_from([None, {}, {"trace_id": "abc"}])


@st.composite
def call(draw: st.DrawFn, kind: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """One call's arguments: mostly the plain positional form vLLM uses."""
    form = draw(st.sampled_from(["plain"] * 6 + ["none", "keyword", "exemplar", "extra"]))
    value = draw(VALUES)
    key = {"counter": "amount", "gauge": "value", "histogram": "amount"}[kind]
    if form == "none":
        return (), {}
    if form == "keyword":
        return (), {key: value}
    if form == "exemplar" and kind != "gauge":
        return (value,), {"exemplar": draw(EXEMPLAR)}
    if form == "extra":
        return (value, None, None), {}
    return (value,), {}


def twins(kind: str, tag: str, **kw: Any) -> tuple[Any, Any]:
    """A stock child and one given the native method, each in no registry."""
    cls = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}[kind]
    made = []
    for side in ("stock", "fast"):
        parent = cls(f"t_{tag}_{side}", "doc", ["k"], registry=None, **kw)
        made.append(parent.labels("v"))
    found = prom.fast_method(made[1])
    assert found is not None
    setattr(made[1], *found)
    return made[0], made[1]


def outcome(method: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    try:
        method(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - compared, not handled
        return f"{type(exc).__name__}: {exc}"
    return "ok"


KINDS = {
    "counter": ({}, "inc"),
    "gauge": ({}, "set"),
    "gauge_mostrecent": ({"multiprocess_mode": "mostrecent"}, "set"),
    "histogram": ({"buckets": (0.001, 0.5, 10.0)}, "observe"),
    "histogram_default": ({}, "observe"),
}


def generated_twins(name: str, data: st.DataObject) -> tuple[str, Any, Any, list[Any]]:
    """For `KINDS[name]`: the method, a stock and a native twin, and generated calls."""
    kw, method = KINDS[name]
    kind = name.split("_")[0]
    stock, fast = twins(kind, f"{name}_{data.draw(st.integers(0, 10**9))}", **kw)
    assert type(getattr(fast, method)).__module__ == "vllm_mmretry._core"
    return method, stock, fast, data.draw(st.lists(call(kind), min_size=1, max_size=12))


@pytest.mark.parametrize("name", sorted(KINDS))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_native_update_matches_prometheus_client_call_by_call(name: str, data: st.DataObject) -> None:
    method, stock, fast, calls = generated_twins(name, data)
    for args, kwargs in calls:
        want = outcome(getattr(stock, method), args, kwargs)
        got = outcome(getattr(fast, method), args, kwargs)
        assert got == want, (args, kwargs)
        assert prom.samples(fast) == prom.samples(stock), (args, kwargs)


def test_the_native_update_takes_the_values_lock() -> None:
    """While another thread holds a value's lock, the update waits for it."""
    import threading

    c = Counter("t_lock", "doc", registry=None)
    setattr(c, *prom.fast_method(c))  # type: ignore[misc]
    c._value._lock.acquire()
    t = threading.Thread(target=c.inc, args=(5,))
    t.start()
    t.join(0.2)
    assert t.is_alive() and c._value._value == 0.0
    c._value._lock.release()
    t.join(5)
    assert not t.is_alive() and c._value.get() == 5.0


def test_only_single_observable_children_with_mutex_values_qualify() -> None:
    labelled = Counter("t_q_parent", "doc", ["k"], registry=None)
    assert prom.fast_method(labelled) is None  # a parent: no value of its own
    child = labelled.labels("a")
    found = prom.fast_method(child)
    assert found is not None and found[0] == "inc"
    setattr(child, *found)
    assert prom.fast_method(child) is None  # never twice
    assert prom.fast_method(Summary("t_q_summary", "doc", registry=None)) is None
    other = Gauge("t_q_gauge", "doc", registry=None)
    assert prom.updates_through_own_methods([other._value]) is False
    other._value = object.__new__(type("OtherValue", (), {}))  # e.g. multiprocess
    assert prom.updates_through_own_methods([other._value]) is None
    assert prom.fast_method(other) is None
    h = Histogram("t_q_hist", "doc", registry=None)
    assert all(type(b) is MutexValue for b in h._buckets)
    assert prom.fast_method(h) is not None


def test_self_check_passes_here_and_catches_a_wrong_update(monkeypatch: pytest.MonkeyPatch) -> None:
    assert prom.self_check() is None

    class Wrong:
        """Counts everything twice."""

        def __init__(self, value: Any, original: Any, **kwargs: Any) -> None:
            self.original = original  # a weakref.WeakMethod, as the native one gets

        def __call__(self, *args: Any, **kwargs: Any) -> None:
            self.original()(*args, **kwargs)
            self.original()(*args, **kwargs)

    monkeypatch.setattr(_core, "FastCounterInc", Wrong)
    failure = prom.self_check.__wrapped__()
    # The first call, inc(), already differs: 2.0 counted instead of 1.0.
    assert failure is not None and failure.startswith("expected counter() ok")
    assert "'2.0'" in failure


def test_switch_off_leaves_prometheus_client_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(prom.ENV_SWITCH, "0")
    assert prom.speed_up_engine(object()) == 0


# ------------------------------------------------------ vLLM's own stat logger


SMALL = st.integers(min_value=0, max_value=50)
TIMES = st.floats(min_value=0.0, max_value=30.0)


@st.composite
def step_stats(draw: st.DrawFn) -> tuple[Any, Any]:
    """One engine step's (SchedulerStats, IterationStats), as the output handler passes them."""
    from vllm.v1.engine import FinishReason
    from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats, PrefixCacheStats, SchedulerStats

    sched = None
    if draw(st.booleans()):
        sched = SchedulerStats(
            num_running_reqs=draw(SMALL), num_waiting_reqs=draw(SMALL),
            num_skipped_waiting_reqs=draw(SMALL), kv_cache_usage=draw(st.floats(0, 1)),
            prefix_cache_stats=PrefixCacheStats(requests=draw(SMALL), queries=draw(SMALL), hits=draw(SMALL)),
        )
    its = IterationStats()
    its.num_generation_tokens = draw(SMALL)
    its.num_preempted_reqs = draw(st.integers(0, 2))
    pts = its.prompt_token_stats
    pts.computed, pts.local_cache_hit, pts.cached_tokens = draw(SMALL), draw(SMALL), draw(SMALL)
    pts.total = pts.computed + pts.local_cache_hit
    its.time_to_first_tokens_iter = draw(st.lists(TIMES, max_size=3))
    its.inter_token_latencies_iter = draw(st.lists(TIMES, max_size=6))
    its.n_params_iter = draw(st.lists(st.integers(1, 4), max_size=2))
    its.max_num_generation_tokens_iter = draw(st.lists(SMALL, max_size=2))
    for _ in range(draw(st.integers(0, 2))):
        its.finished_requests.append(FinishedRequestStats(
            finish_reason=draw(st.sampled_from([FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT])),
            e2e_latency=draw(TIMES), num_prompt_tokens=draw(SMALL), num_generation_tokens=draw(SMALL),
            max_tokens_param=draw(st.none() | SMALL), queued_time=draw(TIMES), prefill_time=draw(TIMES),
            inference_time=draw(TIMES), decode_time=draw(TIMES),
            mean_time_per_output_token=draw(TIMES),
        ))
    return sched, its


def registry_samples(prefix: str = "vllm:") -> list[Any]:
    out = []
    for family in REGISTRY.collect():
        if not family.name.startswith(prefix):
            continue
        for s in family.samples:
            if not s.name.endswith("_created"):
                out.append((s.name, sorted(s.labels.items()), repr(s.value)))
    return sorted(out)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(stream=st.lists(step_stats(), min_size=1, max_size=25))
def test_vllms_stat_logger_leaves_stock_samples(vllm_config: Any, stream: list[Any]) -> None:
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    seen = []
    for fast in (False, True):
        # Each logger replaces the previous one's `vllm:` metrics in the registry.
        logger = PrometheusStatLogger(vllm_config, engine_indexes=[0])
        if fast:
            assert len(prom.speed_up([logger])) > 20
        for sched, its in stream:
            logger.record(scheduler_stats=sched, iteration_stats=its, engine_idx=0)
        seen.append(registry_samples())
    assert seen[0] and seen[1] == seen[0]


def engine_with_stat_loggers(vllm_config: Any) -> Any:
    """An object holding a real StatLoggerManager where an engine does."""
    from vllm.v1.metrics.loggers import StatLoggerManager

    return type("Engine", (), {"logger_manager": StatLoggerManager(vllm_config=vllm_config, engine_idxs=[0])})()


def test_a_served_engines_stat_loggers_are_found(vllm_config: Any) -> None:
    """The adapter finds the Prometheus logger in vLLM's StatLoggerManager."""
    from vllm_mmretry.vllm_adapter import adapter

    engine = engine_with_stat_loggers(vllm_config)
    loggers = adapter().prometheus_stat_loggers(engine)
    assert [type(lg).__name__ for lg in loggers] == ["PrometheusStatLogger"]
    assert adapter().prometheus_stat_loggers(object()) == []
    count = prom.speed_up_engine(engine)
    native = [c for c in prom.metric_children(loggers[0])
              if any(type(v).__module__ == "vllm_mmretry._core" for v in vars(c).values())]
    assert count > 20 and len(native) == count


NANS = "VLLM_COMPUTE_NANS_IN_LOGITS"


@pytest.fixture
def envs_uncached(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """vllm.envs as the API server has it: no environment cache (an in-process
    engine core earlier in this process may have turned it on), nothing pinned."""
    import vllm.envs as envs

    prom.unpin_envs()
    if envs._is_envs_cache_enabled():
        monkeypatch.setattr(envs, "__getattr__", envs.__getattr__.__wrapped__)
    monkeypatch.delenv("VLLM_RAISE_ON_LOGIT_NANS", raising=False)  # implies NANS
    yield envs
    prom.unpin_envs()


def corrupted_samples() -> list[Any]:
    return [s for s in registry_samples() if s[0].startswith("vllm:corrupted_requests")]


@pytest.mark.parametrize("value", ["1", "0"])
def test_an_engine_build_pins_the_stat_env_reads(vllm_config: Any, envs_uncached: Any,
                                                 monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """VLLM_COMPUTE_NANS_IN_LOGITS is pinned at each engine build to the value the
    engine core fixed; vLLM's logger counts corrupted requests as stock does; once
    unpinned the variable is read from the environment again."""
    from vllm.v1.metrics.stats import IterationStats

    from vllm_mmretry.vllm_adapter import adapter

    envs = envs_uncached
    monkeypatch.setenv(NANS, value)
    its = IterationStats()
    its.num_corrupted_reqs = 3
    seen = []
    for fast in (False, True):
        engine = engine_with_stat_loggers(vllm_config)
        if fast:
            assert prom.speed_up_engine(engine) > 20
            assert vars(envs)[NANS] is (value == "1")
        assert (NANS in vars(envs)) is fast
        adapter().prometheus_stat_loggers(engine)[0].record(scheduler_stats=None, iteration_stats=its, engine_idx=0)
        seen.append(corrupted_samples())
    assert seen[1] == seen[0]
    assert any(s[2] == "3.0" for s in seen[0]) is (value == "1")
    # A later change is seen at the next engine build, or once unpinned.
    monkeypatch.setenv(NANS, "0" if value == "1" else "1")
    assert envs.VLLM_COMPUTE_NANS_IN_LOGITS is (value == "1")
    prom.speed_up_engine(engine_with_stat_loggers(vllm_config))
    assert vars(envs)[NANS] is (value != "1")
    assert prom.unpin_envs() == [f"vllm.envs.{NANS}"]
    monkeypatch.setenv(NANS, value)
    assert NANS not in vars(envs) and envs.VLLM_COMPUTE_NANS_IN_LOGITS is (value == "1")


def test_nothing_is_pinned_where_vllm_caches_its_environment(vllm_config: Any, envs_uncached: Any,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing is pinned in a process whose environment vLLM caches (an in-process
    engine core: the cache answers), for a value vLLM cannot read, or with native
    metrics switched off."""
    import functools

    envs = envs_uncached
    uncached = envs.__getattr__
    monkeypatch.setattr(envs, "__getattr__", functools.cache(uncached))
    assert prom.speed_up_engine(engine_with_stat_loggers(vllm_config)) > 20 and NANS not in vars(envs)
    monkeypatch.setattr(envs, "__getattr__", uncached)
    # A value vLLM cannot read is left to raise where vLLM reads it.
    engine = engine_with_stat_loggers(vllm_config)  # vLLM reads it while building the loggers too
    monkeypatch.setenv(NANS, "yes")
    assert prom.speed_up_engine(engine) > 20 and NANS not in vars(envs)
    with pytest.raises(ValueError):
        envs.VLLM_COMPUTE_NANS_IN_LOGITS  # noqa: B018 - the read is the test
    monkeypatch.setenv(NANS, "1")
    monkeypatch.setenv(prom.ENV_SWITCH, "0")
    assert prom.speed_up_engine(engine_with_stat_loggers(vllm_config)) == 0 and NANS not in vars(envs)


def test_a_dropped_child_is_freed_with_its_native_update() -> None:
    """The native update holds its child weakly: no cycle keeps a dropped child alive."""
    import gc
    import weakref

    gone = []
    for kind, (kw, _method) in KINDS.items():
        stock, fast = twins(kind.split("_")[0], f"drop_{kind}", **kw)
        ref = weakref.ref(fast)
        del stock, fast
        gc.collect()
        gone.append(ref() is None)
    assert all(gone)


def test_a_native_update_outliving_its_child_raises_on_fallback() -> None:
    c = Counter("t_outlive", "doc", registry=None)
    setattr(c, *prom.fast_method(c))  # type: ignore[misc]
    inc = c.inc
    del c
    inc(2)  # the plain form needs only the value
    with pytest.raises(ReferenceError):
        inc(-1)  # the fallback needs the child's own method


# ------------------------------------------------------------ labels()

LABEL_VALUES = st.one_of(st.sampled_from(["a", "b", "", "é"]), st.integers(0, 2), st.none(),
                         st.floats(allow_nan=False, width=16))


class Name(str):
    """A str subclass: prometheus_client keys its child by str(value)."""


@st.composite
def labels_op(draw: st.DrawFn) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    """One operation on a labelled parent with label names ("k", "j")."""
    op = draw(st.sampled_from(["labels"] * 8 + ["keywords", "subclass", "remove", "clear"]))
    args = tuple(draw(st.lists(LABEL_VALUES, min_size=0, max_size=3)))
    if draw(st.integers(0, 4)) > 0:  # mostly the right count
        args = tuple(draw(LABEL_VALUES) for _ in range(2))
    if op == "keywords":
        names = draw(st.sampled_from([("k", "j"), ("j", "k"), ("k",), ("k", "x")]))
        return op, (), {n: draw(LABEL_VALUES) for n in names}
    if op == "subclass":
        return op, tuple(Name(str(a)) for a in args), {}
    return op, args, {}


def labels_outcome(parent: Any, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """Run one operation; for a child returned, say which (prom's single-call
    helper) and count it up through its update (native on the fast side)."""
    if op in ("remove", "clear"):
        try:
            getattr(parent, op)(*args)
        except Exception as exc:  # noqa: BLE001 - compared, not handled
            return f"{type(exc).__name__}: {exc}"
        return "ok"
    method = {Counter: "inc", Gauge: "inc", Histogram: "observe"}[type(parent)]
    return prom.labels_outcome(parent, parent.labels, args, kwargs, lambda child: getattr(child, method)(1))


@pytest.mark.parametrize("cls", [Counter, Gauge, Histogram])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_native_labels_match_prometheus_client_call_by_call(cls: type, data: st.DataObject) -> None:
    tag = f"t_labels_{cls.__name__}_{data.draw(st.integers(0, 10**9))}"
    stock, fast = (cls(f"{tag}_{side}", "doc", ["k", "j"], registry=None) for side in ("stock", "fast"))
    prom.speed_up([fast])
    assert type(fast.labels) is _core.FastLabels
    for op, args, kwargs in data.draw(st.lists(labels_op(), min_size=1, max_size=15)):
        want = labels_outcome(stock, op, args, kwargs)
        got = labels_outcome(fast, op, args, kwargs)
        assert got == want, (op, args, kwargs)
        assert [prom.samples(c) for c in fast._metrics.values()] == [
            prom.samples(c) for c in stock._metrics.values()], (op, args, kwargs)
    # Every child made through the native labels has its native update.
    method = {Counter: "inc", Gauge: "set", Histogram: "observe"}[cls]
    assert all(type(vars(c).get(method)).__module__ == "vllm_mmretry._core" for c in fast._metrics.values())


def test_self_check_catches_wrong_labels(monkeypatch: pytest.MonkeyPatch) -> None:
    class Wrong:
        """Always the first child ever made: wrong once the label values change."""

        def __init__(self, parent: Any, miss: Any) -> None:
            self.miss, self.first = miss, None

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            self.first = self.first or self.miss(*args, **kwargs)
            return self.first

    monkeypatch.setattr(_core, "FastLabels", Wrong)
    failure = prom.self_check.__wrapped__()
    assert failure is not None and failure.startswith("expected labels(1, 'x'){} child [1]")


def test_a_dropped_parent_is_freed_with_its_native_labels() -> None:
    import gc
    import weakref

    parent = Histogram("t_drop_labels", "doc", ["k"], registry=None)
    prom.speed_up([parent])
    parent.labels("a").observe(1.0)
    labels = parent.labels
    ref = weakref.ref(parent)
    del parent
    gc.collect()
    assert ref() is None
    with pytest.raises(ReferenceError):
        labels("a")  # an existing child needs the parent; the miss path says it is gone


def test_restore_gives_live_metrics_their_own_methods_back() -> None:
    parent = Counter("t_restore", "doc", ["k"], registry=None)
    single = Gauge("t_restore_single", "doc", registry=None)
    parent.labels("a")
    patched = prom.speed_up([[parent, single]])
    parent.labels("b").inc()  # made after: patched on the way out
    assert len(patched) == 3 and type(vars(parent.labels("b"))["inc"]) is _core.FastCounterInc
    restored = [r for r in prom.restore() if "t_restore" in r]  # earlier tests' metrics may live on
    assert len(restored) == 4, restored
    for metric in (parent, single, *parent._metrics.values()):
        assert not {"inc", "set", "observe", "labels"} & set(vars(metric)), metric
    assert prom.restore() == []
