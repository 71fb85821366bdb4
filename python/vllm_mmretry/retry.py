"""One pre-output retry in the API server's endpoints.

A P1 multimodal cache miss ends a request before it produced anything, with a
structured, retryable `error` on its terminal output. `/v1/chat/completions`,
`/v1/completions` (streaming or not) and the ordinary pooling path behind
`/v1/embeddings` and `/v2/embed` keep the source request; when a request ends like
that before any part of its answer reached the client, the endpoint re-renders the
retained request (`skip_mm_cache=True` after a cache miss, so the image data travels
again) and submits it once more. A second failure is vLLM's RetryableRequestError:
HTTP 503 with `Retry-After` and `x-should-retry: true`, or an error event in a stream.
Retries are spent from the API server's retry budget (budget.py): past it, the first
failure is answered that way at once.

Nothing is raised below the endpoints: every other consumer of the engine
(Responses, batch, beam search, ...) still receives the terminal output and applies
its own policy. The generation endpoints mark their calls with a context variable;
`generate()` only wraps its stream for calls made under that mark."""

from __future__ import annotations

import contextvars
import copy
import functools
import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from vllm_mmretry import _patching, budget
from vllm_mmretry import metrics as _metrics  # vllm-mmretry metrics hook
from vllm_mmretry.vllm_adapter import adapter, vllm_logger
from vllm_mmretry.vllm_adapter.base import OutputError, PoolingResults

MM_CACHE_MISS = "multimodal_cache_miss"
# Headers on the final 503 so stock OpenAI clients retry on their own.
RETRY_HEADERS = {"Retry-After": "1", "x-should-retry": "true"}

_logger: Any = None


def _log() -> Any:
    global _logger
    if _logger is None:
        _logger = vllm_logger("vllm.vllm_mmretry.retry")
    return _logger


def retryable_error(output: Any) -> OutputError | None:
    """The structured error of a terminal output that may be retried, else None."""
    error = adapter().finished_error(output)
    return error if error is not None and error.retryable else None


def _log_retry(request_id: str | None, endpoint: str, error: OutputError,
               skip_mm_cache: bool) -> None:
    _log().warning(
        "vllm-mmretry: retrying request %s (endpoint %s, error %s, attempt 2 of 2, "
        "skip_mm_cache=%s)", request_id, endpoint, error.code, skip_mm_cache)


def _log_final(request_id: str | None, endpoint: str, error: OutputError) -> None:
    _log().warning(
        "vllm-mmretry: request %s failed again after its retry (endpoint %s, error %s, "
        "attempt 2 of 2); answering 503", request_id, endpoint, error.code)
    _metrics.count_retry(endpoint, "failed_again")  # vllm-mmretry metrics hook


def _retry_allowed(endpoint: str) -> bool:
    """The one place a retry is granted: the API server's retry budget decides."""
    if budget.current().try_withdraw(endpoint):
        return True
    _metrics.count_retry(endpoint, "budget_exhausted")  # vllm-mmretry metrics hook
    return False


# Set on the RetryableRequestErrors this package answers with: only those get
# RETRY_HEADERS; vLLM's own 503s (a pooling task it keeps, 0.33's paused engine)
# keep vLLM's answer.
_OURS = "_vllm_mmretry_answer"


def _ours(exc: Exception) -> Exception:
    setattr(exc, _OURS, True)
    return exc


def _final_answer(message: str) -> Exception:
    """The 503 that ends an endpoint call whose retry failed or was not granted."""
    return _ours(adapter().retryable_request_error()(message))


def is_our_answer(exc: BaseException) -> bool:
    return getattr(exc, _OURS, False) is True


@dataclass
class _EndpointCall:
    """One call of a generation endpoint: how to re-render its retained request,
    and its single retry shared by all of its prompts."""

    endpoint: str
    rerender: Callable[[bool], Awaitable[list[Any]]]  # skip_mm_cache -> engine inputs
    stream: bool
    retried: bool = False
    delivered: bool = False  # some output went on towards the client
    submitted: int = 0  # generate() calls so far = index of the next prompt


_CALL: contextvars.ContextVar[_EndpointCall | None] = contextvars.ContextVar(
    "vllm_mmretry_endpoint_call", default=None)


async def _guarded(call: _EndpointCall, index: int, generate: Callable[..., Any],
                   args: tuple[Any, ...], kwargs: dict[str, Any]
                   ) -> AsyncGenerator[Any, None]:
    """The engine stream of prompt `index`, retried once if it ends in a retryable
    error before anything of the endpoint's answer went out."""
    request_id = adapter().generate_request_id(args, kwargs)
    gen = generate(*args, **kwargs)
    try:
        first = await anext(gen, None)
        error = retryable_error(first) if first is not None else None
        if error is not None and not call.delivered:
            if call.retried:  # the endpoint's one retry went to another prompt
                _log_final(request_id, call.endpoint, error)
                raise _final_answer(error.message)
            if not _retry_allowed(call.endpoint):  # counted and logged by the budget
                raise _final_answer(error.message)
            call.retried = True
            await gen.aclose()
            skip = error.code == MM_CACHE_MISS
            _log_retry(request_id, call.endpoint, error, skip)
            prompt = (await call.rerender(skip))[index]
            args, kwargs = adapter().generate_with_prompt(args, kwargs, prompt)
            gen = generate(*args, **kwargs)
            first = await anext(gen, None)
            error = retryable_error(first) if first is not None else None
            if error is not None:
                _log_final(request_id, call.endpoint, error)
                raise _final_answer(error.message)
            if first is not None:  # no output: the caller went away (nothing to count)
                # vllm-mmretry metrics hook: another error is vLLM's to answer (a 500)
                _metrics.count_retry(call.endpoint, "recovered" if adapter().finished_error(first)
                                     is None else "failed_again")
        if first is None:
            return
        call.delivered = call.delivered or call.stream
        yield first
        async for out in gen:
            yield out
    finally:
        await gen.aclose()


def _wrap_generate(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        call = _CALL.get()
        if call is None:
            return original(self, *args, **kwargs)
        index = call.submitted
        call.submitted += 1
        return _guarded(call, index, functools.partial(original, self), args, kwargs)

    return generate


def _endpoint(raw_request: Any, default: str) -> str:
    # Other routes reuse these serving methods (e.g. /v1/messages, /v2/chat).
    url = getattr(raw_request, "url", None)
    return getattr(url, "path", None) or default


# Values a deep copy returns as they are (copy's `_deepcopy_atomic`).
_ATOMS = frozenset((str, int, float, bool, type(None), bytes))


def _copy(request: Any) -> Any:
    """A deep copy of the request: rendering may adjust it in place (tool parsers,
    Mistral), and a retry needs the source."""
    if not isinstance(request, BaseModel):
        return copy.deepcopy(request)
    if not _copies_as_pydantic(type(request)):
        return request.model_copy(deep=True)
    return _deep_model_copy(request)


@functools.cache
def _copies_as_pydantic(cls: type[BaseModel]) -> bool:
    """The class copies with pydantic's own methods (no override of its own)."""
    return all(getattr(cls, name) is getattr(BaseModel, name)
               for name in ("model_copy", "__copy__", "__deepcopy__"))


def _deep_model_copy(model: BaseModel) -> BaseModel:
    """`model.model_copy(deep=True)`, the same objects in the result, in about a third
    of the time: pydantic's own shallow copy, then one deepcopy (shared memo, as
    pydantic's `model_copy(deep=True, update=...)` does) for each value that is not an
    atom, where a request's ~100 fields are mostly None, numbers and strings."""
    copied = model.model_copy()
    memo: dict[int, Any] = {id(model): copied}
    _deepcopy_values(copied.__dict__, memo)
    if copied.__pydantic_extra__:
        _deepcopy_values(copied.__pydantic_extra__, memo)
    if copied.__pydantic_private__:
        copied.__pydantic_private__ = copy.deepcopy(copied.__pydantic_private__, memo)
    return copied


def _deepcopy_values(values: dict[str, Any], memo: dict[int, Any]) -> None:
    for name, value in values.items():
        if type(value) not in _ATOMS:
            values[name] = copy.deepcopy(value, memo)


def _wrap_endpoint(original: Callable[..., Any], endpoint: str,
                   render: Callable[[Any, Any, bool], Awaitable[list[Any]]]
                   ) -> Callable[..., Any]:
    @functools.wraps(original)
    async def entry(self: Any, request: Any, raw_request: Any = None) -> Any:
        # Only HTTP requests of the API server retry; run_batch and other callers
        # without one (and beam search) keep vLLM's own policy.
        if raw_request is None or not adapter().retry_applies(request):
            return await original(self, request, raw_request)
        source = _copy(request)

        def rerender(skip_mm_cache: bool) -> Awaitable[list[Any]]:
            return render(self, _copy(source), skip_mm_cache)

        call = _EndpointCall(_endpoint(raw_request, endpoint), rerender,
                             adapter().request_streams(request))
        budget.current().deposit(call.endpoint)
        token = _CALL.set(call)
        try:
            return await original(self, request, raw_request)
        finally:
            _CALL.reset(token)

    return entry


class _ErrorTap:
    """Passes the pooling result stream through, remembering retryable errors."""

    def __init__(self, results: PoolingResults) -> None:
        self.results = results
        self.errors: list[Any] = []

    async def __call__(self) -> PoolingResults:
        try:
            async for i, res in self.results:
                if (error := retryable_error(res)) is not None:
                    self.errors.append(error)
                yield i, res
        finally:
            await self.results.aclose()


def _wrap_pooling(original: Callable[..., Any], retried: tuple[type[Any], ...]) -> Callable[..., Any]:
    retryable = adapter().retryable_request_error()

    @functools.wraps(original)
    async def pooling_call(self: Any, request: Any, raw_request: Any = None) -> Any:
        # Not an API-server HTTP request (e.g. run_batch), or a pooling task that keeps
        # vLLM's own error handling (score, rerank, classify, /pooling).
        if raw_request is None or not isinstance(self, retried):
            return await original(self, request, raw_request)
        source = _copy(request)
        where = _endpoint(raw_request, type(self).__name__)
        budget.current().deposit(where)
        attempt = await adapter().pooling_submit(self, request, raw_request)
        taps: list[_ErrorTap] = []

        def tap(results: PoolingResults) -> PoolingResults:
            taps.append(_ErrorTap(results))
            return taps[-1]()

        adapter().wrap_pooling_results(attempt, tap)
        try:
            return await adapter().pooling_finish(self, attempt)
        except retryable as exc:
            if not taps[0].errors:
                raise  # not an engine result we saw: leave it alone
            if not _retry_allowed(where):  # counted and logged by the budget
                _ours(exc)
                raise
            error = taps[0].errors[0]
        await adapter().pooling_close(attempt)
        request_id = adapter().pooling_request_id(attempt)
        skip = any(e.code == MM_CACHE_MISS for e in taps[0].errors)
        _log_retry(request_id, where, error, skip)
        attempt = await adapter().pooling_submit(self, source, raw_request, skip_mm_cache=skip,
                                              request_id=request_id)
        adapter().wrap_pooling_results(attempt, tap)
        try:
            response = await adapter().pooling_finish(self, attempt)
            _metrics.count_retry(where, "recovered")  # vllm-mmretry metrics hook
            return response
        except retryable as exc:
            errors = taps[-1].errors
            _log_final(request_id, where, errors[0] if errors else error)
            _ours(exc)
            raise

    return pooling_call


def _wrap_error_handler(original: Callable[..., Any]) -> Callable[..., Any]:
    retryable = adapter().retryable_request_error()

    @functools.wraps(original)
    async def generation_error_handler(req: Any, exc: Exception) -> Any:
        response = await original(req, exc)
        if isinstance(exc, retryable) and is_our_answer(exc):
            response.headers.update(RETRY_HEADERS)
        return response

    return generation_error_handler


# The error answer a self-answering route built from this package's retryable error
# (the route builds it, then translates it, in the same task).
_RETRYABLE_ANSWER: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "vllm_mmretry_retryable_answer", default=None)


def _wrap_router_error_response(original: Callable[..., Any]) -> Callable[..., Any]:
    retryable = adapter().retryable_request_error()

    @functools.wraps(original)
    def error_response(exc: Any, *args: Any, **kwargs: Any) -> Any:
        response = original(exc, *args, **kwargs)
        if isinstance(exc, retryable) and is_our_answer(exc):
            _RETRYABLE_ANSWER.set(response)
        return response

    return error_response


def _wrap_router_translate_error(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def translate_error(response: Any, *args: Any, **kwargs: Any) -> Any:
        answer = original(response, *args, **kwargs)
        if response is not None and _RETRYABLE_ANSWER.get() is response:
            _RETRYABLE_ANSWER.set(None)
            answer.headers.update(RETRY_HEADERS)
        return answer

    return translate_error


def _vllm_error_in(exc: BaseException) -> Exception | None:
    """The vLLM error `exc` was raised while handling, if the chain still says so."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, adapter().vllm_error()):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _wrap_responses_sse(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    async def sse_events(generator: Any) -> AsyncGenerator[str, None]:
        sent = 0
        try:
            async for chunk in original(generator):
                sent += 1
                yield chunk
        except Exception as exc:  # noqa: BLE001 - any failure ends the stream with an error event, not a cut
            # 0.32 loses the GenerationError here (its error event fails validation
            # in pydantic-core, which drops the context): answer as vLLM would, 500.
            cause = _vllm_error_in(exc)
            body = adapter().error_body(cause or adapter().generation_error()())
            _log().warning("vllm-mmretry: Responses stream failed (%s); ending it with an "
                           "error event", type(exc).__name__)
            event = {"type": "error", "code": str(body["error"]["code"]),
                     "message": body["error"]["message"], "param": None,
                     "sequence_number": sent, **body}
            yield f"event: error\ndata: {json.dumps(event)}\n\n"

    return sse_events


def install() -> list[str]:
    budget.install(log=lambda message: _log().warning("%s", message))
    s = adapter().retry_seams()
    orig = _patching.original
    sse_module, sse_name = adapter().responses_sse_writer()
    return [
        _patching.patch_attr(s.engine_client, s.generate,
                             _wrap_generate(orig(s.engine_client, s.generate))),
        _patching.patch_attr(s.chat_serving, s.chat_entry, _wrap_endpoint(
            orig(s.chat_serving, s.chat_entry), "/v1/chat/completions", adapter().render_chat)),
        _patching.patch_attr(s.completion_serving, s.completion_entry, _wrap_endpoint(
            orig(s.completion_serving, s.completion_entry), "/v1/completions",
            adapter().render_completion)),
        _patching.patch_attr(s.pooling_serving, s.pooling_entry, _wrap_pooling(
            orig(s.pooling_serving, s.pooling_entry), s.pooling_retried)),
        _patching.patch_attr(s.error_handlers, s.error_handler,
                             _wrap_error_handler(orig(s.error_handlers, s.error_handler))),
        _patching.patch_attr(sse_module, sse_name,
                             _wrap_responses_sse(orig(sse_module, sse_name))),
        *_patch_self_answering_router(s),
    ]


def _patch_self_answering_router(s: Any) -> list[str]:
    """The retry headers on the second failure of routes that answer errors themselves
    (vLLM's Anthropic router: /v1/messages), which vLLM's error handler never sees."""
    router = s.self_answering_router
    if router is None:
        return []
    orig = _patching.original
    return [
        _patching.patch_attr(router, s.router_error_response, _wrap_router_error_response(
            orig(router, s.router_error_response))),
        _patching.patch_attr(router, s.router_translate_error, _wrap_router_translate_error(
            orig(router, s.router_translate_error))),
    ]
