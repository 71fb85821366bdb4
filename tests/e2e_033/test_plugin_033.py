"""The plugin's contract over real HTTP on vLLM 0.33 (headless front end + the mock
engine's fault mode): a forgotten item is retried once with its data (200), a second
failure is 503 with Retry-After and x-should-retry (one error event when streaming),
and Responses and /v1/embeddings keep stock 0.33's own handling.

Each test skips while the installed plugin reports vLLM 0.33 unsupported (before the
0.33 adapter exists); they run as soon as `vllm_mmretry.register()` patches 0.33."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from e033_helpers import (
    ARRIVED,
    ENGINE_MISS,
    FAULT_DROP,
    RESEND_FAIL,
    RETRY_LINE,
    chat_body,
    client,
    embeddings_body,
    error_events,
    error_of,
    image_url,
    mark,
    mock_serve,
    requires_plugin_on_this_vllm,
    responses_body,
    serve,
    stream_chat,
    streamed_text,
)

MISS_ENV = {"VLLM_MMRETRY_FAULTS": "p1_miss=every:1"}
RETRY_MISS_ENV = {"VLLM_MMRETRY_FAULTS": "p1_miss=every:1,retry_miss=1"}


@pytest.fixture(scope="module", autouse=True)
def _gate() -> None:
    requires_plugin_on_this_vllm()


@pytest.fixture(scope="module")
def plugin(model: str) -> Iterator[mock_serve.MockServed]:
    yield from serve(model, env=MISS_ENV)


@pytest.fixture(scope="module")
def plugin_retry_fails(model: str) -> Iterator[mock_serve.MockServed]:
    yield from serve(model, env=RETRY_MISS_ENV)


@pytest.fixture(scope="module")
def stock(stock_miss_served: mock_serve.MockServed) -> mock_serve.MockServed:
    return stock_miss_served


def _miss_then(served: mock_serve.MockServed, body: dict, *, stream: bool):
    """Send `body` once with its data, then again (the engine forgets the item)."""
    with client(served) as http:
        assert http.post("/v1/chat/completions", json=body).status_code == 200
        window = mark(served)
        if stream:
            return window, stream_chat(http, body)
        return window, http.post("/v1/chat/completions", json=body)


def test_forgotten_item_is_retried_once_with_its_data(plugin: mock_serve.MockServed,
                                                      model: str) -> None:
    window, r = _miss_then(plugin, chat_body(model, image_url((91, 1, 0))), stream=False)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    engine = window.wait_for(ARRIVED)
    assert engine.count(FAULT_DROP) == 1 and engine.count(ENGINE_MISS) == 1
    assert engine.count(ARRIVED) == 1  # the retry re-sent the data
    assert window.front().count(RETRY_LINE) == 1


def test_streamed_forgotten_item_gives_one_clean_stream(plugin: mock_serve.MockServed,
                                                        model: str) -> None:
    window, (status, events) = _miss_then(
        plugin, chat_body(model, image_url((91, 2, 0))), stream=True)
    assert status == 200 and error_events(events) == [], events
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    roles = [e["choices"][0]["delta"].get("role") for e in events
             if isinstance(e, dict) and e.get("choices")]
    assert roles.count("assistant") == 1, "the stream restarted"
    assert streamed_text(events)
    engine = window.wait_for(ARRIVED)
    assert engine.count(ENGINE_MISS) == 1 and engine.count(ARRIVED) == 1


def test_second_failure_is_503_with_retry_headers(plugin_retry_fails: mock_serve.MockServed,
                                                  model: str) -> None:
    window, r = _miss_then(plugin_retry_fails, chat_body(model, image_url((91, 3, 0))),
                           stream=False)
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"].strip().isdigit()
    assert r.headers["x-should-retry"] == "true"
    error = r.json()["error"]  # vLLM's error body
    assert (error["code"], error["type"]) == (503, "ServiceUnavailableError"), error
    engine = window.wait_for(RESEND_FAIL)
    assert engine.count(ENGINE_MISS) == 2  # the request and its one retry


def test_second_failure_streaming_gives_one_error_event(
        plugin_retry_fails: mock_serve.MockServed, model: str) -> None:
    window, (status, events) = _miss_then(
        plugin_retry_fails, chat_body(model, image_url((91, 4, 0))), stream=True)
    assert status == 200, events
    errors = error_events(events)
    assert len(errors) == 1, events
    # 0.33's chat stream labels every GenerationError "InternalServerError", its own
    # retryable ones too; the code says 503.
    assert (errors[0]["error"]["code"], errors[0]["error"]["type"]) == (
        503, "InternalServerError"), errors
    assert streamed_text(events) == ""
    window.wait_for(RESEND_FAIL)


def _responses_after_miss(served: mock_serve.MockServed, model: str, rgb) -> tuple[int, object]:
    body = responses_body(model, image_url(rgb))
    with client(served) as http:
        assert http.post("/v1/responses", json=body).status_code == 200
        window = mark(served)
        r = http.post("/v1/responses", json=body)
        window.wait_for(ENGINE_MISS)
        assert http.get("/health").status_code == 200
    return r.status_code, error_of(r)


def test_responses_keeps_stock_033_handling(plugin: mock_serve.MockServed,
                                            stock: mock_serve.MockServed,
                                            model: str) -> None:
    ours = _responses_after_miss(plugin, model, (91, 5, 0))
    theirs = _responses_after_miss(stock, model, (91, 5, 0))
    assert ours[0] == theirs[0]
    assert (ours[1] or {}).get("code") == (theirs[1] or {}).get("code")


def test_embeddings_keep_stock_033_path(plugin: mock_serve.MockServed,
                                        stock: mock_serve.MockServed, model: str) -> None:
    # The mock engine reports the generate task only: 0.33 answers /v1/embeddings
    # itself, before any engine request; the plugin must answer exactly the same.
    body = embeddings_body(model, image_url((91, 6, 0)))
    answers = []
    for served in (plugin, stock):
        with client(served) as http:
            r = http.post("/v1/embeddings", json=body)
        answers.append((r.status_code, error_of(r)))
    assert answers[0] == answers[1]
    assert answers[0][0] != 200
