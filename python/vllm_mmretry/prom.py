"""Native prometheus_client updates for vLLM's stat loggers.

With statistics on (`vllm serve`'s default), vLLM's `PrometheusStatLogger.record`
runs once per engine-output message: a dozen counter increments (most of them of
zero), a few gauge sets and a histogram observation per token. In prometheus_client
each is a chain of four Python calls and a lock; together about 20 µs per message,
a quarter of the plugin's API-server CPU per message (README, "Per engine-output
message").

vLLM's `record` still runs unchanged. After an engine is built, each single metric
child its Prometheus stat loggers hold (a `Counter`, `Gauge` or `Histogram` that is
observable and stores a plain `MutexValue`) gets an instance attribute `inc`, `set`
or `observe`: a native callable (`_core.FastCounterInc`, ... in rust/src/prom/py.rs)
that makes prometheus_client's update in one call: the same lock, the same Python
arithmetic on the stored value, the same bucket. Every other form of call (keywords,
an exemplar, a negative increment) goes to the child's own method. Children in
multiprocess mode (`--api-server-count > 1`) and children made later by `labels()`
keep prometheus_client's methods.

A self-check runs both on private metrics at first use and compares the samples;
if they differ (another prometheus_client), nothing is replaced (one WARNING).
VLLM_MMRETRY_NATIVE_METRICS=0 turns this off."""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from vllm_mmretry import _core, _patching
from vllm_mmretry.switches import switch_on
from vllm_mmretry.vllm_adapter import adapter, vllm_logger

ENV_SWITCH = "VLLM_MMRETRY_NATIVE_METRICS"
# How deep the walk goes into a logger's attributes (dicts per label, per engine).
_MAX_DEPTH = 4


def enabled() -> bool:
    return switch_on(ENV_SWITCH)


def fast_method(child: Any) -> tuple[str, Any] | None:
    """The method name and native stand-in for one metric child, or None when
    it does not qualify."""
    from prometheus_client import Counter, Gauge, Histogram
    from prometheus_client.values import MutexValue

    kind = type(child)
    if kind not in (Counter, Gauge, Histogram) or not child._is_observable():
        return None
    name = {Counter: "inc", Gauge: "set", Histogram: "observe"}[kind]
    if name in vars(child):
        return None  # already replaced, by us or by someone else
    # Weak: the child holds the stand-in, which must not hold the child.
    original = weakref.WeakMethod(getattr(child, name))
    if kind is Histogram:
        parts = [child._sum, *child._buckets]
        bounds = child._upper_bounds
        if any(type(p) is not MutexValue for p in parts) or any(type(b) is not float for b in bounds):
            return None
        return name, _core.FastHistogramObserve(child._sum, list(child._buckets), list(bounds), original)
    if type(child._value) is not MutexValue:
        return None
    if kind is Gauge:
        # A "mostrecent" gauge passes a timestamp too, which a MutexValue ignores.
        return name, _core.FastGaugeSet(child._value, original)
    return name, _core.FastCounterInc(child._value, original)


def metric_children(root: Any) -> Iterator[Any]:
    """Every prometheus_client metric reachable from `root` (a stat logger) through
    dicts, lists, tuples and helper objects of the root's own package, with the
    children labelled so far."""
    package = type(root).__module__.split(".")[0] + "."
    yield from _metrics_in(root, package, 0)


def _metrics_in(obj: Any, package: str, depth: int) -> Iterator[Any]:
    from prometheus_client.metrics import MetricWrapperBase

    if isinstance(obj, MetricWrapperBase):
        yield obj
        if obj._is_parent():
            yield from list(obj._metrics.values())
        return
    if depth >= _MAX_DEPTH:
        return
    if isinstance(obj, dict):
        items: Any = obj.values()
    elif isinstance(obj, list | tuple):
        items = obj
    elif type(obj).__module__.startswith(package) and hasattr(obj, "__dict__"):
        items = vars(obj).values()
    else:
        return
    for item in list(items):
        yield from _metrics_in(item, package, depth + 1)


def speed_up(objects: list[Any]) -> list[str]:
    """Give every qualifying metric child reachable from `objects` its native
    update; returns the labels patched."""
    labels = []
    for obj in objects:
        for child in metric_children(obj):
            # A child reached twice no longer qualifies once it has its update.
            found = fast_method(child)
            if found is not None:
                labels.append(_patching.patch_attr(child, *found))
    return labels


def speed_up_engine(engine: Any) -> int:
    """After an engine is built: native updates for its Prometheus stat loggers'
    metrics. Returns how many children were given one."""
    if not enabled():
        return 0
    loggers = adapter().prometheus_stat_loggers(engine)
    if not loggers:
        return 0
    try:
        failure = self_check()
        count = 0 if failure is not None else len(speed_up(loggers))
    except Exception as exc:  # noqa: BLE001 - another prometheus_client: its own methods stay
        failure = f"{type(exc).__name__}: {exc}"
    if failure is not None:
        _warn_once(failure)
        return 0
    vllm_logger("vllm.vllm_mmretry.prom").info(
        "vllm-mmretry: native prometheus updates for %d metrics of vLLM's stat loggers", count)
    return count


@functools.cache
def _warn_once(failure: str) -> None:
    vllm_logger("vllm.vllm_mmretry.prom").warning(
        "vllm-mmretry: prometheus metrics left to prometheus_client (%s)", failure)


# ----------------------------------------------------------------- self-check

# (method, args) applied in order to a private metric of each kind.
_CHECK_CALLS: dict[str, list[tuple[Any, ...]]] = {
    "counter": [(), (0,), (3,), (0.25,), (-1,), (2**60,), (True,)],
    "gauge": [(3,), (0.5,), (True,), ("2.5",), (-7,), (None,)],
    "histogram": [(0,), (0.001,), (0.0011,), (7,), (1e9,), (math.inf,), (-1.5,), (math.nan,), ("x",)],
}


def _private_metrics(tag: str) -> dict[str, Any]:
    from prometheus_client import Counter, Gauge, Histogram

    return {
        "counter": Counter(f"mmretry_check_{tag}_c", "check", ["k"], registry=None).labels("a"),
        "gauge": Gauge(f"mmretry_check_{tag}_g", "check", registry=None),
        "histogram": Histogram(f"mmretry_check_{tag}_h", "check", registry=None,
                               buckets=(0.001, 0.5, 10.0)),
    }


def _run_calls(updates: dict[str, tuple[Any, Callable[..., Any]]]) -> list[str]:
    """What each call did (its exception, if any) and the samples after it; per
    kind, the metric and the update to call."""
    seen = []
    for kind, calls in _CHECK_CALLS.items():
        metric, update = updates[kind]
        for args in calls:
            try:
                update(*args)
                outcome = "ok"
            except Exception as exc:  # noqa: BLE001 - compared, not handled
                outcome = f"{type(exc).__name__}: {exc}"
            seen.append(f"{kind}{args!r} {outcome} {samples(metric)}")
    return seen


def samples(metric: Any) -> list[tuple[str, dict[str, str], str, Any]]:
    """A metric child's samples, values by repr (so NaN and 0 vs 0.0 compare),
    exemplars by labels and value (not their time), without the creation
    timestamps."""
    return [(s.name, s.labels, repr(s.value),
             (s.exemplar.labels, repr(s.exemplar.value)) if s.exemplar else None)
            for s in metric._samples() if not s.name.endswith("_created")]


@functools.cache
def self_check() -> str | None:
    """None when the native updates give prometheus_client's samples and errors
    on a fixed sequence of calls; else what differed first."""
    stock = _private_metrics("stock")
    fast = _private_metrics("fast")
    expected_updates, native_updates = {}, {}
    for kind, child in fast.items():
        found = fast_method(child)
        if found is None:
            return f"a plain {kind} child does not qualify in this prometheus_client"
        name, native = found
        expected_updates[kind] = (stock[kind], getattr(stock[kind], name))
        native_updates[kind] = (child, native)
    expected = _run_calls(expected_updates)
    got = _run_calls(native_updates)
    for want, have in zip(expected, got, strict=True):
        if want != have:
            return f"expected {want}, got {have}"
    return None
