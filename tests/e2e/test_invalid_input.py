"""Invalid client input keeps vLLM's own answer: the same status and error type as
stock (VLLM_MMRETRY=0) for malformed image data, bad messages and `n` out of range,
never a retry and never a 500 from this package.

Both servers run the same fault switch (`p1_miss=every:1`), so a request that did
reach the engine's cache path would show up as a miss and a retry in our log."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from e2e_helpers import RETRY_LINE, chat_body, client, image_url, mark, servers

pytestmark = pytest.mark.e2e

@pytest.fixture(scope="module")
def ours(plugin_miss_server: servers.Server) -> servers.Server:
    return plugin_miss_server


@pytest.fixture(scope="module")
def stock(stock_miss_server: servers.Server) -> servers.Server:
    return stock_miss_server


def _text_only(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "hello"}], **extra}


def _with_image(model: str, url: str) -> dict[str, Any]:
    return chat_body(model, url)


def _cases(model: str) -> dict[str, Any]:
    not_png = "data:image/png;base64," + base64.b64encode(b"definitely not a png").decode()
    return {
        "image_bad_base64": _with_image(model, "data:image/png;base64,@@@not-base64@@@"),
        "image_not_an_image": _with_image(model, not_png),
        "image_empty_data_url": _with_image(model, "data:image/png;base64,"),
        "image_unknown_scheme": _with_image(model, "ftp://127.0.0.1/x.png"),
        "image_two_per_prompt": {**chat_body(model, image_url((1, 2, 3))), "messages": [
            {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": image_url((1, 2, 3))}},
                {"type": "image_url", "image_url": {"url": image_url((3, 2, 1))}},
                {"type": "text", "text": "two?"}]}]},
        "messages_not_a_list": _text_only(model, messages="hello"),
        "messages_empty": _text_only(model, messages=[]),
        "message_without_role": _text_only(model, messages=[{"content": "hi"}]),
        # (An unknown role is not invalid for vLLM: its chat template renders it, 200.)
        "content_part_unknown_type": _text_only(model, messages=[
            {"role": "user", "content": [{"type": "hologram", "hologram": "x"}]}]),
        "n_zero": _text_only(model, n=0),
        "n_negative": _text_only(model, n=-3),
        "n_huge": _text_only(model, n=10**9, temperature=1.0),
        "n_not_int": _text_only(model, n="two"),
        "max_tokens_negative": _text_only(model, max_tokens=-1),
        "prompt_too_long": _text_only(model, messages=[
            {"role": "user", "content": "hello " * 2000}]),
    }


CASES = list(_cases("m"))


def _answer(server: servers.Server, body: dict[str, Any], stream: bool) -> tuple[int, Any]:
    with client(server) as http:
        r = http.post("/v1/chat/completions", json={**body, "stream": stream})
        try:
            payload = r.json()
        except ValueError:
            payload = r.text
        return r.status_code, payload


def _error_type(payload: Any) -> Any:
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        return payload["error"].get("type")
    if isinstance(payload, dict) and "detail" in payload:
        return "detail"
    return type(payload).__name__


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("case", CASES)
def test_invalid_input_answers_like_stock(ours: servers.Server, stock: servers.Server,
                                          model: str, case: str, stream: bool) -> None:
    body = _cases(model)[case]
    window = mark(ours)
    stock_status, stock_payload = _answer(stock, body, stream)
    our_status, our_payload = _answer(ours, body, stream)
    assert 400 <= stock_status < 500, (case, stock_status, stock_payload)
    assert our_status == stock_status, (case, our_payload, stock_payload)
    assert _error_type(our_payload) == _error_type(stock_payload), (our_payload, stock_payload)
    assert RETRY_LINE not in window.text()


def test_servers_still_serve_after_invalid_input(ours: servers.Server, model: str) -> None:
    with client(ours) as http:
        r = http.post("/v1/chat/completions", json=chat_body(model, image_url((5, 6, 7))))
        assert r.status_code == 200, r.text
        assert http.get("/health").status_code == 200
