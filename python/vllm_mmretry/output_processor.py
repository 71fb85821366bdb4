"""Drop-in replacement for vLLM's `OutputProcessor`, backed by the Rust core.

What changes compared to stock vLLM 0.32:
- a generation request that fails with a P1 multimodal cache miss
  (`finish_reason=ERROR` + `mm_cache_miss_hashes`) gets one terminal
  `RequestOutput` with `error=RequestError(code="multimodal_cache_miss",
  retryable=True)`; for n>1 every live sibling is aborted (here and, through
  `reqs_to_abort`, in the engine core) and the parent gets exactly that one output;
- every missing hash of a step is invalidated in P0's sender cache once, before
  any output of the step is published.
Everything else produces the outputs stock vLLM produces (tests/test_differential*).

Speed: requests without per-request Python features run the fast loop in Rust.
When the tokenizer is a Hugging Face fast tokenizer (vLLM's
FastIncrementalDetokenizer path) whose definition the Rust `tokenizers` crate
loads, its vocabulary is loaded once (`native_vocab`) and such requests are
detokenized natively too (stop strings, min_tokens, surplus-token trimming);
otherwise vLLM's Python detokenizer runs, counted by reason in
`counters()["python_detok"]`. `native_detok=False` or VLLM_MMRETRY_NATIVE_DETOK=0
forces the Python detokenizer. A native request that later needs vLLM's Python
path has its ids replayed into its stock detokenizer first. `request_states`
of native requests hold vLLM's detokenizer as it was at add time.
"""

from __future__ import annotations

import functools
import os
from collections import deque
from collections.abc import Iterable
from typing import Any

from vllm.outputs import (
    STREAM_FINISHED,
    CompletionOutput,
    RequestError,
    RequestOutput,
    WeightVersionSpan,
)
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
from vllm.v1.engine.detokenizer import (
    FastIncrementalDetokenizer,
    IncrementalDetokenizer,
    uses_fast_detokenizer,
)
from vllm.v1.engine import output_processor as _stock
from vllm.v1.engine.output_processor import (
    EMPTY_CPU_TENSOR,
    OutputProcessorOutput,
    RequestOutputCollector,
    RequestState,
    StreamingUpdate,
)
from vllm.v1.engine.parallel_sampling import ParentRequest
from vllm.v1.metrics.stats import IterationStats, LoRARequestStates, SchedulerStats

from vllm_mmretry import _core
from vllm_mmretry import metrics as _metrics  # vllm-mmretry metrics hook

MISS_CODE = "multimodal_cache_miss"
_OUTPUT_KIND_CODE = {
    RequestOutputKind.CUMULATIVE: 0,
    RequestOutputKind.DELTA: 1,
    RequestOutputKind.FINAL_ONLY: 2,
}
StockOutputProcessor = _stock.OutputProcessor
# "0" forces vLLM's Python detokenizer (the output loop stays native).
NATIVE_DETOK_ENV = "VLLM_MMRETRY_NATIVE_DETOK"


def miss_error(hashes: list[str]) -> RequestError:
    _metrics.count_cache_miss()  # vllm-mmretry metrics hook
    n = len(hashes)
    return RequestError(
        code=MISS_CODE,
        message=(
            f"Multi-modal processor cache miss: {n} item{'s' if n != 1 else ''} "
            "missing from the engine's cache (P0/P1 cache drift); the front-end "
            "cache entries were dropped, retry the request with the data attached."
        ),
        retryable=True,
    )


# ---------------------------------------------------------------- RequestOutput.error

def ensure_request_output_error() -> None:
    """`RequestOutput.error` exists (class default None) on every output."""
    if "error" not in RequestOutput.__dict__:
        RequestOutput.error = None  # type: ignore[attr-defined]


_stock_ro_init = RequestOutput.__init__
_stock_ro_add = RequestOutput.add


@functools.wraps(_stock_ro_init)
def _ro_init(self: RequestOutput, *args: Any, error: RequestError | None = None, **kwargs: Any) -> None:
    _stock_ro_init(self, *args, **kwargs)
    self.error = error  # type: ignore[attr-defined]


@functools.wraps(_stock_ro_add)
def _ro_add(self: RequestOutput, next_output: RequestOutput, aggregate: bool) -> None:
    _stock_ro_add(self, next_output, aggregate)
    # A merged delta keeps the terminal error (only the last output carries one).
    error = getattr(next_output, "error", None)
    if error is not None:
        self.error = error  # type: ignore[attr-defined]


# ------------------------------------------- per-request Python paths (called from Rust)

def _update_iteration_stats(
    req_state: RequestState,
    eco: EngineCoreOutput,
    engine_core_timestamp: float | None,
    iteration_stats: IterationStats | None,
    lora_states: LoRARequestStates,
) -> None:
    """Stock step 1 (`OutputProcessor._update_stats_from_output`)."""
    if iteration_stats is not None:
        assert engine_core_timestamp is not None and req_state.stats is not None
        iteration_stats.update_from_output(
            eco, engine_core_timestamp, req_state.is_prefilling, req_state.stats,
            lora_states, req_state.lora_name,
        )


def _fallback_step(
    req_state: RequestState,
    eco: EngineCoreOutput,
    engine_core_timestamp: float | None,
    iteration_stats: IterationStats | None,
    weight_version: str | None,
    lora_states: LoRARequestStates,
) -> tuple[Any, FinishReason | None, bool]:
    """vLLM 0.32's loop body for one output of one request (steps 1-4), for
    requests whose features live in vLLM's Python objects. Returns
    (request_output or None, finish_reason, release); release=False keeps a
    streaming-input request alive for its next chunk."""
    _update_iteration_stats(req_state, eco, engine_core_timestamp, iteration_stats, lora_states)
    new_token_ids = eco.new_token_ids
    pooling_output = eco.pooling_output
    finish_reason = eco.finish_reason
    stop_reason = eco.stop_reason
    if eco.routed_experts is not None:
        req_state.routed_experts_chunks.append(eco.routed_experts)
    if req_state.is_prefilling:
        if eco.prefill_stats is not None:
            req_state.num_cached_tokens = eco.prefill_stats.num_cached_tokens
            req_state.num_cache_creation_tokens = eco.prefill_stats.num_cache_creation_tokens
        if req_state.remote_prefill_cached_tokens is not None:
            req_state.num_cached_tokens = req_state.remote_prefill_cached_tokens
        req_state.is_prefilling = False
    if eco.spec_decode_metrics is not None:
        req_state.spec_decode_metrics = eco.spec_decode_metrics

    request_error = None
    if req_state.detokenizer is None and eco.mm_cache_miss_hashes and finish_reason == FinishReason.ERROR:
        # Pooling: stock behaviour (PoolingRequestOutput.error, retryable).
        request_error = RequestError(
            code=MISS_CODE, message="Multi-modal processor cache miss.", retryable=True
        )
        pooling_output = EMPTY_CPU_TENSOR
        _metrics.count_cache_miss()  # vllm-mmretry metrics hook

    if pooling_output is None:
        assert req_state.detokenizer is not None and req_state.logprobs_processor is not None
        if new_token_ids and weight_version is not None:
            req_state.track_weight_version(weight_version)
        num_prev_tokens = req_state.detokenizer.num_output_tokens()
        stop_string = req_state.detokenizer.update(new_token_ids, finish_reason == FinishReason.STOP)
        if stop_string:
            finish_reason = FinishReason.STOP
            stop_reason = stop_string
            StockOutputProcessor._trim_surplus_tokens(req_state, eco, num_prev_tokens)
        if eco.new_sampling_mask is not None:
            req_state.sampling_mask_chunks.append(eco.new_sampling_mask)
        req_state.logprobs_processor.update_from_output(eco)

    request_output = req_state.make_request_output(
        new_token_ids, pooling_output, finish_reason, stop_reason,
        eco.kv_transfer_params, eco.ec_transfer_params, error=request_error,
    )
    if request_output is not None and req_state.streaming_input:
        request_output.finished = False
    release = True
    if finish_reason is not None and req_state.streaming_input:
        release = False
        if req_state.input_chunk_queue:
            req_state.apply_streaming_update(req_state.input_chunk_queue.popleft())
        else:
            req_state.input_chunk_queue = None
    return request_output, finish_reason, release


def _abort_output(req_state: RequestState) -> Any:
    return req_state.make_request_output(
        new_token_ids=[],
        pooling_output=EMPTY_CPU_TENSOR if req_state.detokenizer is None else None,
        finish_reason=FinishReason.ABORT,
        stop_reason=None,
        kv_transfer_params=None,
        ec_transfer_params=None,
    )


def _error_output(
    req_state: RequestState,
    eco: EngineCoreOutput,
    engine_core_timestamp: float | None,
    iteration_stats: IterationStats | None,
    weight_version: str | None,
    lora_states: LoRARequestStates,
) -> RequestOutput:
    """The one terminal output of a generation request whose multimodal inputs
    were missing in the engine's cache (for n>1: of its parent)."""
    _update_iteration_stats(req_state, eco, engine_core_timestamp, iteration_stats, lora_states)
    req_state.is_prefilling = False
    detok = req_state.detokenizer
    assert detok is not None and req_state.logprobs_processor is not None
    if eco.new_token_ids:
        detok.update(eco.new_token_ids, False)
    delta = req_state.output_kind == RequestOutputKind.DELTA
    text = detok.get_next_output_text(True, delta)
    if delta:
        token_ids = detok.output_token_ids[req_state.sent_tokens_offset:] if req_state.stream_interval > 1 else list(eco.new_token_ids)
    else:
        token_ids = detok.output_token_ids
    completion = CompletionOutput(
        index=req_state.request_index,
        text=text,
        token_ids=token_ids,
        cumulative_logprob=req_state.logprobs_processor.cumulative_logprob,
        logprobs=None,
        finish_reason=str(FinishReason.ERROR),
        stop_reason=None,
    )
    parent = req_state.parent_req
    out = RequestOutput(
        request_id=parent.external_req_id if parent is not None else req_state.external_req_id,
        prompt=req_state.prompt,
        prompt_token_ids=req_state.prompt_token_ids,
        prompt_logprobs=None,
        outputs=[completion],
        finished=True,
        metrics=req_state.stats,
        lora_request=req_state.lora_request,
        num_cached_tokens=req_state.num_cached_tokens,
        num_cache_creation_tokens=req_state.num_cache_creation_tokens,
        kv_transfer_params=eco.kv_transfer_params,
        ec_transfer_params=eco.ec_transfer_params,
    )
    out.error = miss_error(list(eco.mm_cache_miss_hashes or ()))  # type: ignore[attr-defined]
    return out


def _adopt_native(req_state: RequestState, output_token_ids: list[int], last_output_offset: int) -> None:
    """Replay a native request's output ids into its (untouched) stock
    detokenizer, so vLLM's Python code can continue it. The stock update runs
    token by token exactly as it would have; stop strings are not re-checked
    (none matched, or the request would have finished)."""
    detok = req_state.detokenizer
    assert detok is not None
    if output_token_ids:
        stop = getattr(detok, "stop", None)
        if stop is not None:
            detok.stop = []
        try:
            detok.update(output_token_ids, False)
        finally:
            if stop is not None:
                detok.stop = stop
    if hasattr(detok, "_last_output_text_offset"):
        detok._last_output_text_offset = last_output_offset


# ------------------------------------------------------------ native vocabulary

_VOCABS: dict[tuple[int, int], tuple[Any, Any]] = {}


def native_vocab(tokenizer: Any) -> tuple[Any, str | None]:
    """(`_core.NativeVocab`, None) for a tokenizer vLLM detokenizes with its
    fast path and whose definition the Rust `tokenizers` crate loads, else
    (None, reason). Loaded from `tokenizer._tokenizer.to_str()`, the exact
    object vLLM's DecodeStream decodes with; cached per tokenizer object."""
    if tokenizer is None:
        return None, "no_tokenizer"
    if not uses_fast_detokenizer(tokenizer):
        name = type(tokenizer).__name__.lower()
        return None, "mistral_tokenizer" if "mistral" in name else "slow_tokenizer"
    if os.environ.get("VLLM_USE_FASTOKENS", "0").lower() not in ("", "0", "false"):
        return None, "fastokens"
    import tokenizers

    if not tokenizers.__version__.startswith("0.23."):
        return None, "tokenizers_version"
    backend = tokenizer._tokenizer
    key = (id(backend), backend.get_vocab_size(with_added_tokens=True))
    hit = _VOCABS.get(key)
    if hit is not None and hit[0] is backend:
        return hit[1], None
    try:
        vocab = _core.NativeVocab(backend.to_str())
    except Exception:  # noqa: BLE001 - any failure means "decode in Python"
        return None, "unserializable_tokenizer"
    if len(_VOCABS) >= 8:
        _VOCABS.pop(next(iter(_VOCABS)))
    _VOCABS[key] = (backend, vocab)  # the backend is kept alive: its id stays unique
    return vocab, None


def _native_enabled(native_detok: bool | None) -> bool:
    if native_detok is not None:
        return native_detok
    return os.environ.get(NATIVE_DETOK_ENV, "1").lower() not in ("0", "false", "no", "off")


def _finished_stats_fn(tracing_enabled: bool) -> Any:
    def finished_stats(
        lora_states: LoRARequestStates,
        iteration_stats: IterationStats,
        req_state: RequestState,
        finish_reason: FinishReason,
        eco: EngineCoreOutput,
    ) -> None:
        # vLLM's own _update_stats_from_finished (it reads only its arguments).
        assert req_state.stats is not None
        iteration_stats.update_from_finished_request(
            finish_reason=finish_reason,
            request_id=req_state.external_req_id,
            num_prompt_tokens=req_state.prompt_len,
            max_tokens_param=req_state.max_tokens_param,
            req_stats=req_state.stats,
            num_cached_tokens=req_state.num_cached_tokens,
        )
        lora_states.request_finished(req_state.request_id, req_state.lora_name)
        ParentRequest.observe_finished_request(
            req_state.parent_req, iteration_stats, req_state.stats.num_generation_tokens
        )
        if tracing_enabled:
            StockOutputProcessor.do_tracing(None, eco, req_state, iteration_stats)  # type: ignore[arg-type]

    return finished_stats


# ------------------------------------------------------------------- the processor

class OutputProcessor:
    """Process EngineCoreOutputs into RequestOutputs (vLLM's interface)."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        log_stats: bool,
        stream_interval: int = 1,
        tracing_enabled: bool = False,
        admission_stats: Any = None,
        native_detok: bool | None = None,
    ) -> None:
        """`native_detok`: detokenize in Rust when the tokenizer allows it
        (default: on unless VLLM_MMRETRY_NATIVE_DETOK=0)."""
        ensure_request_output_error()
        self.log_stats = log_stats
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self.lora_states = LoRARequestStates(log_stats)
        self.tracing_enabled = tracing_enabled
        self.admission_stats = admission_stats
        self._core = _core.OutputCore(
            (EngineCoreOutput, RequestOutput, CompletionOutput, RequestOutputCollector,
             WeightVersionSpan, FinishReason),
            (_fallback_step, _abort_output, _error_output, _finished_stats_fn(tracing_enabled), _adopt_native),
            self.lora_states,
        )
        if _native_enabled(native_detok):
            vocab, self._detok_reason = native_vocab(tokenizer)
            self._core.native_vocab = vocab
        else:
            self._detok_reason = "disabled"
        _metrics.track(self)  # vllm-mmretry metrics hook: publishes counters(), off the step path

    # P0's multimodal sender cache (or the renderer holding it), for invalidation.
    @property
    def mm_processor_cache(self) -> Any:
        return self._core.mm_cache_source

    @mm_processor_cache.setter
    def mm_processor_cache(self, cache_or_renderer: Any) -> None:
        self._core.mm_cache_source = cache_or_renderer

    # -- introspection compatible with stock attributes
    @property
    def request_states(self) -> dict[str, RequestState]:
        """Snapshot {internal id: vLLM RequestState} (fields synced)."""
        return self._core.states()

    @property
    def parent_requests(self) -> dict[str, ParentRequest]:
        return self._core.parents()

    def counters(self) -> dict[str, Any]:
        """Fast/fallback step counts, fallbacks by reason, P0 invalidations."""
        return self._core.counters()

    def get_num_unfinished_requests(self) -> int:
        return len(self._core)

    def has_request(self, request_id: str) -> bool:
        return self._core.has(request_id)

    def has_unfinished_requests(self) -> bool:
        return len(self._core) > 0

    def get_num_queued_tokens(self) -> int:
        return self._core.num_queued_tokens()

    def propagate_error(self, e: Exception) -> None:
        for queue in self._core.queues():
            assert queue is not None
            queue.put(e)

    def update_scheduler_stats(self, scheduler_stats: SchedulerStats | None) -> None:
        self.lora_states.update_scheduler_stats(scheduler_stats)

    def _update_admission_stats(self) -> None:
        if self.admission_stats is not None:
            self.admission_stats.set_num_requests(len(self._core))

    # -- requests
    def abort_requests(self, request_ids: Iterable[str], internal: bool) -> list[str]:
        aborted = self._core.abort(request_ids, internal)
        self._update_admission_stats()
        return aborted

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        parent_req: ParentRequest | None = None,
        request_index: int = 0,
        queue: RequestOutputCollector | None = None,
    ) -> None:
        if not isinstance(request, EngineCoreRequest):
            raise TypeError(f"add_request expects an EngineCoreRequest, got {type(request).__name__}")
        request_id = request.request_id
        if self._core.has(request_id):
            if not self._core.is_streaming(request_id):
                raise ValueError(f"request {request_id!r} is already tracked by the output processor")
            self._update_streaming_request_state(request_id, request, prompt)
            return
        if parent_req is not None and not isinstance(parent_req, ParentRequest):
            raise TypeError("parent_req must be a ParentRequest or None")
        state = RequestState.from_new_request(
            tokenizer=self.tokenizer, request=request, prompt=prompt, parent_req=parent_req,
            request_index=request_index, queue=queue, log_stats=self.log_stats,
            stream_interval=self.stream_interval,
        )
        reason = self._fallback_reason(request, state)
        fast = None if reason else self._fast_info(state, request, self._detok_reason)
        self._core.add(
            request_id, state.external_req_id, state, parent_req, queue, fast, reason,
            bool(request.resumable), request.sampling_params is None,
        )
        self._update_admission_stats()

    def _fallback_reason(self, request: EngineCoreRequest, state: RequestState) -> str | None:
        sp = request.sampling_params
        if sp is None:
            return "pooling"
        if request.resumable:
            return "streaming_input"
        if request.prompt_token_ids is None or request.prompt_embeds is not None:
            return "prompt_embeds"
        if sp.logprobs is not None:
            return "logprobs"
        if sp.prompt_logprobs is not None or sp.prompt_logprob_token_ids is not None:
            return "prompt_logprobs"
        if self.tracing_enabled:
            return "tracing"
        if state.detokenizer is None or state.output_kind not in _OUTPUT_KIND_CODE:
            return "unsupported_state"
        return None

    @staticmethod
    def _fast_info(state: RequestState, request: EngineCoreRequest, detok_reason: str | None) -> dict[str, Any]:
        parent = state.parent_req
        detok = state.detokenizer
        assert detok is not None
        native = None
        if detok_reason is None:
            if type(detok) is FastIncrementalDetokenizer:
                sp = request.sampling_params
                assert sp is not None
                native = {
                    "prompt_token_ids": request.prompt_token_ids,
                    "skip_special_tokens": sp.skip_special_tokens,
                    "spaces_between_special_tokens": sp.spaces_between_special_tokens,
                    "stop": detok.stop,
                    "include_stop_str_in_output": detok.include_stop_str_in_output,
                    "min_tokens": detok.min_tokens,
                }
            else:
                detok_reason = "no_detokenize" if type(detok) is IncrementalDetokenizer else "detokenizer_class"
        return {
            "native": native,
            "detok_reason": detok_reason,
            "detokenizer": detok,
            "output_kind": _OUTPUT_KIND_CODE[state.output_kind],
            "stream_interval": state.stream_interval,
            "num_output_tokens": detok.num_output_tokens(),
            # Same keys, in the same order, as RequestOutput.__init__ sets.
            "ro_template": {
                "request_id": parent.external_req_id if parent is not None else state.external_req_id,
                "prompt": state.prompt,
                "prompt_token_ids": state.prompt_token_ids,
                "prompt_logprobs": None,
                "prompt_token_id_logprobs": None,
                "outputs": None,
                "finished": False,
                "metrics": state.stats,
                "lora_request": state.lora_request,
                "encoder_prompt": None,
                "encoder_prompt_token_ids": None,
                "num_cached_tokens": 0,
                "num_cache_creation_tokens": 0,
                "kv_transfer_params": None,
                "ec_transfer_params": None,
                "error": None,
            },
            "co_template": {
                "index": state.request_index,
                "text": "",
                "token_ids": None,
                "cumulative_logprob": None,
                "logprobs": None,
                "routed_experts": None,
                "finish_reason": None,
                "stop_reason": None,
                "lora_request": None,
                "sampling_mask": None,
                "spec_decode_metrics": None,
                "weight_versions": None,
            },
        }

    def _update_streaming_request_state(self, request_id: str, request: EngineCoreRequest, prompt: str | None) -> None:
        """vLLM's streaming-input update, on the request's stock RequestState."""
        req_state = self._core.state(request_id)
        if not request.resumable:
            if req_state.input_chunk_queue is None:
                self._core.finish_request(request_id)
                self._update_admission_stats()
                if req_state.queue is not None:
                    req_state.queue.put(STREAM_FINISHED)
            elif req_state.input_chunk_queue:
                req_state.input_chunk_queue[-1].final = True
            else:
                req_state.streaming_input = False
            return
        update = StreamingUpdate(
            prompt=prompt, prompt_token_ids=request.prompt_token_ids, arrival_time=request.arrival_time
        )
        if req_state.input_chunk_queue is None:
            req_state.apply_streaming_update(update)
            req_state.input_chunk_queue = deque()
        else:
            req_state.input_chunk_queue.append(update)
        self._core.reload_state(request_id)

    def process_outputs(
        self,
        engine_core_outputs: list[EngineCoreOutput],
        engine_core_timestamp: float | None = None,
        iteration_stats: IterationStats | None = None,
        weight_version: str | None = None,
    ) -> OutputProcessorOutput:
        request_outputs, reqs_to_abort = self._core.process(
            engine_core_outputs, engine_core_timestamp, iteration_stats, weight_version
        )
        if self.admission_stats is not None:
            self._update_admission_stats()
        return OutputProcessorOutput(request_outputs=request_outputs, reqs_to_abort=reqs_to_abort)


# ------------------------------------------------------------------------- install

def install() -> list[str]:
    """Make AsyncLLM and LLMEngine use this OutputProcessor, wired to P0's
    multimodal sender cache, and give RequestOutput its `error` field."""
    from vllm.v1.engine import async_llm, llm_engine

    from vllm_mmretry._patching import patch_attr

    ensure_request_output_error()
    labels = [
        patch_attr(RequestOutput, "__init__", _ro_init),
        patch_attr(RequestOutput, "add", _ro_add),
        patch_attr(async_llm, "OutputProcessor", OutputProcessor),
        patch_attr(llm_engine, "OutputProcessor", OutputProcessor),
    ]
    for engine_cls in (async_llm.AsyncLLM, llm_engine.LLMEngine):
        labels.append(patch_attr(engine_cls, "__init__", _wire_cache(engine_cls.__init__)))
    return labels


def _wire_cache(init: Any) -> Any:
    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        op = getattr(self, "output_processor", None)
        if isinstance(op, OutputProcessor):
            # The renderer, not its cache: read at each miss, so a rebuilt cache
            # is still the one invalidated.
            op.mm_processor_cache = self.renderer

    return __init__
