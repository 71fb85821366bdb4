"""Native prometheus_client updates for vLLM's stat loggers.

With statistics on (`vllm serve`'s default), vLLM's `PrometheusStatLogger.record`
runs once per engine-output message: a dozen counter increments (most of them of
zero), a few gauge sets and a histogram observation per token. In prometheus_client
each is a chain of four Python calls and a lock; together about 20 µs per message,
a quarter of the plugin's API-server CPU per message (docs/served-speed.md,
"Per engine-output message").

vLLM's `record` still runs unchanged. After an engine is built, each single metric
child its Prometheus stat loggers hold (a `Counter`, `Gauge` or `Histogram` that is
observable and stores a plain `MutexValue`) gets an instance attribute `inc`, `set`
or `observe`: a native callable (`_core.FastCounterInc`, ... in rust/src/prom/py.rs)
that makes prometheus_client's update in one call: the same lock, the same Python
arithmetic on the stored value, the same bucket. Every other form of call (keywords,
an exemplar, a negative increment) goes to the child's own method. A labelled
parent gets a `labels` (`_core.FastLabels`) that returns an existing child for
`str` label values without prometheus_client's checks and lock, and otherwise
runs the parent's own `labels`, giving a child it makes its native update (vLLM
looks one child up by labels per message). In multiprocess mode
(`--api-server-count > 1`, values in per-process files) the stand-ins update
through the values' own `inc`/`set`, which keep prometheus_client's fork check
and file writes; what they save there is the metric's own method around it
(and every increment of zero).

The vllm.envs variables `record` reads on every call (one today,
VLLM_COMPUTE_NANS_IN_LOGITS) are pinned as module attributes when an engine is
built, to the values its engine core fixed at its start; the API server otherwise
evaluates each through `os.getenv` per message, as vLLM's engine core stopped
doing (it caches its environment at start-up).

A self-check runs both on private metrics at first use and compares the samples;
if they differ (another prometheus_client), nothing is replaced (one WARNING).
VLLM_MMRETRY_NATIVE_METRICS=0 turns all of this off."""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from vllm_mmretry import _core, _patching
from vllm_mmretry.switches import switch_on
from vllm_mmretry.vllm_adapter import adapter, vllm_logger

ENV_SWITCH = "VLLM_MMRETRY_NATIVE_METRICS"
# Metrics given a native method (metric -> attribute), held weakly: not in
# _patching's registry, which would keep a dropped stat logger's metrics alive.
_patched: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
# vllm.envs values set as module attributes by pin_stat_env_reads (name -> (module, value)).
_pinned_envs: dict[str, tuple[ModuleType, Any]] = {}
_MISSING = object()
# Held while the self-check's private metrics are made with in-process values.
_swap_lock = threading.Lock()
# How deep the walk goes into a logger's attributes (dicts per label, per engine).
_MAX_DEPTH = 4


def enabled() -> bool:
    return switch_on(ENV_SWITCH)


def fast_method(child: Any, own_methods: bool | None = None) -> tuple[str, Any] | None:
    """The method name and native stand-in for one metric child, or None when
    it does not qualify. `own_methods` forces how the stand-in updates the
    child's values (the self-check's); by default it follows their store."""
    from prometheus_client import Counter, Gauge, Histogram

    kind = type(child)
    if kind not in (Counter, Gauge, Histogram) or not child._is_observable():
        return None
    name = {Counter: "inc", Gauge: "set", Histogram: "observe"}[kind]
    if name in vars(child):
        return None  # already replaced, by us or by someone else
    parts = [child._sum, *child._buckets] if kind is Histogram else [child._value]
    own = updates_through_own_methods(parts) if own_methods is None else own_methods
    if own is None:
        return None
    # Weak: the child holds the stand-in, which must not hold the child.
    original = weakref.WeakMethod(getattr(child, name))
    if kind is Histogram:
        bounds = child._upper_bounds
        if any(type(b) is not float for b in bounds):
            return None
        return name, _core.FastHistogramObserve(child._sum, list(child._buckets), list(bounds), original,
                                                own_methods=own)
    if kind is Gauge:
        # A "mostrecent" gauge passes the time as well; a MutexValue ignores it.
        most_recent = getattr(child, "_is_most_recent", None)
        if own and type(most_recent) is not bool:
            return None  # another prometheus_client: where the time goes is unknown
        clock = time.time if own and most_recent else None
        return name, _core.FastGaugeSet(child._value, original, own_methods=own, clock=clock)
    return name, _core.FastCounterInc(child._value, original, own_methods=own)


def updates_through_own_methods(parts: list[Any]) -> bool | None:
    """How a stand-in updates these values: False for `MutexValue`s (natively, under
    their lock), True for the multiprocess store (`--api-server-count` > 1: through
    its own `inc`/`set`, which check for a fork and write the process's file), None
    (no stand-in) for anything else."""
    from prometheus_client import values

    if all(type(p) is values.MutexValue for p in parts):
        return False
    if multiprocess_values() and all(type(p) is values.ValueClass for p in parts):
        return True
    return None


def multiprocess_values() -> bool:
    """Whether new metrics here store their values in the multiprocess files."""
    from prometheus_client import values

    return getattr(values.ValueClass, "_multiprocess", False) is True


@contextlib.contextmanager
def in_process_values() -> Iterator[None]:
    """Metrics made inside store their values in this process only (`MutexValue`).
    The self-check's private metrics must not reach the multiprocess files: every
    API server's `/metrics` reads all of them, and a value writes its key there
    when it is made. prometheus_client reads `values.ValueClass` when a metric is
    made; the swap lasts one self-check (about a millisecond, on the thread
    building the engine, before the server serves). A metric another thread made
    in that window would keep an in-process value; the lock keeps two self-checks
    from restoring in the wrong order."""
    from prometheus_client import values

    with _swap_lock:
        multi = values.ValueClass
        values.ValueClass = values.MutexValue
        try:
            yield
        finally:
            values.ValueClass = multi


def fast_labels(parent: Any) -> tuple[str, Any] | None:
    """The native `labels` for a labelled parent metric, or None when it does
    not qualify."""
    from prometheus_client import Counter, Gauge, Histogram

    if type(parent) not in (Counter, Gauge, Histogram) or not parent._is_parent():
        return None
    if "labels" in vars(parent) or type(getattr(parent, "_metrics", None)) is not dict:
        return None
    original = weakref.WeakMethod(parent.labels)

    def labels_then_speed_up(*labelvalues: Any, **labelkwargs: Any) -> Any:
        """The parent's own `labels`; a child it returns gets its native update."""
        method = original()
        if method is None:
            raise ReferenceError("the metric these labels belong to no longer exists")
        child = method(*labelvalues, **labelkwargs)
        found = fast_method(child)
        if found is not None:
            try:
                patch_metric(child, *found)
            except _patching.PatchError:
                pass  # another thread made the same child first and patched it
        return child

    return "labels", _core.FastLabels(weakref.ref(parent), labels_then_speed_up)


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
        for metric in metric_children(obj):
            # A metric reached twice no longer qualifies once it is patched.
            found = fast_method(metric) or fast_labels(metric)
            if found is not None:
                labels.append(patch_metric(metric, *found))
    return labels


def patch_metric(metric: Any, name: str, native: Any) -> str:
    """Give `metric` the instance attribute `name`; returns a label for it."""
    label = f"{metric!r}.{name}"
    if name in vars(metric):
        raise _patching.PatchError(f"refusing to patch {label} twice")
    setattr(metric, name, native)
    _patched[metric] = name
    return label


def pin_stat_env_reads() -> dict[str, Any]:
    """Set the vllm.envs variables vLLM's statistics code reads on every message
    as module attributes, holding the values the engine core just built fixed at
    its start. Each read otherwise costs 3-6 µs (`vllm.envs.__getattr__`, then
    `os.getenv` raising and catching a KeyError for an unset variable). Re-read
    at every engine build; `unpin_envs()` removes them."""
    envs, names = adapter().stat_env_reads()
    if envs is None:
        return {}
    unpin_envs()
    for name in names:
        try:
            value = getattr(envs, name)  # vLLM's own read, with no pin in the way
        except Exception:  # noqa: BLE001 - a bad value: left to raise where vLLM reads it
            continue
        setattr(envs, name, value)
        _pinned_envs[name] = (envs, value)
    return {name: value for name, (_, value) in _pinned_envs.items()}


def unpin_envs() -> list[str]:
    """Remove the pinned vllm.envs values: reads go to vllm.envs.__getattr__ again."""
    unpinned = []
    for name, (envs, value) in _pinned_envs.items():
        if vars(envs).get(name, _MISSING) is value:
            delattr(envs, name)
            unpinned.append(f"{envs.__name__}.{name}")
    _pinned_envs.clear()
    return unpinned


def restore() -> list[str]:
    """Give every metric still alive that was patched its own method back, and
    unpin the vllm.envs values."""
    restored = unpin_envs()
    for metric, name in list(_patched.items()):
        if name in vars(metric):
            delattr(metric, name)
            restored.append(f"{metric!r}.{name}")
    _patched.clear()
    return restored


def speed_up_engine(engine: Any) -> int:
    """After an engine is built: native updates for its Prometheus stat loggers'
    metrics. Returns how many children were given one."""
    if not enabled():
        return 0
    loggers = adapter().prometheus_stat_loggers(engine)
    if not loggers:
        return 0
    pin_stat_env_reads()
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
    "gauge_mostrecent": [(3,), (0.5,), ("2.5",), (None,)],
    "histogram": [(0,), (0.001,), (0.0011,), (7,), (1e9,), (math.inf,), (-1.5,), (math.nan,), ("x",)],
}


# `labels` calls (args, kwargs) on a private parent with label names ("k", "j").
_CHECK_LABELS: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
    (("a", "x"), {}), (("a", "x"), {}), ((1, "x"), {}), (("1", "x"), {}), ((), {"j": "y", "k": "b"}),
    (("b", "y"), {}), (("a",), {}), (("a", "x"), {"k": "a"}), ((), {}), ((None, 2.5), {}),
]


def labels_outcome(parent: Any, labels: Callable[..., Any], args: tuple[Any, ...],
                   kwargs: dict[str, Any], count_up: Callable[[Any], object]) -> str:
    """One call of `labels` (the parent's, or a stand-in): its error, or which
    child it returned (by position in the parent), then counted up by `count_up`."""
    try:
        child = labels(*args, **kwargs)
        position = [i for i, c in enumerate(parent._metrics.values()) if c is child]
        count_up(child)
    except Exception as exc:  # noqa: BLE001 - compared, not handled
        return f"{type(exc).__name__}: {exc}"
    return f"child {position}"


def label_outcomes(parent: Any, labels: Callable[..., Any]) -> list[str]:
    """What each of `_CHECK_LABELS` did through `labels`, and the parent's
    samples after it."""
    return [
        f"labels{args!r}{kwargs!r} {labels_outcome(parent, labels, args, kwargs, _inc)} {samples(parent)}"
        for args, kwargs in _CHECK_LABELS
    ]


def _inc(child: Any) -> None:
    child.inc()


def _private_metrics(tag: str) -> dict[str, Any]:
    from prometheus_client import Counter, Gauge, Histogram

    return {
        "counter": Counter(f"mmretry_check_{tag}_c", "check", ["k"], registry=None).labels("a"),
        "gauge": Gauge(f"mmretry_check_{tag}_g", "check", registry=None),
        # Its `set` passes a timestamp: the keyword the multiprocess form passes on.
        "gauge_mostrecent": Gauge(f"mmretry_check_{tag}_gm", "check", registry=None,
                                  multiprocess_mode="mostrecent"),
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
def self_check(own_methods: bool | None = None) -> str | None:
    """None when the native updates give prometheus_client's samples and errors
    on a fixed sequence of calls; else what differed first. The stand-ins are
    checked in the form this process's metrics take (with multiprocess stores,
    updating through the values' own methods) or the one `own_methods` names,
    on private metrics kept out of the multiprocess files."""
    own = multiprocess_values() if own_methods is None else own_methods
    with in_process_values() if multiprocess_values() else contextlib.nullcontext():
        return _differences_on_private_metrics(own)


def _differences_on_private_metrics(own_methods: bool) -> str | None:
    stock = _private_metrics("stock")
    fast = _private_metrics("fast")
    expected_updates, native_updates = {}, {}
    for kind, child in fast.items():
        found = fast_method(child, own_methods)
        if found is None:
            return f"a plain {kind} child does not qualify in this prometheus_client"
        name, native = found
        expected_updates[kind] = (stock[kind], getattr(stock[kind], name))
        native_updates[kind] = (child, native)
    expected = _run_calls(expected_updates)
    got = _run_calls(native_updates)
    expected += label_outcomes(*_labels_twin("stock", native=False))
    got += label_outcomes(*_labels_twin("fast", native=True))
    for want, have in zip(expected, got, strict=True):
        if want != have:
            return f"expected {want}, got {have}"
    return None


def _labels_twin(tag: str, native: bool) -> tuple[Any, Callable[..., Any]]:
    """A private labelled counter and its `labels`: its own, or the native one."""
    from prometheus_client import Counter

    parent = Counter(f"mmretry_check_{tag}_l", "check", ["k", "j"], registry=None)
    if not native:
        return parent, parent.labels
    found = fast_labels(parent)
    if found is None:
        raise RuntimeError("a labelled counter does not qualify in this prometheus_client")
    return parent, found[1]
