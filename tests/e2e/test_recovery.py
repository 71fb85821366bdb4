"""A P1 cache miss induced on a real server (plugin on, VLLM_MMRETRY_FAULTS=
p1_miss=every:1: every cache-hit lookup in the engine core finds its entry gone).

Each test uses an image of its own colour, so its first request carries the data
(P1 stores it) and its second request is a P0 shadow hit that the switch turns into
vLLM's real MultiModalCacheMissError."""

from __future__ import annotations

import openai
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

MAX_OUT = 8


@pytest.fixture(scope="module")
def server(plugin_miss_server: servers.Server) -> servers.Server:
    return plugin_miss_server


@pytest.fixture(scope="module")
def oai(server: servers.Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.openai_url, api_key="none", max_retries=0)


def _chat_text(oai: openai.OpenAI, body: dict) -> str:
    r = oai.chat.completions.create(**body)
    assert len(r.choices) == 1 and r.choices[0].finish_reason in ("length", "stop")
    return r.choices[0].message.content


def test_chat_miss_is_retried_with_identical_output(
        server: servers.Server, oai: openai.OpenAI, model: str) -> None:
    body = chat_body(model, image_url((11, 0, 0)))
    first = _chat_text(oai, body)  # carries the data; P1 stores it
    window = mark(server)
    second = _chat_text(oai, body)  # shadow hit -> dropped -> engine miss -> retry
    assert second == first and first
    text = window.wait_for(RETRY_LINE)
    assert FAULT_DROP in text and ENGINE_MISS in text


def test_streamed_chat_miss_gives_one_complete_stream(
        server: servers.Server, oai: openai.OpenAI, model: str) -> None:
    body = chat_body(model, image_url((12, 0, 0)))
    first = _chat_text(oai, body)
    window = mark(server)
    with client(server) as http:
        status, events = stream_chat(http, body)
    assert status == 200, events
    assert error_events(events) == []
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [e for e in events if isinstance(e, dict)]
    roles = [c["choices"][0]["delta"].get("role") for c in chunks if c.get("choices")]
    finishes = [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")]
    assert roles.count("assistant") == 1, "the stream restarted: two role chunks"
    assert len([f for f in finishes if f]) == 1
    assert streamed_text(events) == first
    text = window.wait_for(RETRY_LINE)
    assert FAULT_DROP in text and ENGINE_MISS in text


def test_completions_takes_no_multimodal_data_in_this_vllm(
        server: servers.Server, model: str) -> None:
    # vLLM 0.32's CompletionRequest.prompt is text or token ids only (no
    # multi_modal_data, unlike the offline LLM API), so no /v1/completions request
    # can reach the P1 cache: the miss path is unreachable there. Pin that down so a
    # vLLM that adds it makes this test fail and gets a real recovery test.
    window = mark(server)
    with client(server) as http:
        r = http.post("/v1/completions", json={
            "model": model, "max_tokens": 4,
            "prompt": {"prompt": "<image> hi", "multi_modal_data": {"image": image_url((13, 0, 0))}}})
        assert r.status_code == 400, r.text
        assert "body.prompt" in r.text
        ok = http.post("/v1/completions", json={"model": model, "max_tokens": 4,
                                                "temperature": 0, "prompt": "hello"})
        assert ok.status_code == 200, ok.text
    assert ENGINE_MISS not in window.text()


def test_chat_n2_miss_gives_both_choices(
        server: servers.Server, oai: openai.OpenAI, model: str) -> None:
    url = image_url((14, 0, 0))
    _chat_text(oai, chat_body(model, url))  # populate P0 shadow and P1
    window = mark(server)
    # n>1 needs sampling (vLLM refuses n=2 with temperature 0).
    r = oai.chat.completions.create(**chat_body(model, url, n=2, temperature=1.0, seed=7))
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.finish_reason in ("length", "stop") for c in r.choices)
    text = window.wait_for(RETRY_LINE)
    assert FAULT_DROP in text and ENGINE_MISS in text


def test_responses_api_keeps_stock_error_and_server_stays_up(
        server: servers.Server, oai: openai.OpenAI, model: str) -> None:
    # The retry covers chat/completions/pooling; the Responses API keeps vLLM's own
    # answer to a miss (HTTP 500, as test_stock_behaviour measures on stock vLLM).
    body = {"model": model, "temperature": 0, "max_output_tokens": MAX_OUT,
            "input": [{"role": "user", "content": [
                {"type": "input_image", "image_url": image_url((15, 0, 0))},
                {"type": "input_text", "text": "What is in this picture?"}]}]}
    with client(server) as http:
        assert http.post("/v1/responses", json=body).status_code == 200
        window = mark(server)
        r = http.post("/v1/responses", json=body)
        assert r.status_code == 500, r.text
        assert r.json()["error"]["code"] == 500
        window.wait_for(ENGINE_MISS)
        assert http.get("/health").status_code == 200
    # ... and keeps serving: a fresh image goes through.
    assert _chat_text(oai, chat_body(model, image_url((16, 0, 0))))

