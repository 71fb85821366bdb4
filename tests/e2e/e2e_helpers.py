"""Helpers for the end-to-end tests: real `vllm serve` processes (through our
launcher, so the plugin loads in every process) over real HTTP.

A configuration several modules use is started once per session (conftest.py), the
others once per module; a start costs about a minute on the 2-core machine."""

from __future__ import annotations

import base64
import io
import json
import os
import pathlib
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

TOOLS = pathlib.Path(__file__).resolve().parents[2] / "tools"
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))

import servers  # noqa: E402
import tiny_model  # noqa: E402, F401 - re-exported for the conftest fixtures

# Markers the tests look for in the server log.
ENGINE_MISS = "Multi-modal cache miss for request"  # vllm/v1/engine/core.py
FAULT_DROP = "vllm-mmretry fault: dropped P1 receiver cache entry"  # our switch
RETRY_LINE = "vllm-mmretry: retrying"  # python/vllm_mmretry/retry.py

MAX_TOKENS = 8


# Start-up takes ~50 s alone, minutes on a busy 2-core machine.
START_TIMEOUT_S = 900.0


def start_server(model: str, *args: str, env: dict[str, str]) -> Iterator[servers.Server]:
    """Generator body for a server fixture: yields a running server, always stops it."""
    with servers.serve(model, *args, env=env, timeout=START_TIMEOUT_S) as server:
        yield server


def require_executables(*paths: pathlib.Path) -> None:
    """Skip the test when one of `make mock-engine`'s binaries is missing; fail instead
    under VLLM_MMRETRY_REQUIRE_MOCK_ENGINE=1 (make test-py), where they must be there."""
    missing = [str(p) for p in paths if not os.access(p, os.X_OK)]
    if not missing:
        return
    why = f"missing {missing}: run `make {servers.mock_make_target()}`"
    if os.environ.get("VLLM_MMRETRY_REQUIRE_MOCK_ENGINE") == "1":
        pytest.fail(why)
    pytest.skip(why)


def image_url(rgb: tuple[int, int, int]) -> str:
    """A 32x32 solid PNG as a data URL. Tests use a colour of their own so the first
    request for it always carries data (no earlier test cached it)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), rgb).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat_body(model: str, url: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": model, "temperature": 0, "max_tokens": MAX_TOKENS,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "What is in this picture?"}]}],
        **extra,
    }


class LogWindow:
    """The part of a server log written after `mark()`; waits briefly for lines
    (the engine core writes to the same file from another process)."""

    def __init__(self, server: servers.Server) -> None:
        self.server = server
        self.start = len(server.log())

    def text(self) -> str:
        return self.server.log()[self.start:]

    def count(self, needle: str) -> int:
        return self.text().count(needle)

    def wait_for(self, needle: str, timeout: float = 5.0) -> str:
        deadline = time.monotonic() + timeout
        while needle not in (text := self.text()):
            if time.monotonic() > deadline:
                raise AssertionError(f"{needle!r} not in the server log since mark; got:\n"
                                     + text[-3000:])
            time.sleep(0.1)
        return text


def mark(server: servers.Server) -> LogWindow:
    return LogWindow(server)


def client(server: servers.Server) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, timeout=120)


def metric_families(server: servers.Server) -> list[Any]:
    """The server's `/metrics`, parsed by prometheus_client. A fresh connection per
    scrape: with several API servers, any may answer."""
    from prometheus_client.parser import text_string_to_metric_families

    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        r = http.get("/metrics")
    assert r.status_code == 200, r.text
    return list(text_string_to_metric_families(r.text))


def sse_events(response: httpx.Response) -> list[Any]:
    """The `data:` payloads of a server-sent-event stream, JSON-decoded ([DONE] kept
    as the string)."""
    events: list[Any] = []
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[len("data:"):].strip()
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def stream_chat(http: httpx.Client, body: dict[str, Any]) -> tuple[int, list[Any]]:
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, [r.json()]
        return r.status_code, sse_events(r)


def streamed_text(events: list[Any]) -> str:
    return "".join(
        (choice.get("delta") or {}).get("content") or ""
        for event in events if isinstance(event, dict)
        for choice in event.get("choices", []))


def error_events(events: list[Any]) -> list[Any]:
    return [e for e in events if isinstance(e, dict) and "error" in e]
