"""How every VLLM_MMRETRY* on/off switch is read, in one place.

"0", "false", "off" and "no" (any case, surrounding spaces ignored) mean off; anything
else, including an empty value, means on. A padded " 0" is off because an operator
who wrote it meant off."""

from __future__ import annotations

import os

_OFF = frozenset(("0", "false", "off", "no"))


def is_off(value: str) -> bool:
    return value.strip().lower() in _OFF


def switch_on(name: str, default: bool = True) -> bool:
    """Whether the switch `name` is on; `default` when it is not set."""
    value = os.environ.get(name)
    return default if value is None else not is_off(value)


# Test-only switches: each makes the plugin misbehave on purpose (doctor warns).
FORCE_SELF_CHECK_FAIL_ENV = "VLLM_MMRETRY_FORCE_SELF_CHECK_FAIL"  # parts to turn off
TEST_PANIC_ENV = "VLLM_MMRETRY_TEST_PANIC_ON_REQUEST"  # read by the core (core/mod.rs)
TEST_ONLY_ENVS = (FORCE_SELF_CHECK_FAIL_ENV, TEST_PANIC_ENV)

# Every variable the package reads, declared to vLLM at start-up so that its check of
# VLLM_* variables (`--fail-on-environ-validation`, else a WARNING per variable) knows
# them; a misspelt one is still vLLM's "unknown". tests/test_switches.py checks the list
# against the names the sources read.
PACKAGE_ENVS = (
    "VLLM_MMRETRY",
    "VLLM_MMRETRY_CATCHUP_RECORDS",
    "VLLM_MMRETRY_FAULTS",
    "VLLM_MMRETRY_MERGE_WAITING",
    "VLLM_MMRETRY_METRICS_INTERVAL",
    "VLLM_MMRETRY_NATIVE_DECODE",
    "VLLM_MMRETRY_NATIVE_DETOK",
    "VLLM_MMRETRY_NATIVE_METRICS",
    "VLLM_MMRETRY_NATIVE_RECEIVE",
    "VLLM_MMRETRY_READY_FIRST_RECEIVE",
    "VLLM_MMRETRY_RETRY_BUDGET_MIN_RETRIES",
    "VLLM_MMRETRY_RETRY_BUDGET_RATIO",
    "VLLM_MMRETRY_RETRY_BUDGET_WINDOW_S",
    *TEST_ONLY_ENVS,
)
