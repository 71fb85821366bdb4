"""Unit-level checks of the retry's edges that need no engine: the flash
late-interaction score/rerank path keeps vLLM's own 503, the error handler adds the
retry headers only to RetryableRequestError, and the retry's patches are exactly the
ones it names."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
from fastapi import Request

from vllm_mmretry import _patching, compat, plugin, retry
from vllm_mmretry.vllm_adapter.base import OutputError


@pytest.fixture(scope="module", autouse=True)
def patched() -> None:
    plugin.register()  # what vLLM does in every process; idempotent
    assert "AsyncLLM.generate" in plugin.active_patches()


def _request() -> Request:
    return Request({"type": "http", "method": "POST", "path": "/score", "headers": [],
                    "query_string": b""})


def _pooling_output(error: Any) -> Any:
    from vllm.outputs import PoolingOutput, PoolingRequestOutput

    return PoolingRequestOutput(request_id="late-interaction-q-0",
                                outputs=PoolingOutput(data=torch.zeros(2)),
                                prompt_token_ids=[1, 2], num_cached_tokens=0,
                                finished=True, error=error)


async def _results(*outs: Any) -> AsyncIterator[tuple[int, Any]]:
    for i, out in enumerate(outs):
        yield i, out


def _scoring_ctx(*outs: Any) -> Any:
    from vllm.entrypoints.pooling.scoring.io_processor import ScoringServeContext
    from vllm.pooling_params import PoolingParams

    ctx = ScoringServeContext(request=None, model_name="m", request_id="score-1",
                              pooling_params=PoolingParams(), lora_request=None,
                              priorities=0, prompt_extras=None,
                              engine_inputs=[{}] * len(outs))
    ctx.result_generator = _results(*outs)
    return ctx


def test_flash_late_interaction_still_collects_with_stock_collect_batch() -> None:
    from vllm.entrypoints.pooling.base.serving import PoolingBaseServing
    from vllm.entrypoints.pooling.scoring.serving import ServingScores

    # The flash path calls _collect_batch directly; neither is wrapped by the retry.
    assert not _patching.is_patched(PoolingBaseServing, "_collect_batch")
    assert "flash_late_interaction" not in vars(ServingScores) or not _patching.is_patched(
        ServingScores, "flash_late_interaction")
    assert "__call__" in vars(ServingScores)  # its own __call__, which we do not touch
    assert not _patching.is_patched(ServingScores, "__call__")


def test_collect_batch_maps_a_retryable_pooling_error_to_503() -> None:
    from vllm.entrypoints.pooling.base.serving import PoolingBaseServing
    from vllm.exceptions import GenerationError, RetryableRequestError
    from vllm.outputs import RequestError

    miss = RequestError(code=retry.MM_CACHE_MISS, message="Multi-modal processor cache miss.",
                        retryable=True)
    with pytest.raises(RetryableRequestError) as exc:
        asyncio.run(PoolingBaseServing._collect_batch(None, _scoring_ctx(_pooling_output(miss))))
    assert exc.value.status_code == 503
    fatal = RequestError(code="internal", message="boom", retryable=False)
    with pytest.raises(GenerationError) as exc2:
        asyncio.run(PoolingBaseServing._collect_batch(None, _scoring_ctx(_pooling_output(fatal))))
    assert not isinstance(exc2.value, RetryableRequestError)


def test_503_answer_carries_retry_headers_and_the_usual_body() -> None:
    """This package's final 503 gets the retry headers; vLLM's own 503s (a pooling task
    it keeps, a paused engine) and 500s keep vLLM's answer."""
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    from vllm.entrypoints.serve.exception_handling.handlers.vllm_error import vllm_error_handler
    from vllm.exceptions import GenerationError, RetryableRequestError

    exc = retry._final_answer("Multi-modal processor cache miss.")
    assert isinstance(exc, RetryableRequestError)
    resp = asyncio.run(vllm_error_handler(_request(), exc))
    assert resp.status_code == 503
    assert resp.headers["retry-after"] == "1" and resp.headers["x-should-retry"] == "true"
    assert json.loads(resp.body) == create_error_response(exc).model_dump()
    vllms = RetryableRequestError("Multi-modal processor cache miss.")
    stock = asyncio.run(vllm_error_handler(_request(), vllms))
    assert stock.status_code == 503 and json.loads(stock.body) == json.loads(resp.body)
    assert "retry-after" not in stock.headers and "x-should-retry" not in stock.headers
    plain = asyncio.run(vllm_error_handler(_request(), GenerationError("Internal server error")))
    assert plain.status_code == 500 and "retry-after" not in plain.headers


def _completion(error: Any) -> Any:
    from vllm.outputs import CompletionOutput, RequestOutput

    done = CompletionOutput(index=0, text="", token_ids=[], cumulative_logprob=None,
                            logprobs=None, finish_reason="error" if error else "length")
    out = RequestOutput(request_id="r-1", prompt="p", prompt_token_ids=[1], prompt_logprobs=None,
                        outputs=[done], finished=True)
    out.error = error
    return out


@pytest.mark.parametrize("retry_ends", ["output", "other_error", "nothing", "miss_again"])
def test_recovered_counts_only_a_retry_that_produced_output(retry_ends: str) -> None:
    """A retry whose stream ends with a non-retryable error failed again (vLLM answers
    it); one that ends with nothing was given up by its caller."""
    from prometheus_client import REGISTRY
    from vllm.outputs import RequestError

    miss = RequestError(code=retry.MM_CACHE_MISS, message="miss", retryable=True)
    other = RequestError(code="internal", message="boom", retryable=False)
    second = {"output": [_completion(None)], "other_error": [_completion(other)], "nothing": [],
              "miss_again": [_completion(miss)]}

    async def rerender(skip_mm_cache: bool) -> list[Any]:
        return ["prompt again"]

    attempts = [[_completion(miss)], second[retry_ends]]

    async def generate(prompt: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
        for out in attempts.pop(0):
            yield out

    async def drain() -> list[Any]:
        call = retry._EndpointCall("/units", rerender, stream=False)
        return [o async for o in retry._guarded(call, 0, generate, ("prompt", None, "r-1"), {})]

    def counted() -> dict[str, float]:
        values = {o: REGISTRY.get_sample_value("vllm_mmretry_retries_total",
                                               {"endpoint": "/units", "outcome": o})
                  for o in ("recovered", "failed_again", "budget_exhausted")}
        return {o: v or 0.0 for o, v in values.items()}

    before = counted()
    if retry_ends == "miss_again":  # the 503 this package answers
        with pytest.raises(compat.retryable_request_error()) as raised:
            asyncio.run(drain())
        assert retry.is_our_answer(raised.value) and attempts == []
    else:
        outs = asyncio.run(drain())
        assert outs == second[retry_ends] and attempts == []
    after = counted()
    grown = {o: after[o] - before[o] for o in after if after[o] != before[o]}
    assert grown == {"output": {"recovered": 1}, "other_error": {"failed_again": 1},
                     "nothing": {}, "miss_again": {"failed_again": 1}}[retry_ends]


def test_retryable_error_reads_only_terminal_retryable_structured_errors() -> None:
    from vllm.outputs import RequestError

    miss = RequestError(code=retry.MM_CACHE_MISS, message="m", retryable=True)
    assert retry.retryable_error(_pooling_output(miss)) == OutputError(retry.MM_CACHE_MISS, "m",
                                                                        True)
    assert retry.retryable_error(_pooling_output(None)) is None
    assert retry.retryable_error(_pooling_output(
        RequestError(code="x", message="m", retryable=False))) is None
    running = _pooling_output(miss)
    running.finished = False
    assert retry.retryable_error(running) is None


def test_generate_outside_the_endpoints_is_the_original_stream() -> None:
    """Responses, batch, beam search ... call generate() without the endpoint mark:
    they get AsyncLLM's own generator object, untouched."""
    seams = compat.retry_seams()
    original = _patching.original(seams.engine_client, seams.generate)
    assert seams.engine_client.generate is not original

    class Engine:
        pass

    gen = seams.engine_client.generate(Engine(), "prompt", None, "req-1")
    try:
        assert gen.ag_code is original.__code__  # AsyncLLM.generate's own frame
    finally:
        asyncio.run(gen.aclose())


def test_no_retry_once_a_stream_sent_output_of_an_earlier_prompt() -> None:
    """A streamed multi-prompt call (/v1/completions with a list of prompts) whose first
    prompt already sent output: a later prompt's miss is passed through, not retried
    (the client has part of the answer)."""
    from vllm.outputs import RequestError

    miss = RequestError(code=retry.MM_CACHE_MISS, message="miss", retryable=True)
    rerendered: list[bool] = []

    async def rerender(skip_mm_cache: bool) -> list[Any]:
        rerendered.append(skip_mm_cache)
        return ["p0", "p1"]

    streams = {"p0": [_completion(None)], "p1": [_completion(miss)]}

    async def generate(prompt: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
        for out in streams[prompt]:
            yield out

    async def run() -> list[Any]:
        call = retry._EndpointCall("/units", rerender, stream=True)
        first = [o async for o in retry._guarded(call, 0, generate, ("p0", None, "r-0"), {})]
        second = [o async for o in retry._guarded(call, 1, generate, ("p1", None, "r-1"), {})]
        return first + second

    outs = asyncio.run(run())
    assert rerendered == [] and outs[-1].error is miss


def test_an_endpoint_call_deposits_in_the_retry_budget() -> None:
    """Every HTTP call of a retrying endpoint counts in the budget's request share."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    from vllm_mmretry import budget

    async def original(self: Any, request: Any, raw_request: Any) -> str:
        return "answered"

    async def render(self: Any, request: Any, skip_mm_cache: bool) -> list[Any]:
        return []

    entry = retry._wrap_endpoint(original, "/v1/chat/completions", render)
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    raw = Request({"type": "http", "method": "POST", "path": "/units/deposit", "headers": [],
                   "query_string": b""})
    before = budget.current().snapshot()["requests"].get("/units/deposit", 0)
    assert asyncio.run(entry(None, request, raw)) == "answered"
    assert budget.current().snapshot()["requests"].get("/units/deposit", 0) == before + 1


def test_a_responses_stream_error_keeps_the_vllm_error_it_was_raised_in() -> None:
    """The error event answers with the vLLM error the stream failed while handling
    (implicitly chained, via __context__), here a 503, not a generic 500."""
    retryable = compat.retryable_request_error()

    async def original(generator: Any) -> AsyncIterator[str]:
        yield "event: one\n\n"
        try:
            raise retryable("busy")
        except retryable:
            raise RuntimeError("while writing the event")  # noqa: B904 - the implicit chain

    async def run() -> list[str]:
        return [c async for c in retry._wrap_responses_sse(original)(None)]

    chunks = asyncio.run(run())
    event = json.loads(chunks[-1].split("data: ", 1)[1])
    assert event["code"] == "503" and event["sequence_number"] == 1, event
