"""vLLM 0.33 with the native engine-output decoder on (VLLM_MMRETRY_NATIVE_DECODE=1)
and the engine-output socket read by the native thread (VLLM_MMRETRY_NATIVE_RECEIVE=1),
served over HTTP in front of vLLM's mock engine, whose messages come from a second,
independent encoder (the mock engine's Rust one). Requests behave as with vLLM's
decoder (a forgotten item is still retried), and every message the API server
decoded, recorded as it arrived (record_outputs/sitecustomize.py), decodes to the
same object through the native reader as through vLLM's `MsgpackDecoder`."""

from __future__ import annotations

import base64
import json
import os
import pathlib
import sys
from collections.abc import Iterator

import pytest
from e033_helpers import (
    ARRIVED,
    RETRY_LINE,
    chat_body,
    client,
    error_events,
    image_url,
    mark,
    mock_serve,
    requires_plugin_on_this_vllm,
    serve,
    stream_chat,
)

RECORDER = pathlib.Path(__file__).resolve().parent / "record_outputs"
TESTS = pathlib.Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))


@pytest.fixture(scope="module")
def record_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("engine-outputs")


@pytest.fixture(scope="module")
def native(model: str, record_dir: pathlib.Path) -> Iterator[mock_serve.MockServed]:
    requires_plugin_on_this_vllm()
    path = os.pathsep.join(p for p in (str(RECORDER), os.environ.get("PYTHONPATH", "")) if p)
    yield from serve(model, env={"VLLM_MMRETRY_NATIVE_DECODE": "1", "PYTHONPATH": path,
                                 "VLLM_MMRETRY_NATIVE_RECEIVE": "1",
                                 "VLLM_MMRETRY_TEST_RECORD_DIR": str(record_dir),
                                 "VLLM_MMRETRY_FAULTS": "p1_miss=every:1"})


def recorded(record_dir: pathlib.Path) -> list[list[bytes]]:
    messages = []
    for f in sorted(record_dir.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            messages.append([base64.b64decode(x) for x in json.loads(line)])
    return messages


def test_served_with_the_native_decoder(native: mock_serve.MockServed, model: str,
                                        record_dir: pathlib.Path) -> None:
    from engine_outputs_support import decode_both

    body = chat_body(model, image_url((97, 1, 0)))
    assert "engine-output messages are decoded natively" in native.front_log()
    assert "engine outputs are received by a native thread" in native.front_log()
    with client(native) as http:
        # Chat with n = 2 and a completion with a stop string.
        r = http.post("/v1/chat/completions", json={**body, "n": 2, "temperature": 0.8})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
        r = http.post("/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 8,
                                               "stop": ["zz"]})
        assert r.status_code == 200, r.text
        # Streamed: the engine forgot the item, the miss comes back, the plugin retries.
        window = mark(native)
        status, events = stream_chat(http, body)
        assert status == 200 and error_events(events) == [] and events[-1] == "[DONE]", events
        window.wait_for(ARRIVED)
        assert window.front().count(RETRY_LINE) == 1

    messages = recorded(record_dir)
    # (The mock engine sends no scheduler stats; the 0.32 recording has them.)
    seen = {"native": 0, "finished": 0, "miss": 0, "utility": 0}
    for frames in messages:
        vllm, ours, dec = decode_both(frames)
        assert ours[:2] == vllm[:2], frames
        assert vllm[0] == "decoded", vllm
        m = vllm[2]
        seen["native"] += dec.native
        seen["finished"] += any(o.finish_reason is not None for o in m.outputs)
        seen["miss"] += any(o.mm_cache_miss_hashes for o in m.outputs)
        seen["utility"] += m.utility_output is not None
    # The recording holds what this test says it compares, and the native path ran.
    assert all(seen.values()), (seen, len(messages))
