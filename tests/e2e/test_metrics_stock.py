"""vLLM's own statistics on `/metrics` after the same served load, with the plugin
(whose core records decode-step statistics natively) and with it off
(VLLM_MMRETRY=0, stock vLLM): the same `vllm:` metric names and label sets, and
the same counts, counters and histogram observation counts (time to first token,
inter-token latency, end-to-end latency, tokens, finished requests by reason).
Times differ from run to run, so histogram sums and buckets and gauges are
compared by presence only.

The load is sequential and deterministic in what the counts depend on:
`ignore_eos` and a fixed `max_tokens`, so each sequence produces one token per
engine step and every count is the same on both servers."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from e2e_helpers import client, metric_families, servers, sse_events, start_server

pytestmark = pytest.mark.e2e

MAX_TOKENS = 6
PROMPTS = ["The quick brown fox", "Once upon a time there was", "A cab of zzz"]
# Counts that the per-step statistics feed (vLLM 0.32's names).
COUNTED = {
    "vllm:generation_tokens_total", "vllm:prompt_tokens_total", "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_count", "vllm:request_generation_tokens_count",
}
# (name, labels) -> value, for the `vllm:` families, with each family's type.
Samples = dict[tuple[str, frozenset[tuple[str, str]]], tuple[str, float]]


@pytest.fixture(scope="module")
def stock(model: str) -> Iterator[servers.Server]:
    yield from start_server(model, env={"VLLM_MMRETRY": "0"})


@pytest.fixture(scope="module")
def plugin(model: str) -> Iterator[servers.Server]:
    yield from start_server(model, env={})


def scrape(server: servers.Server) -> Samples:
    return {(s.name, frozenset(s.labels.items())): (family.type, s.value)
            for family in metric_families(server) if family.name.startswith("vllm:")
            for s in family.samples}


def served_load(server: servers.Server, model: str) -> int:
    """The same requests, one at a time; returns how many requests were served."""
    common = {"model": model, "temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    with client(server) as http:
        for text in PROMPTS:
            body = {**common, "stream": True, "messages": [{"role": "user", "content": text}]}
            with http.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                assert sse_events(r)
        # n > 1 needs sampling; the counts do not depend on the tokens drawn.
        r = http.post("/v1/completions",
                      json={**common, "prompt": PROMPTS[0], "n": 2, "temperature": 1.0, "seed": 7})
        assert r.status_code == 200, r.text
        r = http.post("/v1/chat/completions",
                      json={**common, "messages": [{"role": "user", "content": PROMPTS[1]}]})
        assert r.status_code == 200, r.text
    return len(PROMPTS) + 2


def finished(samples: Samples) -> float:
    return sum(v for (name, _), (_, v) in samples.items() if name == "vllm:request_success_total")


def settled(server: servers.Server, at_least: float, timeout: float = 30.0) -> Samples:
    """The scrape once the finished requests are recorded (the stat loggers run
    after the outputs that end the HTTP responses): at least `at_least`, and two
    scrapes a second apart the same."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        samples = scrape(server)
        if finished(samples) >= at_least and samples == last:
            return samples
        assert time.monotonic() < deadline, f"finished requests recorded: {finished(samples)}"
        last = samples
        time.sleep(1.0)


# Counts of engine iterations (one per batch of engine outputs the API server
# received): how the engine's steps fell in time, not what the requests did.
PER_ITERATION = ("vllm:iteration_tokens_total_count",)


def comparable(samples: Samples) -> dict[tuple[str, frozenset[tuple[str, str]]], float | None]:
    """Counts by value (counters, histogram `_count`); times and gauges by presence."""
    out: dict[tuple[str, frozenset[tuple[str, str]]], float | None] = {}
    for (name, labels), (kind, value) in samples.items():
        counted = (kind == "counter" and not name.endswith("_created")) or (
            kind == "histogram" and name.endswith("_count") and name not in PER_ITERATION)
        out[(name, labels)] = value if counted else None
    return out


def test_same_vllm_metrics_as_stock(stock: servers.Server, plugin: servers.Server, model: str) -> None:
    theirs, ours = (comparable(settled(side, finished(scrape(side)) + served_load(side, model)))
                    for side in (stock, plugin))
    assert ours.keys() == theirs.keys(), sorted(ours.keys() ^ theirs.keys())
    differ = {k: (ours[k], theirs[k]) for k in ours if ours[k] != theirs[k]}
    assert not differ, differ
    # The load really was recorded, and the counts the statistics feed were compared.
    counted = {name for (name, _), v in theirs.items() if v}
    assert COUNTED <= counted, COUNTED - counted
    itl = sum(v or 0 for (name, _), v in theirs.items() if name == "vllm:inter_token_latency_seconds_count")
    assert itl >= (len(PROMPTS) + 3) * (MAX_TOKENS - 1)
