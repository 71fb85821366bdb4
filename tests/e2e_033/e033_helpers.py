"""Helpers for the vLLM 0.33 and 0.34 HTTP tests (headless front end + vLLM's mock
engine of the same release)."""

from __future__ import annotations

import json
import pathlib
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx

TOOLS = pathlib.Path(__file__).resolve().parents[2] / "tools"
E2E = pathlib.Path(__file__).resolve().parents[1] / "e2e"
for path in (TOOLS, E2E):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import mock_serve  # noqa: E402
import tiny_model  # noqa: E402, F401 - re-exported for the conftest fixtures
from e2e_helpers import (  # noqa: E402,F401  (shared with the 0.32 e2e tests)
    MAX_TOKENS,
    chat_body,
    error_events,
    image_url,
    sse_events,
    stream_chat,
    streamed_text,
)

# Log lines: the mock engine's fault mode writes the engine core's and our switch's
# lines (tools/mock_engine/patches/0001-mm-cache-fault-mode.patch).
ENGINE_MISS = "Multi-modal cache miss for request"
FAULT_DROP = "vllm-mmretry fault: dropped P1 receiver cache entry"
RESEND_FAIL = "vllm-mmretry fault: failing the data-carrying re-send"
ARRIVED = "vllm-mmretry mock engine: item arrived with data"
FAULT_BANNER = "vllm-mmretry TEST FAULT SWITCH ON (mock engine"
RETRY_LINE = "vllm-mmretry: retrying"  # python/vllm_mmretry/retry.py


installed_vllm_version = mock_serve.servers.installed_vllm_release

# The releases whose front end runs headless here (their engine cannot run a model on
# this machine), each with the mock engine built from its own sdist.
TARGETS = ("0.33.0", "0.34.0")


def requires_plugin_on_this_vllm() -> None:
    """The plugin supports vLLM 0.33 and 0.34 (`vllm_adapter.v0_33`, `v0_34`): these tests fail, not
    skip, if the installed plugin leaves it unpatched."""
    assert mock_serve.servers.plugin_patches_installed_vllm(), (
        f"the installed vllm_mmretry patches nothing on vLLM {installed_vllm_version()}")


def serve(model: str, env: dict[str, str]) -> Iterator[mock_serve.MockServed]:
    """Generator body for a server fixture: yields a running front end + mock engine."""
    with mock_serve.serve_with_mock_engine(model, env=env) as served:
        yield served


class LogWindow:
    """What the front end and the mock engine logged after `mark()`."""

    def __init__(self, served: mock_serve.MockServed) -> None:
        self.served = served
        self.front_start = len(served.front_log())
        self.engine_start = len(served.engine_log())

    def front(self) -> str:
        return self.served.front_log()[self.front_start:]

    def engine(self) -> str:
        return self.served.engine_log()[self.engine_start:]

    def wait_for(self, needle: str, where: str = "engine", timeout: float = 10.0) -> str:
        read = self.engine if where == "engine" else self.front
        deadline = time.monotonic() + timeout
        while needle not in (text := read()):
            if time.monotonic() > deadline:
                raise AssertionError(f"{needle!r} not in the {where} log since mark; got:\n"
                                     + text[-3000:])
            time.sleep(0.1)
        return text


def mark(served: mock_serve.MockServed) -> LogWindow:
    return LogWindow(served)


def client(served: mock_serve.MockServed) -> httpx.Client:
    return httpx.Client(base_url=served.base_url, timeout=120)


def responses_body(model: str, url: str) -> dict[str, Any]:
    return {"model": model, "max_output_tokens": MAX_TOKENS,
            "input": [{"role": "user", "content": [
                {"type": "input_image", "image_url": url},
                {"type": "input_text", "text": "What is in this picture?"}]}]}


def embeddings_body(model: str, url: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "What is in this picture?"}]}]}


def error_of(response: httpx.Response) -> Any:
    try:
        return response.json().get("error")
    except (json.JSONDecodeError, AttributeError):
        return response.text
