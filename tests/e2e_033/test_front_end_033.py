"""The vLLM 0.33 front end on this machine: headless, through our launcher, with the
plugin loaded by vLLM's entry point and vLLM's mock engine behind it; and what stock
0.33 does with a multimodal item the engine forgot."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from e033_helpers import (
    ARRIVED,
    ENGINE_MISS,
    FAULT_BANNER,
    FAULT_DROP,
    chat_body,
    client,
    error_of,
    image_url,
    mark,
    mock_serve,
    serve,
    stream_chat,
)


@pytest.fixture(scope="module")
def plain(model: str) -> Iterator[mock_serve.MockServed]:
    yield from serve(model, env={})


@pytest.fixture(scope="module")
def stock(stock_miss_served: mock_serve.MockServed) -> mock_serve.MockServed:
    return stock_miss_served


def test_chat_over_http_with_the_plugin_loaded(plain: mock_serve.MockServed,
                                               model: str) -> None:
    with client(plain) as http:
        r = http.post("/v1/chat/completions", json={
            "model": model, "max_tokens": 5,
            "messages": [{"role": "user", "content": "Say something."}]})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length" and isinstance(
            choice["message"]["content"], str)
        assert r.json()["usage"]["completion_tokens"] == 5
    # vLLM called the entry point in the API server (the launcher process itself).
    log = plain.front_log()
    plugin_lines = [line for line in log.splitlines()
                    if "vllm-mmretry" in line and f"pid={plain.front.pid}" in line]
    assert plugin_lines, log[-3000:]
    assert "Failed to infer device type" not in log
    # Upstream behaviour without the switch: no fault mode in the mock engine.
    assert FAULT_BANNER not in plain.engine_log()


def test_stock_033_answers_500_when_the_engine_forgot_an_item(
        stock: mock_serve.MockServed, model: str) -> None:
    assert FAULT_BANNER in stock.engine_log()
    body = chat_body(model, image_url((90, 1, 0)))
    with client(stock) as http:
        window = mark(stock)
        first = http.post("/v1/chat/completions", json=body)
        assert first.status_code == 200, first.text
        assert window.engine().count(ARRIVED) == 1  # P0 sent the data; P1 keeps it
        window = mark(stock)
        # P0's shadow hit: the item goes by hash only; the engine forgot it.
        failed = http.post("/v1/chat/completions", json=body)
        assert failed.status_code == 500, failed.text
        assert error_of(failed)["code"] == 500
        assert "retry-after" not in failed.headers
        text = window.wait_for(ENGINE_MISS)
        assert FAULT_DROP in text and ARRIVED not in text
        # Stock 0.33 invalidated the hash in P0: the next request carries the data.
        window = mark(stock)
        again = http.post("/v1/chat/completions", json=body)
        assert again.status_code == 200, again.text
        assert window.engine().count(ARRIVED) == 1


def test_stock_033_streaming_chat_on_a_forgotten_item(
        stock: mock_serve.MockServed, model: str) -> None:
    body = chat_body(model, image_url((90, 2, 0)))
    with client(stock) as http:
        assert http.post("/v1/chat/completions", json=body).status_code == 200
        window = mark(stock)
        status, events = stream_chat(http, body)
    window.wait_for(ENGINE_MISS)
    # Stock 0.33: the stream has started (200) and ends with vLLM's error event.
    assert status == 200, events
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and errors[0]["error"]["code"] == 500, events
