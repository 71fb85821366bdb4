"""The serving retry's budget: how many retries one API server may spend.

A mass cache drift (an engine restart behind a warm front end, an eviction storm)
would otherwise retry every multimodal request once and double the engine's load
at the worst moment. The budget follows Finagle's `RetryBudget` (also tower's
`TpsBudget`): every request the retry covers makes a deposit that counts for
`window` seconds; a retry is allowed while a whole one still fits:

    retries in the window + 1 <= ratio * requests in the window + min_retries

`min_retries` is the floor that lets a quiet server (few requests per window)
still retry. Past the budget the retryable error is answered at once (HTTP 503 with
`Retry-After` and `x-should-retry`, or an error event in a stream), counted per
endpoint in `exhausted`, and logged at most once per window.

The window slides in `SLICES` steps (as Finagle's WindowedAdder): a deposit
expires between `window * (1 - 1/SLICES)` and `window` seconds after it was made.

Settings (each API server process has its own budget):

- `VLLM_MMRETRY_RETRY_BUDGET_RATIO`        share of requests that may retry, 0..1
                                           (default 0.2; 1 = every request may retry)
- `VLLM_MMRETRY_RETRY_BUDGET_MIN_RETRIES`  retries always allowed per window, an
                                           integer >= 0 (default 100: Finagle's
                                           10 per second over its 10 s window)
- `VLLM_MMRETRY_RETRY_BUDGET_WINDOW_S`     window length in seconds, 1..3600
                                           (default 10)

A bad value raises `BudgetConfigError` from `install()` (so from the plugin's
`register()`), which stops `vllm serve` with that message."""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

ENV_RATIO = "VLLM_MMRETRY_RETRY_BUDGET_RATIO"
ENV_MIN_RETRIES = "VLLM_MMRETRY_RETRY_BUDGET_MIN_RETRIES"
ENV_WINDOW = "VLLM_MMRETRY_RETRY_BUDGET_WINDOW_S"

SLICES = 10


class BudgetConfigError(ValueError):
    """A `VLLM_MMRETRY_RETRY_BUDGET_*` variable holds a value the budget refuses."""


@dataclass(frozen=True)
class BudgetConfig:
    ratio: float = 0.2
    # Finagle's default reserve: minRetriesPerSec=10 over its ttl of 10 s.
    min_retries: int = 100
    window_s: float = 10.0


def _number(env: Mapping[str, str], name: str, default: float, kind: type,
            low: float, high: float) -> Any:
    raw = env.get(name, "").strip()
    if not raw:
        return kind(default)
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or not low <= value <= high:
        what = "an integer" if kind is int else "a number"
        raise BudgetConfigError(
            f"invalid {name}={raw!r}: expected {what} from {low:g} to {high:g}")
    return value


def config_from_env(env: Mapping[str, str] | None = None) -> BudgetConfig:
    env = os.environ if env is None else env
    d = BudgetConfig()
    return BudgetConfig(
        ratio=_number(env, ENV_RATIO, d.ratio, float, 0.0, 1.0),
        min_retries=_number(env, ENV_MIN_RETRIES, d.min_retries, int, 0, 10**9),
        window_s=_number(env, ENV_WINDOW, d.window_s, float, 1.0, 3600.0),
    )


class _WindowedCount:
    """Events over the last window, kept in SLICES buckets (O(1) memory)."""

    def __init__(self, window_s: float) -> None:
        self.slice_s = window_s / SLICES
        self.buckets = [0] * SLICES
        self.current = 0  # index of the slice `now` falls in (absolute)

    def _advance(self, now: float) -> None:
        index = int(now // self.slice_s)
        if index - self.current >= SLICES:
            self.buckets = [0] * SLICES
        else:
            for i in range(self.current + 1, index + 1):
                self.buckets[i % SLICES] = 0
        self.current = max(self.current, index)

    def add(self, now: float) -> None:
        self._advance(now)
        self.buckets[self.current % SLICES] += 1

    def total(self, now: float) -> int:
        self._advance(now)
        return sum(self.buckets)


class RetryBudget:
    """Finagle-style retry budget with an injectable clock (seconds, monotonic)."""

    def __init__(self, config: BudgetConfig | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 log: Callable[[str], None] | None = None) -> None:
        self.config = config or BudgetConfig()
        self.clock = clock
        self.log = log
        # The ratio as the decimal it was written as: 0.29 * 100 requests is 29
        # retries, not the float product's 28.999...
        self._ratio = Fraction(repr(self.config.ratio))
        self._requests = _WindowedCount(self.config.window_s)
        self._retries = _WindowedCount(self.config.window_s)
        self._lock = threading.Lock()
        self._last_log: float | None = None
        self._denied_since_log = 0
        # Since start, per endpoint: what the metrics can read.
        self.requests: dict[str, int] = {}
        self.retries: dict[str, int] = {}
        self.exhausted: dict[str, int] = {}

    def deposit(self, endpoint: str) -> None:
        """One request the serving retry covers arrived."""
        with self._lock:
            self._requests.add(self.clock())
            self.requests[endpoint] = self.requests.get(endpoint, 0) + 1

    def balance(self) -> float:
        """Retries still allowed in the current window (may be fractional)."""
        with self._lock:
            return float(self._balance(self.clock()))

    def _balance(self, now: float) -> Fraction:
        allowed = self._ratio * self._requests.total(now) + self.config.min_retries
        return allowed - self._retries.total(now)

    def try_withdraw(self, endpoint: str) -> bool:
        """Take one retry from the budget; False (counted, maybe logged) past it."""
        with self._lock:
            now = self.clock()
            if self._balance(now) >= 1:
                self._retries.add(now)
                self.retries[endpoint] = self.retries.get(endpoint, 0) + 1
                return True
            self.exhausted[endpoint] = self.exhausted.get(endpoint, 0) + 1
            self._denied_since_log += 1
            message = self._log_message(now)
        if message is not None and self.log is not None:
            self.log(message)
        return False

    def _log_message(self, now: float) -> str | None:
        c = self.config
        if self._last_log is not None and now - self._last_log < c.window_s:
            return None
        denied, self._denied_since_log, self._last_log = self._denied_since_log, 0, now
        return (f"vllm-mmretry: retry budget exhausted ({denied} retr"
                f"{'y' if denied == 1 else 'ies'} refused since the last report; budget: "
                f"{c.ratio:g} of requests + {c.min_retries} per {c.window_s:g} s); answering "
                "503 at once. Totals per endpoint: " + ", ".join(
                    f"{e}={n}" for e, n in sorted(self.exhausted.items())))

    def snapshot(self) -> dict[str, dict[str, int]]:
        """Counters since start, per endpoint."""
        with self._lock:
            return {"requests": dict(self.requests), "retries": dict(self.retries),
                    "budget_exhausted": dict(self.exhausted)}


_budget: RetryBudget | None = None


def install(log: Callable[[str], None] | None = None) -> RetryBudget:
    """The process's budget from the environment (raises BudgetConfigError)."""
    global _budget
    _budget = RetryBudget(config_from_env(), log=log)
    return _budget


def current() -> RetryBudget:
    """The process's budget (defaults if `install()` has not run)."""
    global _budget
    if _budget is None:
        _budget = RetryBudget()
    return _budget


def budget_exhausted() -> dict[str, int]:
    """Retries refused by the budget since start, per endpoint."""
    return dict(current().exhausted)
