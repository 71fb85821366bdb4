"""The retry budget on a real server: every cache-hit lookup misses
(VLLM_MMRETRY_FAULTS=p1_miss=every:1) and the budget allows two retries per window
(ratio 0, floor 2). The third miss in the window is answered at once, 503 with
`Retry-After` and `x-should-retry` (an error event when streaming), with no second
engine attempt; once the window has passed, misses are retried again."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from e2e_helpers import (
    ENGINE_MISS,
    RETRY_LINE,
    chat_body,
    client,
    error_events,
    image_url,
    mark,
    servers,
    start_server,
    stream_chat,
    streamed_text,
)

pytestmark = pytest.mark.e2e

WINDOW_S = 15.0
EXHAUSTED_LINE = "vllm-mmretry: retry budget exhausted"


@pytest.fixture(scope="module")
def server(model: str) -> Iterator[servers.Server]:
    yield from start_server(model, env={
        "VLLM_MMRETRY_FAULTS": "p1_miss=every:1",
        "VLLM_MMRETRY_RETRY_BUDGET_RATIO": "0",
        "VLLM_MMRETRY_RETRY_BUDGET_MIN_RETRIES": "2",
        "VLLM_MMRETRY_RETRY_BUDGET_WINDOW_S": str(WINDOW_S),
    })


def test_budget_exhausted_gives_immediate_503_then_recovers(
        server: servers.Server, model: str) -> None:
    bodies = [chat_body(model, image_url((0, 41 + i, 41))) for i in range(5)]
    with client(server) as http:
        firsts = []
        for body in bodies:  # each image's first request carries its data: no miss
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            firsts.append(r.json()["choices"][0]["message"]["content"])

        # Two misses spend the window's two retries.
        window = mark(server)
        for body, first in zip(bodies[:2], firsts[:2], strict=True):
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == first
        granted_by = time.monotonic()  # both retries were granted before this
        assert window.text().count(RETRY_LINE) == 2

        # The third miss: 503 at once, one engine attempt, no retry.
        window = mark(server)
        r = http.post("/v1/chat/completions", json=bodies[2])
        assert r.status_code == 503, r.text
        assert r.headers.get("retry-after", "").strip().isdigit(), r.headers
        assert r.headers.get("x-should-retry") == "true", r.headers
        assert "error" in r.json()
        text = window.wait_for(EXHAUSTED_LINE)
        assert "/v1/chat/completions=1" in text
        assert text.count(ENGINE_MISS) == 1 and RETRY_LINE not in text

        # Streaming: one error event and nothing else of an answer.
        window = mark(server)
        status, events = stream_chat(http, bodies[3])
        assert status == 200, events
        assert len(error_events(events)) == 1, events
        assert streamed_text(events) == ""
        window.wait_for(ENGINE_MISS)
        time.sleep(1.0)  # let the engine's log lines land
        text = window.text()
        assert text.count(ENGINE_MISS) == 1 and RETRY_LINE not in text
        # Logged at most once per window: the second refusal is counted, not logged.
        assert EXHAUSTED_LINE not in text

        # P0 invalidated the refused request's hash, so the client's own retry
        # carries the data and succeeds without any server retry.
        r = http.post("/v1/chat/completions", json=bodies[2])
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == firsts[2]

        # Once the window has passed, a miss is retried again.
        time.sleep(max(0.0, granted_by + WINDOW_S + 1.0 - time.monotonic()))
        window = mark(server)
        r = http.post("/v1/chat/completions", json=bodies[4])
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == firsts[4]
        text = window.wait_for(RETRY_LINE)
        assert EXHAUSTED_LINE not in text
        assert http.get("/health").status_code == 200
