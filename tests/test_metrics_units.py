"""metrics.py in-process, on real output processors and prometheus_client's default
registry (what vLLM's `/metrics` serves with one API server): deltas of the Rust
core's fallback counters are published by the event-loop tick and at scrape time,
never twice, only from the thread that owns the processor; miss and retry events
count directly. The real-server tests are tests/e2e/test_metrics.py."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from output_processor_support import ReqSpec, Side, eco
from prometheus_client import REGISTRY, generate_latest

from vllm_mmretry import metrics
from vllm_mmretry.output_processor import OutputProcessor


def sample(name: str, **labels: str) -> float:
    value = REGISTRY.get_sample_value(name, labels)
    return 0.0 if value is None else value


def fallbacks(reason: str) -> float:
    return sample("vllm_mmretry_native_fallback_total", reason=reason)


def published(reason: str) -> float:
    """The counter's value without a scrape (a scrape would flush this thread)."""
    value: float = metrics._get().native_fallback.labels(reason=reason)._value.get()
    return value


def add_logprobs_request(op: OutputProcessor, rid: str) -> None:
    Side(op, True).add(ReqSpec(rid, rid, [1], logprobs=1))


def test_tick_on_the_event_loop_publishes_deltas_once(tiny_tokenizer: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(metrics.INTERVAL_ENV, "0.05")

    async def run() -> float:
        op = OutputProcessor(tiny_tokenizer, log_stats=False)  # tracked on this loop
        before = fallbacks("logprobs")
        add_logprobs_request(op, "a")
        add_logprobs_request(op, "b")
        await asyncio.sleep(0.3)  # several ticks
        after = fallbacks("logprobs")
        op.process_outputs([eco("a", [272], logprobs=1)])
        await asyncio.sleep(0.2)
        assert fallbacks("logprobs") == after  # steps are not new fallbacks
        return after - before

    assert asyncio.run(run()) == 2


def test_scrape_publishes_pending_deltas_of_this_thread(tiny_tokenizer: Any) -> None:
    op = OutputProcessor(tiny_tokenizer, log_stats=False)  # no event loop: no tick
    before = fallbacks("logprobs")
    add_logprobs_request(op, "c")
    text = generate_latest(REGISTRY).decode()  # the collector flushes first
    assert "vllm_mmretry_native_fallback_total" in text
    assert fallbacks("logprobs") == before + 1
    generate_latest(REGISTRY)
    assert fallbacks("logprobs") == before + 1


def test_a_core_is_never_read_from_another_thread(tiny_tokenizer: Any) -> None:
    op = OutputProcessor(tiny_tokenizer, log_stats=False)
    metrics.flush()
    before = published("logprobs")
    add_logprobs_request(op, "d")
    t = threading.Thread(target=metrics.flush)
    t.start()
    t.join()
    assert published("logprobs") == before  # only this thread may read `op`
    metrics.flush()
    assert published("logprobs") == before + 1


def test_detokenizer_fallbacks_carry_their_prefix(tiny_tokenizer: Any) -> None:
    op = OutputProcessor(tiny_tokenizer, log_stats=False, native_detok=False)
    before = fallbacks("detokenizer:disabled")
    Side(op, True).add(ReqSpec("e", "e", [1]))
    metrics.flush()
    assert fallbacks("detokenizer:disabled") == before + 1


def test_events_and_info() -> None:
    misses = sample("vllm_mmretry_cache_miss_errors_total")
    metrics.count_cache_miss()
    assert sample("vllm_mmretry_cache_miss_errors_total") == misses + 1
    for outcome in metrics.RETRY_OUTCOMES:
        n = sample("vllm_mmretry_retries_total", endpoint="/x", outcome=outcome)
        metrics.count_retry("/x", outcome)
        assert sample("vllm_mmretry_retries_total", endpoint="/x", outcome=outcome) == n + 1
    n = sample("vllm_mmretry_retries_total", endpoint="/x", outcome="budget_exhausted")
    metrics.count_budget_exhausted("/x")
    assert sample("vllm_mmretry_retries_total", endpoint="/x",
                  outcome="budget_exhausted") == n + 1
    with pytest.raises(ValueError, match="unknown retry outcome"):
        metrics.count_retry("/x", "maybe")
    metrics.set_info(native_loop=True, native_detok=False)
    metrics.set_info(native_loop=True, native_detok=True)
    from vllm_mmretry import __version__
    from vllm_mmretry.vllm_adapter import installed_vllm_version

    on = {"version": __version__, "vllm_version": installed_vllm_version(), "native_loop": "1"}
    assert sample("vllm_mmretry_info", **on, native_detok="1") == 1
    assert sample("vllm_mmretry_info", **on, native_detok="0") == 0  # superseded


def test_retry_series_exist_at_zero_for_the_retrying_endpoints(tiny_tokenizer: Any) -> None:
    OutputProcessor(tiny_tokenizer, log_stats=False)  # as the engine makes it at start-up
    assert {"/v1/chat/completions", "/cohere/v2/chat", "/v2/embed"} <= set(
        metrics.retrying_routes())
    for endpoint in metrics.retrying_routes():
        for outcome in metrics.RETRY_OUTCOMES:
            assert REGISTRY.get_sample_value("vllm_mmretry_retries_total", {
                "endpoint": endpoint, "outcome": outcome}) is not None, (endpoint, outcome)


def _native_loop_label() -> str:
    labels = metrics._get().info_labels
    assert labels is not None
    return labels[2]


@pytest.mark.parametrize("part", ["outputs", "objects"])
def test_a_self_check_that_hands_every_request_to_vllm_shows_on_metrics(
        tiny_tokenizer: Any, monkeypatch: pytest.MonkeyPatch, part: str) -> None:
    """`outputs` fails at construction, `objects` on the first request; either way the
    info metric says native_loop 0 and the failed part is exported."""
    from vllm_mmretry.output_processor import FORCE_SELF_CHECK_FAIL_ENV

    OutputProcessor(tiny_tokenizer, log_stats=False)
    assert _native_loop_label() == "1"
    monkeypatch.setenv(FORCE_SELF_CHECK_FAIL_ENV, part)
    op = OutputProcessor(tiny_tokenizer, log_stats=False)
    Side(op, True).add(ReqSpec(f"r-{part}", f"r-{part}", [1]))  # a request for the native loop
    generate_latest(REGISTRY)  # a scrape: publishes this thread's processors
    assert _native_loop_label() == "0"
    assert sample("vllm_mmretry_self_check_failed", part=part) == 1
    info = {k: v for k, v in zip(("version", "vllm_version", "native_loop", "native_detok"),
                                 metrics._get().info_labels or (), strict=True)}
    assert sample("vllm_mmretry_info", **info) == 1


@pytest.mark.parametrize("raw", ["1,5", "inf", "nan", "0.01", "3601", "-1"])
def test_a_bad_publishing_interval_is_refused(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(metrics.INTERVAL_ENV, raw)
    with pytest.raises(metrics.MetricsConfigError, match=metrics.INTERVAL_ENV):
        metrics.interval_from_env()
    assert metrics.interval_s() == metrics.DEFAULT_INTERVAL_S


@pytest.mark.parametrize(("raw", "seconds"), [("0.05", 0.05), (" 2 ", 2.0), ("3600", 3600.0),
                                              ("", 1.0), ("  ", 1.0)])
def test_a_publishing_interval_in_range_is_taken(monkeypatch: pytest.MonkeyPatch, raw: str,
                                                 seconds: float) -> None:
    monkeypatch.setenv(metrics.INTERVAL_ENV, raw)
    assert metrics.interval_from_env() == seconds


def test_info_says_which_detokenizer_runs(tiny_tokenizer: Any) -> None:
    from vllm_mmretry import __version__
    from vllm_mmretry.vllm_adapter import installed_vllm_version

    on = {"version": __version__, "vllm_version": installed_vllm_version(), "native_loop": "1"}
    OutputProcessor(tiny_tokenizer, log_stats=False)
    assert sample("vllm_mmretry_info", **on, native_detok="1") == 1
    OutputProcessor(tiny_tokenizer, log_stats=False, native_detok=False)
    assert sample("vllm_mmretry_info", **on, native_detok="0") == 1
    assert sample("vllm_mmretry_info", **on, native_detok="1") == 0
