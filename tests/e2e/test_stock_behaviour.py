"""The same induced miss with the plugin switched off (VLLM_MMRETRY=0; the fault
switch still installs): stock vLLM 0.32 answers HTTP 500. Proof that the recovery
tests can fail, and the measured stock behaviour they compare against."""

from __future__ import annotations

import pytest
from e2e_helpers import (
    ENGINE_MISS,
    FAULT_DROP,
    RETRY_LINE,
    chat_body,
    client,
    image_url,
    mark,
    servers,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(stock_miss_server: servers.Server) -> servers.Server:
    return stock_miss_server


def test_log_says_plugin_off_and_fault_switch_on(server: servers.Server) -> None:
    log = server.log()
    assert "vllm-mmretry disabled by VLLM_MMRETRY=0" in log
    assert "TEST FAULT SWITCH ON" in log
    assert "mm processor cache type 'lru'" in log


def test_stock_chat_answers_500_on_the_induced_miss(server: servers.Server, model: str) -> None:
    body = chat_body(model, image_url((0, 0, 31)))
    with client(server) as http:
        assert http.post("/v1/chat/completions", json=body).status_code == 200
        window = mark(server)
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 500, r.text
        text = window.wait_for(ENGINE_MISS)
        assert FAULT_DROP in text and RETRY_LINE not in text
        # vLLM itself invalidated P0's entry: the client's own retry succeeds.
        assert http.post("/v1/chat/completions", json=body).status_code == 200


def test_stock_responses_answers_500_on_the_induced_miss(server: servers.Server, model: str) -> None:
    body = {"model": model, "temperature": 0, "max_output_tokens": 8,
            "input": [{"role": "user", "content": [
                {"type": "input_image", "image_url": image_url((0, 0, 32))},
                {"type": "input_text", "text": "What is in this picture?"}]}]}
    with client(server) as http:
        assert http.post("/v1/responses", json=body).status_code == 200
        window = mark(server)
        assert http.post("/v1/responses", json=body).status_code == 500
        window.wait_for(ENGINE_MISS)
        assert http.get("/health").status_code == 200
