"""Prometheus metrics, published on vLLM's own `/metrics`.

    vllm_mmretry_cache_miss_errors_total            requests ended by a P1 cache miss
    vllm_mmretry_retries_total{endpoint,outcome}    recovered | failed_again | budget_exhausted
    vllm_mmretry_native_fallback_total{reason}      requests run by vLLM's Python code
    vllm_mmretry_self_check_failed{part}            1 per native part the start-up
                                                    self-check turned off
    vllm_mmretry_info{version,vllm_version,native_loop,native_detok}   1

native_loop is 0 when the self-check handed every request to vLLM's code (its
`outputs` or `objects` part failed). The retry counter's series exist from start-up,
at 0, for the endpoints that retry, so that `increase()` sees their first event.

The metrics are ordinary `prometheus_client` metrics in the default registry, which
is what vLLM's `/metrics` serves with one API server. With `--api-server-count > 1`
vLLM sets PROMETHEUS_MULTIPROC_DIR before it spawns the API servers and serves a
`MultiProcessCollector`: our counters then live in the same per-process files as
vLLM's own and are summed over the processes the same way.

Cost in the output loop: none. The Rust core already counts fallbacks per reason;
those counts are read and published as deltas by a callback on the event loop that
runs the output processor (every VLLM_MMRETRY_METRICS_INTERVAL seconds, default 1),
and at scrape time when the scrape runs on that same thread (one API server). The
core is only ever read from the thread that created it, between two steps, so a
read can never collide with `process_outputs`. Misses and retries are rare events
and are counted where they happen.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

INTERVAL_ENV = "VLLM_MMRETRY_METRICS_INTERVAL"
DEFAULT_INTERVAL_S = 1.0
RETRY_OUTCOMES = ("recovered", "failed_again", "budget_exhausted")
# Self-check parts whose failure sends every request to vLLM's own code.
_LOOP_PARTS = frozenset(("outputs", "objects"))
# Detokenizer fallbacks (a fast-loop request detokenized by vLLM's Python code)
# are reported with this prefix on their reason, e.g. "detokenizer:slow_tokenizer".
DETOK_PREFIX = "detokenizer:"

_logger = logging.getLogger("vllm.vllm_mmretry.metrics")


class _Metrics:
    """This process's metric objects, created on first use (after vLLM set up
    PROMETHEUS_MULTIPROC_DIR, which prometheus_client reads when a metric is made)."""

    def __init__(self) -> None:
        from prometheus_client import REGISTRY, Counter, Gauge

        # Registered first so that, at scrape time, the deltas are published
        # before the counters below are collected.
        REGISTRY.register(_FlushOnCollect())
        self.cache_miss_errors = Counter(
            "vllm_mmretry_cache_miss_errors",
            "Requests ended by a multimodal processor cache miss in the engine (P0/P1 drift).",
        )
        self.retries = Counter(
            "vllm_mmretry_retries",
            "Serving-layer retries after a retryable error, by endpoint and outcome.",
            ["endpoint", "outcome"],
        )
        self.self_check_failed = Gauge(
            "vllm_mmretry_self_check_failed",
            "Native parts the start-up self-check turned off (vLLM's own code runs them), "
            "by part (value 1).",
            ["part"],
            multiprocess_mode="max",
        )
        self.native_fallback = Counter(
            "vllm_mmretry_native_fallback",
            "Requests (or parts of them) that run vLLM's Python code instead of the "
            "native loop or the native detokenizer, by reason.",
            ["reason"],
        )
        self.info = Gauge(
            "vllm_mmretry_info",
            "vllm-mmretry in this server: plugin version, vLLM version, whether the "
            "native output loop and the native detokenizer are on (value 1).",
            ["version", "vllm_version", "native_loop", "native_detok"],
            multiprocess_mode="mostrecent",
        )
        self.info_labels: tuple[str, ...] | None = None
        self.routes_at_zero: set[str] = set()

    def retry_series_at_zero(self) -> None:
        """The retrying routes' series, at 0 until their first event."""
        for endpoint in set(retrying_routes()) - self.routes_at_zero:
            for outcome in RETRY_OUTCOMES:
                self.retries.labels(endpoint=endpoint, outcome=outcome)
            self.routes_at_zero.add(endpoint)


def retrying_routes() -> tuple[str, ...]:
    """The routes whose requests retry (retry.py counts each under its path)."""
    from vllm_mmretry import vllm_adapter

    found = vllm_adapter.loaded()
    return found.retrying_routes() if found is not None else ()


class _FlushOnCollect:
    """A collector with no metrics of its own: publishes pending deltas at scrape."""

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> list[Any]:
        flush()
        return []


@dataclass
class _Seen:
    """What has been published so far for one output processor."""

    thread: int
    counts: dict[str, int] = field(default_factory=dict)
    failed_parts: frozenset[str] = frozenset()


_lock = threading.Lock()
_metrics: _Metrics | None = None
_tracked: weakref.WeakKeyDictionary[Any, _Seen] = weakref.WeakKeyDictionary()
_loops_ticking: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()


def _get() -> _Metrics:
    global _metrics
    if _metrics is None:
        with _lock:
            if _metrics is None:
                _metrics = _Metrics()
    return _metrics


MIN_INTERVAL_S, MAX_INTERVAL_S = 0.05, 3600.0


class MetricsConfigError(ValueError):
    """`VLLM_MMRETRY_METRICS_INTERVAL` holds a value the metrics refuse."""


def interval_from_env() -> float:
    """The publishing interval; a bad value raises (register() reads it first, so a
    bad one stops vllm serve with this message, as a bad retry budget does)."""
    raw = os.environ.get(INTERVAL_ENV, "")
    if not raw.strip():  # unset or empty (a templated env file): the default
        return DEFAULT_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not MIN_INTERVAL_S <= value <= MAX_INTERVAL_S:  # also NaN
        raise MetricsConfigError(f"{INTERVAL_ENV}={raw!r}: expected seconds between "
                                 f"{MIN_INTERVAL_S:g} and {MAX_INTERVAL_S:g}")
    return value


def interval_s() -> float:
    try:
        return interval_from_env()
    except MetricsConfigError:  # refused at start-up; changed in the environment since
        return DEFAULT_INTERVAL_S


# ------------------------------------------------------------------ events


def count_cache_miss() -> None:
    """One request (for n > 1: one parent) ended by a P1 multimodal cache miss."""
    _get().cache_miss_errors.inc()


def count_retry(endpoint: str, outcome: str) -> None:
    """A serving-layer retry decision: `recovered` (the retry produced output),
    `failed_again` (answered 503 / error event, or the retry ended in another error,
    which vLLM answers) or `budget_exhausted` (no retry
    because the retry budget was spent)."""
    if outcome not in RETRY_OUTCOMES:
        raise ValueError(f"unknown retry outcome {outcome!r}; expected one of {RETRY_OUTCOMES}")
    _get().retries.labels(endpoint=endpoint, outcome=outcome).inc()


def count_budget_exhausted(endpoint: str) -> None:
    """For the retry budget: a retryable failure answered without a retry."""
    count_retry(endpoint, "budget_exhausted")


# ------------------------------------------------------- output processors


def track(output_processor: Any) -> None:
    """Publish `output_processor.counters()` from now on; set the info metric.

    Called once from OutputProcessor.__init__; the step loop is not touched."""
    seen = _Seen(threading.get_ident())
    _get().retry_series_at_zero()
    with _lock:
        _tracked[output_processor] = seen
    _publish_self_check(_get(), output_processor, _failed_parts(output_processor.counters()), seen)
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return  # offline engine: published at scrape time or by flush()
    if loop not in _loops_ticking:
        _loops_ticking.add(loop)
        loop.call_later(interval_s(), _tick, loop)


def set_info(*, native_loop: bool, native_detok: bool) -> None:
    from vllm_mmretry import __version__
    from vllm_mmretry.vllm_adapter import installed_vllm_version

    metrics = _get()
    labels = (__version__, installed_vllm_version() or "none",
              str(int(native_loop)), str(int(native_detok)))
    with _lock:
        previous, metrics.info_labels = metrics.info_labels, labels
    if previous is not None and previous != labels:
        metrics.info.labels(*previous).set(0)
    metrics.info.labels(*labels).set(1)


def _tick(loop: asyncio.AbstractEventLoop) -> None:
    flush()
    me = threading.get_ident()
    with _lock:
        alive = any(seen.thread == me for seen in _tracked.values())
    if alive and not loop.is_closed():
        loop.call_later(interval_s(), _tick, loop)
    else:
        _loops_ticking.discard(loop)


def flush() -> None:
    """Publish the counter deltas of the output processors created on this thread
    (a core is never read from another thread: it could be mid-step there)."""
    if _metrics is None:
        return
    me = threading.get_ident()
    with _lock:
        mine = [(op, seen) for op, seen in _tracked.items() if seen.thread == me]
    for op, seen in mine:
        try:
            counters = op.counters()
            _publish(_metrics, counters, seen)
            failed = _failed_parts(counters)
            if failed != seen.failed_parts:
                _publish_self_check(_metrics, op, failed, seen)
        except Exception:
            _logger.exception("vllm-mmretry: publishing metrics failed")


def _failed_parts(counters: dict[str, Any]) -> frozenset[str]:
    return frozenset(counters.get("self_check_failed", {}))


def _publish_self_check(metrics: _Metrics, output_processor: Any, failed: frozenset[str],
                        seen: _Seen) -> None:
    """The self-check's verdict: its failed parts and the info metric's native flags
    (again when a part fails later: `objects` is checked on the first request)."""
    seen.failed_parts = failed
    for part in failed:
        metrics.self_check_failed.labels(part=part).set(1)
    detok_reason = getattr(output_processor, "_detok_reason", "unknown")
    set_info(native_loop=not _LOOP_PARTS & failed, native_detok=detok_reason is None)


def _publish(metrics: _Metrics, counters: dict[str, Any], seen: _Seen) -> None:
    totals = dict(counters.get("fallbacks", {}))
    for reason, n in counters.get("python_detok", {}).items():
        totals[DETOK_PREFIX + reason] = n
    for reason, n in totals.items():
        delta = int(n) - seen.counts.get(reason, 0)
        if delta > 0:
            metrics.native_fallback.labels(reason=reason).inc(delta)
            seen.counts[reason] = int(n)
