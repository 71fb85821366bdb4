"""The serving-layer retry on /v1/chat/completions and /v1/completions, against
vLLM's real app, serving classes and an engine (AsyncLLM + engine-core process) on
the tiny LLaVA. Faults are injected at the engine-output boundary
(retry_support.EngineFaults); everything above it is vLLM as `vllm serve` runs it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from retry_support import Fault, InProcessServer, image_messages, in_process_server, png_data_url, retry_log_lines

CHAT, CMPL, RESP = "/v1/chat/completions", "/v1/completions", "/v1/responses"


@pytest.fixture(scope="module")
def server() -> Iterator[InProcessServer]:
    with in_process_server() as s:
        yield s


@pytest.fixture(autouse=True)
def fresh(server: InProcessServer) -> Iterator[None]:
    assert server.faults is not None
    server.faults.clear()
    yield
    server.faults.clear()


@pytest.fixture
def retry_log() -> Iterator[list[str]]:
    with retry_log_lines() as lines:
        yield lines


def chat_body(rid: str, text: str = "describe the picture", seed: int = 0,
              max_tokens: int = 8) -> dict[str, Any]:
    return {"messages": image_messages(text, seed), "max_tokens": max_tokens,
            "temperature": 0, "request_id": rid}


def cmpl_body(rid: str, prompt: str | list[str] = "The capital of France is",
              max_tokens: int = 8) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "request_id": rid}


def answer(path: str, resp: Any) -> list[str]:
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    return [c["message"]["content"] if path == CHAT else c["text"] for c in choices]


def streamed(path: str, events: list[Any]) -> tuple[str, list[dict[str, Any]]]:
    """Streamed text per choice (joined by "|" in index order) and the error events.

    Per choice because with n > 1 how the choices' chunks interleave depends on timing."""
    text: dict[int, list[str]] = {}
    errors = []
    for ev in events:
        if ev == "[DONE]":
            continue
        if "error" in ev:
            errors.append(ev["error"])
            continue
        for c in ev["choices"]:
            text.setdefault(c.get("index", 0), []).append(
                (c.get("delta") or {}).get("content") or "" if path == CHAT
                else c.get("text") or "")
    return "|".join("".join(text[i]) for i in sorted(text)), errors


def body_for(path: str, rid: str) -> dict[str, Any]:
    return chat_body(rid) if path == CHAT else cmpl_body(rid)


def test_plugin_installed_the_retry_in_this_process() -> None:
    from vllm_mmretry import plugin

    patched = plugin.active_patches()
    assert "AsyncLLM.generate" in patched
    assert "OpenAIServingChat.create_chat_completion" in patched
    assert "OpenAIServingCompletion.create_completion" in patched


def test_the_engine_vllm_built_invalidates_through_its_renderer(server: InProcessServer) -> None:
    """The plugin's engine __init__ wires the output processor to the renderer that
    holds P0's cache (read at each miss, so a rebuilt cache is still the one
    invalidated)."""
    from vllm_mmretry.output_processor import OutputProcessor
    from vllm_mmretry.vllm_adapter import adapter

    op = adapter().engine_output_processor(server.engine)
    renderer = adapter().engine_renderer(server.engine)
    assert isinstance(op, OutputProcessor) and renderer is not None
    assert op.mm_processor_cache is renderer


@pytest.mark.parametrize("path", [CHAT, CMPL])
def test_first_miss_recovers_identically_not_streaming(
        server: InProcessServer, path: str, retry_log: list[str]) -> None:
    faults = server.faults
    reference = answer(path, server.post(path, body_for(path, "ref-ns")))
    faults.clear()
    fault = faults.add(Fault("miss-ns"))
    got = answer(path, server.post(path, body_for(path, "miss-ns")))
    assert got == reference
    assert len(fault.hits) == 1
    # Same request id submitted twice; the retry rendered with skip_mm_cache=True.
    assert len(faults.submitted) == 2 and faults.submitted[0] == faults.submitted[1]
    assert faults.renders == [False, True]
    retries = [line for line in retry_log if "vllm-mmretry: retrying" in line]
    assert len(retries) == 1 and "miss-ns" in retries[0]
    assert "multimodal_cache_miss" in retries[0] and path in retries[0]
    assert "attempt 2" in retries[0]


@pytest.mark.parametrize("path", [CHAT, CMPL])
def test_first_miss_recovers_identically_streaming(server: InProcessServer, path: str) -> None:
    faults = server.faults
    status, events = server.stream(path, body_for(path, "ref-s"))
    reference, errors = streamed(path, events)
    assert status == 200 and not errors and reference
    faults.clear()
    faults.add(Fault("miss-s"))
    status, events = server.stream(path, body_for(path, "miss-s"))
    text, errors = streamed(path, events)
    assert status == 200 and not errors
    assert text == reference and events[-1] == "[DONE]"
    assert faults.renders == [False, True] and len(faults.submitted) == 2


@pytest.mark.parametrize("path", [CHAT, CMPL])
def test_second_failure_is_503_with_retry_headers(
        server: InProcessServer, path: str, retry_log: list[str]) -> None:
    server.faults.add(Fault("twice-ns", times=2))
    resp = server.post(path, body_for(path, "twice-ns"))
    assert resp.status_code == 503, resp.text
    assert resp.headers["retry-after"] == "1"
    assert resp.headers["x-should-retry"] == "true"
    err = resp.json()["error"]  # vLLM's usual error body
    assert err["code"] == 503 and err["type"] == "ServiceUnavailableError"
    assert len(server.faults.submitted) == 2  # exactly one retry
    assert sum("vllm-mmretry: retrying" in line for line in retry_log) == 1
    assert sum("failed again" in line and "twice-ns" in line for line in retry_log) == 1


@pytest.mark.parametrize("path", [CHAT, CMPL])
def test_second_failure_streaming_is_an_error_event(server: InProcessServer, path: str) -> None:
    server.faults.add(Fault("twice-s", times=2))
    status, events = server.stream(path, body_for(path, "twice-s"))
    text, errors = streamed(path, events)
    assert status == 200 and text == ""
    # vLLM 0.32's streams label every GenerationError "InternalServerError", its own
    # retryable ones too; the code says 503.
    assert [(e["code"], e["type"]) for e in errors] == [(503, "InternalServerError")]
    assert events[-1] == "[DONE]"
    assert len(server.faults.submitted) == 2


MESSAGES = "/v1/messages"


def messages_body(seed: int = 0) -> dict[str, Any]:
    """An Anthropic Messages request with an image (vLLM serves it with the chat handler)."""
    image = {"type": "image", "source": {"type": "url", "url": png_data_url(seed)}}
    return {"max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": [image, {"type": "text", "text": "hi"}]}]}


def test_messages_route_recovers_a_miss(server: InProcessServer, retry_log: list[str]) -> None:
    reference = server.post(MESSAGES, messages_body())
    assert reference.status_code == 200, reference.text
    server.faults.clear()
    fault = server.faults.add(Fault(""))
    got = server.post(MESSAGES, messages_body())
    assert got.status_code == 200, got.text
    assert got.json()["content"] == reference.json()["content"]
    assert len(fault.hits) == 1 and server.faults.renders == [False, True]
    assert sum("vllm-mmretry: retrying" in line and MESSAGES in line for line in retry_log) == 1


def test_messages_route_second_failure_is_503_with_retry_headers(server: InProcessServer) -> None:
    """vLLM's Anthropic router answers errors itself (not through vLLM's error handler):
    its 503 still carries the retry headers."""
    server.faults.add(Fault("", times=2))
    resp = server.post(MESSAGES, messages_body(1))
    assert resp.status_code == 503, resp.text
    assert resp.headers["retry-after"] == "1" and resp.headers["x-should-retry"] == "true"
    assert resp.json()["type"] == "error"  # vLLM's Anthropic error body
    assert len(server.faults.submitted) == 2


def test_messages_route_other_errors_keep_vllms_answer(server: InProcessServer) -> None:
    server.faults.add(Fault("", kind="fatal"))
    resp = server.post(MESSAGES, messages_body(2))
    assert resp.status_code == 500, resp.text
    assert "retry-after" not in resp.headers and "x-should-retry" not in resp.headers


@pytest.mark.parametrize("path", [CHAT, CMPL])
def test_no_retry_after_the_first_streamed_chunk(server: InProcessServer, path: str) -> None:
    # The miss arrives with the request's third engine output, held back long
    # enough that the first chunks have been streamed.
    server.faults.add(Fault("late", at_output=2, delay_s=0.5))
    status, events = server.stream(path, body_for(path, "late"))
    text, errors = streamed(path, events)
    assert status == 200 and text  # part of the answer went out ...
    assert [e["code"] for e in errors] == [500]  # ... so stock handling, no retry
    assert len(server.faults.submitted) == 1 and server.faults.renders == [False]


@pytest.mark.parametrize("path", [CHAT, CMPL])
def test_non_retryable_error_is_stock_500(server: InProcessServer, path: str,
                                          retry_log: list[str]) -> None:
    server.faults.add(Fault("fatal-ns", kind="fatal"))
    resp = server.post(path, body_for(path, "fatal-ns"))
    assert resp.status_code == 500
    assert resp.json()["error"]["type"] == "InternalServerError"
    assert "retry-after" not in resp.headers
    server.faults.add(Fault("fatal-s", kind="fatal"))
    _status, events = server.stream(path, body_for(path, "fatal-s"))
    assert [e["code"] for e in streamed(path, events)[1]] == [500]
    assert len(server.faults.submitted) == 2  # one per request: no retries
    assert not [line for line in retry_log if "vllm-mmretry" in line]


def test_other_retryable_error_rerenders_normally(server: InProcessServer) -> None:
    reference = answer(CHAT, server.post(CHAT, chat_body("ref-tr")))
    server.faults.clear()
    server.faults.add(Fault("transient", kind="transient"))
    assert answer(CHAT, server.post(CHAT, chat_body("transient"))) == reference
    assert server.faults.renders == [False, False] and len(server.faults.submitted) == 2


def test_multi_prompt_completion_retries_only_the_failed_prompt(server: InProcessServer) -> None:
    prompts = ["The capital of France is", "One, two, three,"]
    reference = answer(CMPL, server.post(CMPL, cmpl_body("ref-mp", prompts)))
    server.faults.clear()
    server.faults.add(Fault("cmpl-mp-1"))
    assert answer(CMPL, server.post(CMPL, cmpl_body("mp", prompts))) == reference
    assert sorted(server.faults.submitted) == ["cmpl-mp-0", "cmpl-mp-1", "cmpl-mp-1"]


def test_one_retry_per_request_across_prompts(server: InProcessServer) -> None:
    prompts = ["The capital of France is", "One, two, three,"]
    server.faults.add(Fault("cmpl-both-0"))
    server.faults.add(Fault("cmpl-both-1"))
    resp = server.post(CMPL, cmpl_body("both", prompts))
    assert resp.status_code == 503


def test_responses_streaming_keeps_stock_error_handling(server: InProcessServer,
                                                        retry_log: list[str]) -> None:
    fault = server.faults.add(Fault("resp_s"))
    resp = server.post(RESP, {"input": "Hello there", "max_output_tokens": 8,
                              "temperature": 0, "stream": True, "request_id": "resp_s"})
    assert resp.status_code == 200
    events = [json.loads(line[len("data: "):]) for line in resp.text.splitlines()
              if line.startswith("data: ")]
    # vLLM 0.32 cuts this stream (its error JSON is no Responses event); the plugin
    # ends it with an OpenAI `error` event carrying vLLM's usual error body.
    assert [e["type"] for e in events] == ["response.created", "response.in_progress",
                                           "error"]
    assert events[-1]["code"] == "500" and events[-1]["sequence_number"] == 2
    assert events[-1]["error"]["type"] == "InternalServerError"
    assert fault.hits and len(server.faults.submitted) == 1
    assert not [line for line in retry_log if "vllm-mmretry: retrying" in line]


def test_responses_non_streaming_keeps_stock_500(server: InProcessServer) -> None:
    fault = server.faults.add(Fault("resp_ns"))
    resp = server.post(RESP, {"input": "Hello there", "max_output_tokens": 8,
                              "temperature": 0, "request_id": "resp_ns"})
    assert resp.status_code == 500, resp.text
    assert fault.hits and len(server.faults.submitted) == 1


def test_beam_search_keeps_stock_error_handling(server: InProcessServer,
                                                retry_log: list[str]) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
            "use_beam_search": True, "n": 2, "request_id": "beam"}
    ok = server.post(CHAT, {**body, "request_id": "beam-ok"})
    assert ok.status_code == 200, ok.text
    server.faults.clear()
    fault = server.faults.add(Fault("chatcmpl-beam-"))
    resp = server.post(CHAT, body)
    assert fault.hits  # one beam's engine request failed ...
    assert resp.status_code == 500, resp.text  # ... and beam search's own error output
    assert not [line for line in retry_log if "vllm-mmretry" in line]


@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 50), max_tokens=st.integers(1, 12),
       text=st.sampled_from(["describe", "what is this?", "colors", "count the dots"]),
       stream=st.booleans())
def test_recovered_answer_equals_undisturbed_answer(server: InProcessServer, seed: int,
                                                    max_tokens: int, text: str,
                                                    stream: bool) -> None:
    """Differential: a first miss on any image/prompt gives the undisturbed answer."""
    server.faults.clear()
    body = chat_body("", text, seed, max_tokens)
    if stream:
        ref = streamed(CHAT, server.stream(CHAT, {**body, "request_id": f"hr-{seed}"})[1])
        server.faults.add(Fault(f"hm-{seed}-"))
        got = streamed(CHAT, server.stream(CHAT, {**body, "request_id": f"hm-{seed}-"})[1])
    else:
        ref = answer(CHAT, server.post(CHAT, {**body, "request_id": f"hr-{seed}"}))
        server.faults.add(Fault(f"hm-{seed}-"))
        got = answer(CHAT, server.post(CHAT, {**body, "request_id": f"hm-{seed}-"}))
    assert got == ref
    assert server.faults.renders[-2:] == [False, True]


def test_n2_chat_miss_recovers_all_choices(server: InProcessServer) -> None:
    """n>1: the output processor aborts the siblings and publishes one terminal
    error; the endpoint retries the whole request once."""
    body = {**chat_body("n2-ref"), "n": 2, "temperature": 0.8, "seed": 1234}
    reference = answer(CHAT, server.post(CHAT, body))
    server.faults.clear()
    fault = server.faults.add(Fault("n2-miss"))
    got = answer(CHAT, server.post(CHAT, {**body, "request_id": "n2-miss"}))
    assert got == reference and len(got) == 2 and fault.hits
    assert server.faults.renders == [False, True]


def _stock_call(server: InProcessServer, path: str, body: dict[str, Any]) -> Any:
    """The same request through vLLM's own (unpatched) serving method."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from vllm_mmretry import _patching, compat

    seams = compat.retry_seams()
    if path == CHAT:
        stock = _patching.original(seams.chat_serving, seams.chat_entry)
        serving = server.app.state.openai_serving_chat
        request = ChatCompletionRequest(model=server.model, **body)
    else:
        stock = _patching.original(seams.completion_serving, seams.completion_entry)
        serving = server.app.state.openai_serving_completion
        request = CompletionRequest(model=server.model, **body)

    async def run() -> Any:
        result = await stock(serving, request, None)
        if body.get("stream"):
            return [json.loads(c[len("data: "):]) if c.strip() != "data: [DONE]" else "[DONE]"
                    async for c in result]
        return result.model_dump()

    return server.run(run())


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from([CHAT, CMPL]), stream=st.booleans(), n=st.integers(1, 2),
       max_tokens=st.integers(1, 10), seed=st.integers(0, 20))
def test_undisturbed_requests_match_stock_vllm(server: InProcessServer, path: str,
                                               stream: bool, n: int, max_tokens: int,
                                               seed: int) -> None:
    """Differential against vLLM's own serving method: without faults the retrying
    endpoints answer exactly what stock vLLM answers."""
    server.faults.clear()
    body = chat_body(f"d-{seed}", seed=seed, max_tokens=max_tokens) if path == CHAT else \
        cmpl_body(f"d-{seed}", f"Count: {seed},", max_tokens)
    # No logprobs: the tiny model's vocabulary (32064) is larger than its tokenizer's,
    # and vLLM 0.32's logprob decoding kills the engine on an id with no token.
    body.update(n=n)
    if n > 1:  # greedy sampling allows n=1 only; a seed keeps it reproducible
        body.update(temperature=0.8, seed=seed)
    if stream:
        status, ours = server.stream(path, body)
        assert status == 200
        stock = _stock_call(server, path, {**body, "stream": True})
        assert streamed(path, ours) == streamed(path, stock)
        assert not streamed(path, ours)[1]
    else:
        ours = server.post(path, body).json()
        stock = _stock_call(server, path, body)
        for key in ("id", "created", "system_fingerprint"):
            ours.pop(key, None), stock.pop(key, None)
        assert ours == stock


def test_run_batch_keeps_its_own_policy(server: InProcessServer, retry_log: list[str]) -> None:
    """vLLM's run_batch calls the same serving method without an HTTP request: no
    retry there; the miss becomes its usual error line (500)."""
    from vllm.entrypoints.launchers.run_batch import BatchProgressTracker, BatchRequestInput, run_request

    fault = server.faults.add(Fault("rb-miss"))
    item = BatchRequestInput(custom_id="c1", method="POST", url="/v1/chat/completions",
                             body={"model": server.model, **chat_body("rb-miss")})
    serving = server.app.state.openai_serving_chat
    out = server.run(run_request(serving.create_chat_completion, item, BatchProgressTracker()))
    assert fault.hits and len(server.faults.submitted) == 1
    assert out.response.status_code == 500 and out.error.error.code == 500
    assert not [line for line in retry_log if "vllm-mmretry" in line]
