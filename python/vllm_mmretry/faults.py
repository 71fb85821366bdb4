"""Test-only fault switch: induce real P0/P1 multimodal cache drift on demand.

Off unless `VLLM_MMRETRY_FAULTS` is set (comma-separated `key=value` items):

- `p1_miss=every:N`       drop the P1 receiver-cache entry right before every Nth
                          cache-hit lookup reads it, so vLLM's own
                          `MultiModalCacheMissError` path runs
                          (`EngineCoreOutput(finish_reason=ERROR, mm_cache_miss_hashes)`);
- `p1_miss=prob:P:seed:S` the same with probability P per cache-hit lookup, seeded;
- `retry_miss=1`          also fail the first data-carrying re-send of each dropped
                          hash once (the serving retry re-sends with data because P0
                          invalidated the hash), so the "retry failed too" path is
                          reachable end to end.

The receiver that can drift is `LruKeyReplicatedReceiverCache` in the engine core
(`--mm-processor-cache-type lru`, one API server). With `shm` the worker's receiver
only reads shared memory that P0 writes and owns no entries; with more than one API
server vLLM builds no receiver cache at all. In both cases there is nothing to drop:
the switch logs the cache type each process built so tests can say so honestly.

An invalid value raises `FaultConfigError` from `install()` (so from the plugin's
`register()`), which stops `vllm serve` with that message."""

from __future__ import annotations

import os
import random
import threading
from dataclasses import dataclass, field
from typing import Any

from vllm_mmretry import _patching
from vllm_mmretry.vllm_adapter import adapter, vllm_logger, when_vllm_logging_ready

ENV = "VLLM_MMRETRY_FAULTS"

# What a `_get_cache_type` answer means for the p1_miss switch, per process.
_CACHE_TYPE_NOTES: dict[str | None, str] = {
    "lru": "P1 receiver is LruKeyReplicatedReceiverCache in the engine core; "
           "p1_miss drops its entries",
    "shm": "P1 receiver (worker) reads shared memory written by P0 and owns no "
           "entries; p1_miss has nothing to drop",
    "processor_only": "no P1 receiver cache (more than one API server or internal "
                      "DP load balancing); p1_miss has nothing to drop",
    None: "multimodal processor cache disabled; p1_miss has nothing to drop",
}


class FaultConfigError(ValueError):
    """`VLLM_MMRETRY_FAULTS` holds something this switch does not understand."""


@dataclass(frozen=True)
class FaultPlan:
    spec: str
    every: int | None = None  # p1_miss=every:N
    prob: float | None = None  # p1_miss=prob:P:seed:S
    seed: int = 0
    retry_miss: bool = False


def _bad(spec: str, why: str) -> FaultConfigError:
    return FaultConfigError(
        f"invalid {ENV}={spec!r}: {why}. Expected comma-separated items: "
        "p1_miss=every:N (N>=1) | p1_miss=prob:P:seed:S (0<=P<=1, S integer), "
        "optionally retry_miss=1")


def parse(spec: str) -> FaultPlan | None:
    """The plan for `spec`, or None when the switch is off (empty/unset)."""
    spec = spec.strip()
    if not spec:
        return None
    items: dict[str, str] = {}
    for part in spec.split(","):
        key, sep, value = part.strip().partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise _bad(spec, f"item {part.strip()!r} is not key=value")
        if key in items:
            raise _bad(spec, f"{key} given twice")
        items[key] = value
    unknown = set(items) - {"p1_miss", "retry_miss"}
    if unknown:
        raise _bad(spec, f"unknown key(s) {', '.join(sorted(unknown))}")
    if "p1_miss" not in items:
        raise _bad(spec, "retry_miss needs p1_miss (it only re-fails hashes p1_miss dropped)")
    every, prob, seed = None, None, 0
    mode, *args = items["p1_miss"].split(":")
    try:
        if mode == "every" and len(args) == 1:
            every = int(args[0])
            if every < 1:
                raise ValueError
        elif mode == "prob" and len(args) == 3 and args[1] == "seed":
            prob, seed = float(args[0]), int(args[2])
            if not 0.0 <= prob <= 1.0:
                raise ValueError
        else:
            raise ValueError
    except ValueError:
        raise _bad(spec, f"p1_miss={items['p1_miss']!r}") from None
    retry = items.get("retry_miss", "0")
    if retry not in ("0", "1"):
        raise _bad(spec, f"retry_miss={retry!r} (use 0 or 1)")
    return FaultPlan(spec=spec, every=every, prob=prob, seed=seed, retry_miss=retry == "1")


@dataclass
class _State:
    plan: FaultPlan
    rng: random.Random
    hit_lookups: int = 0
    drops: int = 0
    dropped: set[str] = field(default_factory=set)  # hashes awaiting their re-send
    lock: threading.Lock = field(default_factory=threading.Lock)

    def should_drop(self) -> bool:
        self.hit_lookups += 1
        if self.plan.every is not None:
            return self.hit_lookups % self.plan.every == 0
        assert self.plan.prob is not None
        return self.rng.random() < self.plan.prob


_state: _State | None = None
_cache_types_logged: set[str | None] = set()


def _logger() -> Any:
    return vllm_logger("vllm.vllm_mmretry.faults")


def _receiver_get_and_update_item(original: Any, miss_error: type[Exception]) -> Any:
    def get_and_update_item(self: Any, mm_item: Any, mm_hash: str) -> Any:
        st = _state
        if st is not None:
            with st.lock:
                entries = adapter().receiver_entries(self)
                if mm_item is None and mm_hash in entries and st.should_drop():
                    # P0 sent no data trusting its shadow; make P1 forget it.
                    entries.pop(mm_hash, None)
                    st.drops += 1
                    st.dropped.add(mm_hash)
                    _logger().warning(
                        "vllm-mmretry fault: dropped P1 receiver cache entry %s before "
                        "cache-hit lookup #%d (%s)", mm_hash, st.hit_lookups, st.plan.spec)
                elif mm_item is not None and st.plan.retry_miss and mm_hash in st.dropped:
                    st.dropped.discard(mm_hash)
                    _logger().warning(
                        "vllm-mmretry fault: failing the data-carrying re-send of %s once "
                        "(retry_miss=1)", mm_hash)
                    # Not stored: the next request re-sends the data and succeeds.
                    raise miss_error([mm_hash])
        return original(self, mm_item, mm_hash)

    return get_and_update_item


def _logging_cache_type(original: Any) -> Any:
    def get_cache_type(vllm_config: Any) -> Any:
        cache_type = original(vllm_config)
        if cache_type not in _cache_types_logged:
            _cache_types_logged.add(cache_type)
            _logger().warning(
                "vllm-mmretry fault switch: mm processor cache type %r in pid %d: %s",
                cache_type, os.getpid(),
                _CACHE_TYPE_NOTES.get(cache_type, "unknown cache type"))
        return cache_type

    return get_cache_type


def install() -> list[str]:
    """Read `VLLM_MMRETRY_FAULTS`; patch the receiver cache if set. Returns labels."""
    plan = parse(os.environ.get(ENV, ""))
    if plan is None:
        return []
    receiver_cls, miss_error = adapter().lru_receiver_cache()
    factories, lookup_name = adapter().mm_cache_type_lookup()
    labels = [
        _patching.patch_attr(receiver_cls, "get_and_update_item", _receiver_get_and_update_item(
            receiver_cls.get_and_update_item, miss_error)),
        _patching.patch_attr(factories, lookup_name,
                             _logging_cache_type(getattr(factories, lookup_name))),
    ]
    activate(plan)
    when_vllm_logging_ready(lambda: _logger().warning(
        "!!! vllm-mmretry TEST FAULT SWITCH ON (pid %d): %s=%r -- this server drops "
        "multimodal cache entries on purpose; never use it outside tests !!!",
        os.getpid(), ENV, plan.spec))
    return [f"{label} [test fault {plan.spec}]" for label in labels]


def activate(plan: FaultPlan | None) -> None:
    """Set (or clear) the plan the patched receiver follows, with fresh counters.
    `install()` calls it; in-process tests call it around the unpatched class."""
    global _state
    _state = None if plan is None else _State(plan=plan, rng=random.Random(plan.seed))


def faulty_get_and_update_item() -> Any:
    """The receiver's `get_and_update_item` with the switch applied, built around
    vLLM's method without patching the class (for in-process differential tests)."""
    receiver_cls, miss_error = adapter().lru_receiver_cache()
    original = _patching.original(receiver_cls, "get_and_update_item")
    return _receiver_get_and_update_item(original, miss_error)


def stats() -> dict[str, int]:
    """Counters of this process (for in-process tests)."""
    st = _state
    if st is None:
        return {"hit_lookups": 0, "drops": 0}
    return {"hit_lookups": st.hit_lookups, "drops": st.drops}


def _reset_for_tests() -> None:
    activate(None)
    _cache_types_logged.clear()
