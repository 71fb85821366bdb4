"""The retry itself misses too (VLLM_MMRETRY_FAULTS=p1_miss=every:1,retry_miss=1:
the first data-carrying re-send of each dropped hash fails once more), so the
client gets a retryable error, and the server keeps serving."""

from __future__ import annotations

import pytest
from e2e_helpers import (
    ENGINE_MISS,
    FAULT_DROP,
    RETRY_LINE,
    chat_body,
    client,
    error_events,
    image_url,
    mark,
    servers,
    stream_chat,
    streamed_text,
)

pytestmark = pytest.mark.e2e

RESEND_FAIL = "vllm-mmretry fault: failing the data-carrying re-send"


@pytest.fixture(scope="module")
def server(plugin_retry_miss_server: servers.Server) -> servers.Server:
    return plugin_retry_miss_server


def test_chat_gives_503_with_retry_after_then_recovers(server: servers.Server, model: str) -> None:
    body = chat_body(model, image_url((0, 21, 0)))
    with client(server) as http:
        first = http.post("/v1/chat/completions", json=body)
        assert first.status_code == 200, first.text
        window = mark(server)
        failed = http.post("/v1/chat/completions", json=body)
        assert failed.status_code == 503, failed.text
        assert failed.headers.get("retry-after", "").strip().isdigit(), failed.headers
        assert "error" in failed.json()
        text = window.wait_for(RESEND_FAIL)
        assert FAULT_DROP in text and RETRY_LINE in text
        assert text.count(ENGINE_MISS) == 2  # the request and its one retry
        # P0 invalidated the hash again, so the next request carries the data.
        again = http.post("/v1/chat/completions", json=body)
        assert again.status_code == 200, again.text
    assert (again.json()["choices"][0]["message"]["content"]
            == first.json()["choices"][0]["message"]["content"])


def test_stream_gives_error_event_then_recovers(server: servers.Server, model: str) -> None:
    body = chat_body(model, image_url((0, 22, 0)))
    with client(server) as http:
        status, events = stream_chat(http, body)
        assert status == 200 and not error_events(events)
        first = streamed_text(events)
        window = mark(server)
        status, events = stream_chat(http, body)
        assert status == 200, events
        assert len(error_events(events)) == 1, events
        assert streamed_text(events) == ""  # no partial answer before the error
        window.wait_for(RESEND_FAIL)
        status, events = stream_chat(http, body)
        assert status == 200 and not error_events(events), events
        assert streamed_text(events) == first
