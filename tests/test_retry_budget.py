"""The retry budget (budget.py) on an injected clock: share of requests + floor over
a sliding window, refusals counted per endpoint and logged at most once per window,
and the environment settings validated."""

from __future__ import annotations

import pytest

from vllm_mmretry import budget
from vllm_mmretry.budget import BudgetConfig, BudgetConfigError, RetryBudget


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _budget(ratio: float, floor: int, window: float = 10.0
            ) -> tuple[RetryBudget, Clock, list[str]]:
    clock, logs = Clock(), []
    b = RetryBudget(BudgetConfig(ratio=ratio, min_retries=floor, window_s=window),
                    clock=clock, log=logs.append)
    return b, clock, logs


def _withdraw_all(b: RetryBudget, endpoint: str = "/v1/chat/completions") -> int:
    granted = 0
    while b.try_withdraw(endpoint):
        granted += 1
        assert granted < 10_000
    return granted


def test_floor_alone_allows_min_retries_per_window() -> None:
    b, _, _ = _budget(ratio=0.0, floor=3)
    assert _withdraw_all(b) == 3


def test_share_of_requests_adds_to_the_floor() -> None:
    b, _, _ = _budget(ratio=0.2, floor=2)
    for _ in range(50):
        b.deposit("/v1/chat/completions")
    assert b.balance() == pytest.approx(12.0)
    assert _withdraw_all(b) == 12
    # One more request is a fifth of a retry: not enough for a whole one.
    b.deposit("/v1/chat/completions")
    assert not b.try_withdraw("/v1/chat/completions")
    for _ in range(4):
        b.deposit("/v1/chat/completions")
    assert b.try_withdraw("/v1/chat/completions")


def test_ratio_one_lets_every_request_retry_once() -> None:
    b, _, _ = _budget(ratio=1.0, floor=0)
    for _ in range(7):
        b.deposit("/v1/embeddings")
    assert _withdraw_all(b, "/v1/embeddings") == 7


def test_refusals_are_counted_per_endpoint() -> None:
    b, _, _ = _budget(ratio=0.0, floor=1)
    assert b.try_withdraw("/v1/chat/completions")
    assert not b.try_withdraw("/v1/chat/completions")
    assert not b.try_withdraw("/v1/chat/completions")
    assert not b.try_withdraw("/v2/embed")
    b.deposit("/v2/embed")
    snap = b.snapshot()
    assert snap["budget_exhausted"] == {"/v1/chat/completions": 2, "/v2/embed": 1}
    assert snap["retries"] == {"/v1/chat/completions": 1}
    assert snap["requests"] == {"/v2/embed": 1}


def test_budget_recovers_once_the_window_has_passed() -> None:
    b, clock, _ = _budget(ratio=0.5, floor=1, window=10.0)
    for _ in range(4):
        b.deposit("/e")
    assert _withdraw_all(b, "/e") == 3
    clock.t += 5.0  # half a window later: the retries still count
    assert not b.try_withdraw("/e")
    clock.t += 5.0  # a whole window after the retries: they expired, and so did the deposits
    assert b.balance() == pytest.approx(1.0)
    assert _withdraw_all(b, "/e") == 1


def test_window_slides_deposits_out_slice_by_slice() -> None:
    b, clock, _ = _budget(ratio=1.0, floor=0, window=10.0)
    b.deposit("/e")  # t = 1000.0
    clock.t += 5.0
    b.deposit("/e")  # t = 1005.0
    assert b.balance() == pytest.approx(2.0)
    clock.t += 5.0  # 1010.0: the first deposit's slice left the window
    assert b.balance() == pytest.approx(1.0)
    clock.t += 5.0  # 1015.0: both gone
    assert b.balance() == pytest.approx(0.0)
    clock.t += 1000.0  # a long idle gap clears everything at once
    b.deposit("/e")
    assert b.balance() == pytest.approx(1.0)


def test_exhaustion_is_logged_at_most_once_per_window() -> None:
    b, clock, logs = _budget(ratio=0.0, floor=0, window=10.0)
    for _ in range(5):
        assert not b.try_withdraw("/v1/chat/completions")
    assert len(logs) == 1 and "(1 retry refused" in logs[0]
    clock.t += 9.9
    assert not b.try_withdraw("/v1/chat/completions")
    assert len(logs) == 1
    clock.t += 0.2
    assert not b.try_withdraw("/v1/chat/completions")
    assert len(logs) == 2
    # The second report counts the refusals it had to keep quiet about.
    assert "(6 retries refused since the last report" in logs[1]
    assert "/v1/chat/completions=7" in logs[1]


def test_defaults_are_documented_values() -> None:
    c = budget.config_from_env({})
    assert (c.ratio, c.min_retries, c.window_s) == (0.2, 100, 10.0)


def test_env_settings_are_read() -> None:
    c = budget.config_from_env({budget.ENV_RATIO: "0.5", budget.ENV_MIN_RETRIES: " 3 ",
                                budget.ENV_WINDOW: "2.5"})
    assert (c.ratio, c.min_retries, c.window_s) == (0.5, 3, 2.5)


@pytest.mark.parametrize(("name", "value"), [
    (budget.ENV_RATIO, "-0.1"), (budget.ENV_RATIO, "1.5"), (budget.ENV_RATIO, "nan"),
    (budget.ENV_RATIO, "20%"), (budget.ENV_MIN_RETRIES, "2.5"),
    (budget.ENV_MIN_RETRIES, "-1"), (budget.ENV_WINDOW, "0"), (budget.ENV_WINDOW, "inf"),
    (budget.ENV_WINDOW, "ten"),
])
def test_bad_env_value_is_a_clear_error(name: str, value: str) -> None:
    with pytest.raises(BudgetConfigError, match=name):
        budget.config_from_env({name: value})


def test_bad_env_value_stops_the_retry_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_mmretry import retry

    monkeypatch.setenv(budget.ENV_WINDOW, "-5")
    with pytest.raises(BudgetConfigError, match="VLLM_MMRETRY_RETRY_BUDGET_WINDOW_S"):
        retry.install()


@pytest.mark.parametrize(("requests", "granted"), [(1, 0), (4, 0), (5, 1), (9, 1), (10, 2)])
def test_a_retry_is_granted_only_when_a_whole_one_fits(requests: int, granted: int) -> None:
    """The documented rule: retries + 1 <= ratio x requests + min_retries."""
    b, _, _ = _budget(ratio=0.2, floor=0)
    for _ in range(requests):
        b.deposit("/e")
    assert _withdraw_all(b, "/e") == granted


def test_no_floor_is_a_valid_setting() -> None:
    assert budget.config_from_env({budget.ENV_MIN_RETRIES: "0"}).min_retries == 0


@pytest.mark.parametrize("ratio,requests,retries", [
    (0.29, 100, 29), (0.1, 30, 3), (0.3, 10, 3), (0.07, 100, 7), (1e-3, 3000, 3)])
def test_ratio_times_requests_is_exact_not_a_float_product(
        ratio: float, requests: int, retries: int) -> None:
    # 0.29 * 100 is 28.999999999999996 in floats: the written rule grants 29.
    b, _, _ = _budget(ratio=ratio, floor=0)
    for _ in range(requests):
        b.deposit("/e")
    assert _withdraw_all(b, "/e") == retries
