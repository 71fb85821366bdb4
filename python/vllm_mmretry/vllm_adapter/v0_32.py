"""vLLM 0.32: every vLLM fact this package relies on (imports of vLLM internals,
attribute names, constructor fields, FinishReason codes, private helpers, serving
seams). The rest of the package reaches vLLM only through `Adapter`."""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
from collections.abc import Callable, MutableMapping
from types import ModuleType
from typing import Any, ClassVar

from vllm.logger import init_logger
from vllm.outputs import (
    CompletionOutput,
    RequestError,
    RequestOutput,
    WeightVersionSpan,
)
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
from vllm.v1.engine import output_processor as _stock
from vllm.v1.engine.detokenizer import (
    FastIncrementalDetokenizer,
    IncrementalDetokenizer,
    uses_fast_detokenizer,
)
from vllm.v1.engine.output_processor import (
    EMPTY_CPU_TENSOR,
    OutputProcessorOutput,
    RequestOutputCollector,
    RequestState,
)
from vllm.v1.engine.parallel_sampling import ParentRequest
from vllm.v1.metrics.stats import IterationStats, LoRARequestStates, RequestStateStats

from vllm_mmretry import _core, _patching
from vllm_mmretry import metrics as _metrics  # vllm-mmretry metrics hook
from vllm_mmretry.vllm_adapter.base import (
    CO_FILLED,
    RO_FILLED,
    CoreHelpers,
    CoreSpec,
    EcoFields,
    FastSpec,
    HandlerSeam,
    MergeFields,
    NativeDetokSpec,
    ObjectFields,
    OutputError,
    OutputFields,
    OutputsWire,
    PoolingAttempt,
    PoolingResults,
    ReceiveSeam,
    RetrySeams,
    SelfCheck,
    VllmAdapter,
)

MISS_CODE = "multimodal_cache_miss"
OUTPUT_KIND_CODE = {
    RequestOutputKind.CUMULATIVE: 0,
    RequestOutputKind.DELTA: 1,
    RequestOutputKind.FINAL_ONLY: 2,
}
StockOutputProcessor = _stock.OutputProcessor

# EngineCoreOutput's fields in 0.32, in declaration order (slot order).
ECO_STRUCT_FIELDS: tuple[str, ...] = (
    "request_id", "new_token_ids", "new_logprobs", "new_prompt_logprobs_tensors",
    "pooling_output", "finish_reason", "stop_reason", "events", "kv_transfer_params",
    "ec_transfer_params", "trace_headers", "prefill_stats", "routed_experts",
    "num_nans_in_logits", "mm_cache_miss_hashes", "new_sampling_mask",
    "spec_decode_metrics", "prompt_token_id_logprobs",
)
ECO_FIELDS = EcoFields(
    request_id="request_id", new_token_ids="new_token_ids", new_logprobs="new_logprobs",
    new_prompt_logprobs_tensors="new_prompt_logprobs_tensors",
    pooling_output="pooling_output", finish_reason="finish_reason", stop_reason="stop_reason",
    kv_transfer_params="kv_transfer_params", ec_transfer_params="ec_transfer_params",
    prefill_stats="prefill_stats", routed_experts="routed_experts",
    mm_cache_miss_hashes="mm_cache_miss_hashes", new_sampling_mask="new_sampling_mask",
    spec_decode_metrics="spec_decode_metrics",
    prompt_token_id_logprobs="prompt_token_id_logprobs",
    events="events", num_nans_in_logits="num_nans_in_logits",
)
OUTPUT_FIELDS = OutputFields(
    outputs="outputs", finished="finished", kv_transfer_params="kv_transfer_params",
    ec_transfer_params="ec_transfer_params", num_cached_tokens="num_cached_tokens",
    num_cache_creation_tokens="num_cache_creation_tokens", error="error",
    text="text", token_ids="token_ids", finish_reason="finish_reason",
    stop_reason="stop_reason", spec_decode_metrics="spec_decode_metrics",
    weight_versions="weight_versions",
)
OBJECT_FIELDS = ObjectFields(
    is_prefilling="is_prefilling", num_cached_tokens="num_cached_tokens",
    num_cache_creation_tokens="num_cache_creation_tokens", prompt_len="prompt_len",
    sent_tokens_offset="sent_tokens_offset", spec_decode_metrics="spec_decode_metrics",
    weight_version_starts="weight_version_starts",
    remote_prefill_cached_tokens="remote_prefill_cached_tokens", lora_name="lora_name",
    stats="stats", child_requests="child_requests", parent_request_id="request_id",
    get_outputs="get_outputs", detok_update="update", detok_num_output_tokens="num_output_tokens",
    detok_output_token_ids="output_token_ids", detok_get_next_output_text="get_next_output_text",
    collector_put="put", collector_output="output", collector_ready="ready",
    collector_aggregate="aggregate", output_add="add", request_finished="request_finished",
    update_from_output="update_from_output", mm_processor_cache="mm_processor_cache",
    invalidate="invalidate", stats_num_generation_tokens="num_generation_tokens",
    stats_last_token_ts="last_token_ts", iteration_num_generation_tokens="num_generation_tokens",
    iteration_inter_token_latencies="inter_token_latencies_iter",
)
MERGE_FIELDS = MergeFields(
    index="index", concatenated=("text",), extended=("token_ids",),
    refused=("logprobs", "sampling_mask"),
    kept_unless_none=("spec_decode_metrics", "routed_experts"),
    replaced=("cumulative_logprob", "weight_versions", "finish_reason", "stop_reason"),
    ro_or=("finished",), ro_replaced=("kv_transfer_params", "ec_transfer_params"),
    # Not vLLM's add: ours (`_add_keeping_error`) keeps a terminal error in the merged output.
    ro_kept_unless_none=("error",),
)
# Where each ObjectFields name lives: (class, fields of ObjectFields). Instance
# attributes set in __init__ are checked on a built object (`check_object_fields`).
_METHOD_OWNERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ParentRequest", ("get_outputs",)),
    ("IncrementalDetokenizer", ("detok_update", "detok_num_output_tokens", "detok_output_token_ids",
                                "detok_get_next_output_text")),
    ("RequestOutputCollector", ("collector_put",)),
    ("RequestOutput", ("output_add",)),
    ("LoRARequestStates", ("request_finished",)),
    ("IterationStats", ("update_from_output",)),
)
# vllm.envs variables vLLM's statistics code reads per message (Adapter.stat_env_reads).
STAT_ENV_READS = ("VLLM_COMPUTE_NANS_IN_LOGITS",)
FINISH_CODES = {"stop": 0, "length": 1, "abort": 2, "error": 3, "repetition": 4}
# RequestOutput fields set from the request at add time (the rest per output).
RO_PER_REQUEST = ("request_id", "prompt", "prompt_token_ids", "metrics", "lora_request")
CO_PER_REQUEST = ("index",)


# ---------------------------------------------------------------- RequestOutput.error

def ensure_request_output_error() -> None:
    """`RequestOutput.error` exists (class default None) on every output."""
    if "error" not in RequestOutput.__dict__:
        RequestOutput.error = None


# Built around the value they replace when they are patched in, so a patch another
# plugin made before ours still runs inside ours.
def _init_with_error(init: Callable[..., None]) -> Callable[..., None]:
    """RequestOutput.__init__ taking the `error` keyword."""
    @functools.wraps(init)
    def __init__(self: RequestOutput, *args: Any, error: RequestError | None = None,
                 **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.error = error

    return __init__


def _add_keeping_error(add: Callable[..., None]) -> Callable[..., None]:
    """RequestOutput.add that keeps a merged delta's terminal error (only the last
    output carries one)."""
    @functools.wraps(add)
    def add_(self: RequestOutput, next_output: RequestOutput, aggregate: bool) -> None:
        add(self, next_output, aggregate)
        error = getattr(next_output, "error", None)
        if error is not None:
            self.error = error

    return add_


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


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


# ------------------------------------------- per-request Python paths (called from Rust)

class StockSide:
    """The embedded stock `OutputProcessor` that owns the requests vLLM's own
    per-request code must run (logprobs, pooling, streaming input, ...): they step
    through its `process_outputs`, in one batch per run of such outputs, and abort
    through its `abort_requests`. Its `lora_states` is the processor's own."""

    def __init__(self, tokenizer: Any, log_stats: bool, stream_interval: int,
                 tracing_enabled: bool, lora_states: LoRARequestStates) -> None:
        self.op = StockOutputProcessor(tokenizer, log_stats=log_stats, stream_interval=stream_interval,
                                       tracing_enabled=tracing_enabled)
        self.op.lora_states = lora_states

    def hand_over(self, req_state: RequestState) -> None:
        """Make `req_state` one of the stock processor's requests (what its
        `add_request` does after building the state)."""
        op = self.op
        op.request_states[req_state.request_id] = req_state
        if req_state.parent_req is not None:
            op.parent_requests[req_state.parent_req.request_id] = req_state.parent_req
        op.external_req_ids[req_state.external_req_id].append(req_state.request_id)

    def take_back(self, request_id: str) -> None:
        """Forget a request without an output (the core answers it)."""
        req_state = self.op.request_states.pop(request_id, None)
        if req_state is None:
            return
        ids = self.op.external_req_ids.get(req_state.external_req_id)
        if ids is not None and request_id in ids:
            ids.remove(request_id)
            if not ids:
                del self.op.external_req_ids[req_state.external_req_id]
        self._forget_parent_if_done(req_state.parent_req)

    def _forget_parent_if_done(self, parent: Any) -> None:
        if parent is not None and not any(c in self.op.request_states for c in parent.child_requests):
            self.op.parent_requests.pop(parent.request_id, None)

    def step(self, ecos: list[EngineCoreOutput], engine_core_timestamp: float | None,
             iteration_stats: IterationStats | None, weight_version: str | None
             ) -> tuple[list[Any], list[str], list[str], Exception | None]:
        """vLLM's `process_outputs` on a batch of its requests' outputs:
        (request_outputs, reqs_to_abort, ids it no longer tracks, None), or, when
        it raised, ([], [], the ids it finished before raising, the exception)."""
        states = self.op.request_states
        for eco in ecos:
            if eco.mm_cache_miss_hashes and eco.finish_reason == FinishReason.ERROR:
                _metrics.count_cache_miss()  # vllm-mmretry metrics hook (pooling misses)
        try:
            out = self.op.process_outputs(ecos, engine_core_timestamp, iteration_stats, weight_version)
        except Exception as e:  # noqa: BLE001 - handed to the core, which raises it
            return [], [], _gone(ecos, states), e
        return out.request_outputs, out.reqs_to_abort, _gone(ecos, states), None

    def abort(self, request_id: str) -> None:
        """vLLM's abort of one of its requests (its abort output included)."""
        req_state = self.op.request_states.get(request_id)
        self.op.abort_requests([request_id], internal=True)
        if req_state is not None:
            self._forget_parent_if_done(req_state.parent_req)

    def finished_stats(self, lora_states: LoRARequestStates, iteration_stats: IterationStats,
                       req_state: RequestState, finish_reason: FinishReason,
                       eco: EngineCoreOutput) -> None:
        """vLLM's per-request finished statistics (and tracing) for a request the
        core finished."""
        self.op._update_stats_from_finished(req_state, finish_reason, iteration_stats)
        if self.op.tracing_enabled:
            self.op.do_tracing(eco, req_state, iteration_stats)

    def error_output(self, req_state: RequestState, eco: EngineCoreOutput,
                     engine_core_timestamp: float | None, iteration_stats: IterationStats | None,
                     weight_version: str | None, lora_states: LoRARequestStates) -> RequestOutput:
        self.op._update_stats_from_output(req_state, eco, engine_core_timestamp, iteration_stats)
        return _error_output(req_state, eco, weight_version)


def _gone(ecos: list[EngineCoreOutput], states: dict[str, Any]) -> list[str]:
    """The ids of `ecos` the stock processor no longer tracks (it finished them)."""
    gone = []
    for eco in ecos:
        rid = getattr(eco, "request_id", None)
        if isinstance(rid, str) and rid not in states:
            gone.append(rid)
    return gone


def _end_prefill(req_state: RequestState, eco: EngineCoreOutput) -> None:
    """`process_outputs`' end of a request's prefill (its cached-token counts), after
    the iteration statistics and before the request's output, as there."""
    if not req_state.is_prefilling:
        return
    if eco.prefill_stats is not None:
        req_state.num_cached_tokens = eco.prefill_stats.num_cached_tokens
        req_state.num_cache_creation_tokens = eco.prefill_stats.num_cache_creation_tokens
    if req_state.remote_prefill_cached_tokens is not None:
        req_state.num_cached_tokens = req_state.remote_prefill_cached_tokens
    req_state.is_prefilling = False


def _error_output(req_state: RequestState, eco: EngineCoreOutput,
                  weight_version: str | None) -> RequestOutput:
    """The one terminal output of a generation request whose multimodal inputs
    were missing in the engine's cache (for n>1: of its parent); its iteration
    statistics were updated by vLLM's own code (`StockSide.error_output`)."""
    _end_prefill(req_state, eco)
    detok = req_state.detokenizer
    assert detok is not None and req_state.logprobs_processor is not None
    if eco.new_token_ids:
        if weight_version is not None:
            req_state.track_weight_version(weight_version)
        detok.update(eco.new_token_ids, False)
    delta = req_state.output_kind == RequestOutputKind.DELTA
    text = detok.get_next_output_text(True, delta)
    if delta:
        token_ids = (detok.output_token_ids[req_state.sent_tokens_offset:]
                     if req_state.stream_interval > 1 else list(eco.new_token_ids))
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
        # As stock's terminal outputs: the weight versions the tokens came from.
        weight_versions=req_state._weight_version_spans(),
    )
    return _terminal_error_output(req_state, completion, miss_error(list(eco.mm_cache_miss_hashes or ())),
                                  eco.kv_transfer_params, eco.ec_transfer_params)


def _terminal_error_output(req_state: RequestState, completion: CompletionOutput, error: RequestError,
                           kv_transfer_params: Any = None, ec_transfer_params: Any = None) -> RequestOutput:
    """The request's finished RequestOutput holding `completion` and carrying `error`
    (for n>1: the parent's answer)."""
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
        kv_transfer_params=kv_transfer_params,
        ec_transfer_params=ec_transfer_params,
    )
    out.error = error
    return out


INTERNAL_ERROR_CODE = "internal_error"
_logger = init_logger("vllm.vllm_mmretry.output_processor")


def _failed_output(req_state: RequestState, message: str) -> Any:
    """The one terminal output of a request whose step failed inside the core (a
    caught panic): finish_reason "error" and a RequestError that is not retryable.
    It carries no new tokens and no text: the request's progress in the failed step
    cannot be trusted. For n>1 it is the parent's answer (siblings are aborted)."""
    _logger.error(
        "vllm-mmretry: request %s failed inside the output processor: %s",
        req_state.request_id, message)
    error = RequestError(code=INTERNAL_ERROR_CODE, message=message, retryable=False)
    if req_state.detokenizer is None:  # pooling: vLLM's own error output
        return req_state.make_request_output(
            new_token_ids=[], pooling_output=EMPTY_CPU_TENSOR, finish_reason=FinishReason.ERROR,
            stop_reason=None, error=error)
    logprobs = req_state.logprobs_processor
    completion = CompletionOutput(
        index=req_state.request_index,
        text="",
        token_ids=[],
        cumulative_logprob=None if logprobs is None else logprobs.cumulative_logprob,
        logprobs=None,
        finish_reason=str(FinishReason.ERROR),
        stop_reason=None,
    )
    return _terminal_error_output(req_state, completion, error)


def _adopt_native(req_state: RequestState, output_token_ids: list[int], last_output_offset: int) -> Any:
    """Replay a native request's output ids into its (untouched) stock
    detokenizer, so vLLM's Python code can continue it, and return that
    detokenizer. The stock update runs token by token exactly as it would have;
    stop strings are not re-checked (none matched, or the request would have
    finished)."""
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
    return detok


# ------------------------------------------------------------ native vocabulary

_VOCABS: dict[tuple[int, int], tuple[Any, Any]] = {}
# Native vocabularies that failed their self-check (id -> what differed).
_VOCAB_CHECKS: dict[int, str | None] = {}


def shared_templates(check: SelfCheck) -> tuple[dict[str, Any], dict[str, Any]]:
    """The part of every request's output templates that no request changes,
    built once per self-check: the reference outputs' fields, with the fields
    `fast_spec` fills set in the order it sets them (so a request's template,
    this with its own values updated, keeps the field order it always had)."""
    if check.shared is None:
        ro = dict(check.ro_base)
        ro.update(request_id=None, prompt=None, prompt_token_ids=None, metrics=None,
                  lora_request=None, outputs=None, finished=False,
                  num_cached_tokens=0, num_cache_creation_tokens=0)
        co = dict(check.co_base)
        co.update(index=0, text="", token_ids=None)
        check.shared = (
            _in_instance_dict(RequestOutput, RO_PER_REQUEST + RO_FILLED, _RO_FIXED, ro),
            _in_instance_dict(CompletionOutput, CO_PER_REQUEST + CO_FILLED, _CO_FIXED, co))
    return check.shared


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


def _check_vocab(vocab: Any) -> str | None:
    """The native vocabulary's own self-check (table decode vs the tokenizers
    crate), once per vocabulary object."""
    if id(vocab) not in _VOCAB_CHECKS:
        bad = vocab.self_check(n_random=300, max_len=6, seed=0)
        _VOCAB_CHECKS[id(vocab)] = (
            None if not bad else
            f"native decode differs for {len(bad)} id sequences, e.g. {bad[0][0]!r}: "
            f"{bad[0][2]!r} != {bad[0][3]!r}")
    return _VOCAB_CHECKS[id(vocab)]


# ------------------------------------------------------------ start-up self-check

class _Mark(str):
    """A distinct value per constructor argument, to see where each one lands (a
    str, so a patched constructor computing from its arguments still runs; the
    two constructions' marks differ in length too)."""

    def __new__(cls, name: str, n: int) -> _Mark:
        return super().__new__(cls, f"<{name}{'#' * n}>")


def _construct(cls: type, params: tuple[str, ...], n: int,
               fixed: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(vars of `cls(**marks, **fixed)`, the marks), through vLLM's current constructor."""
    marks = {p: _Mark(p, n) for p in params}
    return dict(vars(cls(**marks, **fixed))), marks


# The arguments the fast path never varies: no logprobs.
_RO_FIXED: dict[str, Any] = {"prompt_logprobs": None}
_CO_FIXED: dict[str, Any] = {"cumulative_logprob": None, "logprobs": None}


def _in_instance_dict(cls: type, params: tuple[str, ...], fixed: dict[str, Any],
                      fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` written into the `__dict__` of an instance vLLM's constructor built,
    when that has the same keys in the same order; else `fields` itself.

    CPython shares such a dict's keys with the class's instances, and copying it
    (once per output) copies only the values, not the whole key table."""
    try:
        d: dict[str, Any] = vars(cls(**{p: _Mark(p, 0) for p in params}, **fixed))
    except Exception:  # noqa: BLE001 - the self-check already built one; never here
        return fields
    if list(d) != list(fields):
        return fields
    d.update(fields)
    return d


def _same(x: Any, y: Any) -> bool:
    try:
        return x is y or bool(x == y)
    except Exception:  # noqa: BLE001 - e.g. arrays: not provably the same
        return False


def _differs(what: str, a: dict[str, Any], b: dict[str, Any], marks: dict[str, Any]) -> str | None:
    """Why the native path could not build what the constructor builds, or None.

    The native path copies `a` (one construction's vars) and overwrites the
    fields in `marks` per request / per output: that is exact when the two
    constructions differ only in those fields and each holds exactly the
    argument given."""
    if list(a) != list(b):
        return f"{what} fields depend on the arguments: {sorted(set(a) ^ set(b))}"
    varying = {k for k in a if not _same(a[k], b[k])}
    if not varying <= set(marks):
        return f"{what} fields set from something other than their argument: {sorted(varying - set(marks))}"
    wrong = [p for p in marks if b.get(p) is not marks[p]]
    if wrong:
        return f"{what} fields not stored as given: {wrong}"
    return None


# Each filled argument's empty or false value (None for the rest): a field derived
# from whether an argument is set (`finished`, `finish_reason is None`) shows as a
# difference from the marks, which are all set and true.
_EMPTY_ARGS: dict[str, Any] = {
    "request_id": "", "prompt_token_ids": [], "outputs": [], "finished": False,
    "num_cached_tokens": 0, "num_cache_creation_tokens": 0, "index": 0, "text": "",
    "token_ids": [],
}


def _empty_construction(cls: type, params: tuple[str, ...],
                        fixed: dict[str, Any]) -> dict[str, Any]:
    return dict(vars(cls(**{p: _EMPTY_ARGS.get(p) for p in params}, **fixed)))


def _derived(what: str, a: dict[str, Any], empty: dict[str, Any],
             marks: dict[str, Any]) -> str | None:
    """Why the fields the native path copies from the template are not the same for
    empty arguments, or None."""
    if list(a) != list(empty):
        return f"{what} fields depend on the arguments: {sorted(set(a) ^ set(empty))}"
    derived = sorted(k for k in a if k not in marks and not _same(a[k], empty[k]))
    return f"{what} fields derived from the arguments: {derived}" if derived else None


def check_outputs() -> tuple[str | None, dict[str, Any], dict[str, Any]]:
    """Build RequestOutput and CompletionOutput twice through vLLM's constructors
    (after every plugin had its chance to patch them) and check the native path
    can build the same objects: (what differed or None, ro_base, co_base).

    Arguments the native path fills get distinct values in each construction;
    the others get the values the fast path always has (no logprobs)."""
    ro_fixed, co_fixed = _RO_FIXED, _CO_FIXED
    try:
        ro_a, _ = _construct(RequestOutput, RO_PER_REQUEST + RO_FILLED, 1, ro_fixed)
        ro_b, ro_marks = _construct(RequestOutput, RO_PER_REQUEST + RO_FILLED, 2, ro_fixed)
        co_a, _ = _construct(CompletionOutput, CO_PER_REQUEST + CO_FILLED, 1, co_fixed)
        co_b, co_marks = _construct(CompletionOutput, CO_PER_REQUEST + CO_FILLED, 2, co_fixed)
        ro_empty = _empty_construction(RequestOutput, RO_PER_REQUEST + RO_FILLED, ro_fixed)
        co_empty = _empty_construction(CompletionOutput, CO_PER_REQUEST + CO_FILLED, co_fixed)
    except Exception as e:  # noqa: BLE001 - a constructor we cannot drive
        return f"constructor failed: {type(e).__name__}: {e}", {}, {}
    why = (_differs("RequestOutput", ro_a, ro_b, ro_marks)
           or _differs("CompletionOutput", co_a, co_b, co_marks)
           or _derived("RequestOutput", ro_a, ro_empty, ro_marks)
           or _derived("CompletionOutput", co_a, co_empty, co_marks))
    # The marks are overwritten per request and per output.
    base_ro = {k: (None if isinstance(v, _Mark) else v) for k, v in ro_a.items()}
    base_co = {k: (None if isinstance(v, _Mark) else v) for k, v in co_a.items()}
    return why, base_ro, base_co


def check_engine_core_output(expected: tuple[str, ...] = ECO_STRUCT_FIELDS,
                             version: str = "0.32.0") -> str | None:
    """The field list the slot reader relies on, vs EngineCoreOutput's."""
    fields = tuple(getattr(EngineCoreOutput, "__struct_fields__", ()))
    if fields != expected:
        added = [f for f in fields if f not in expected]
        gone = [f for f in expected if f not in fields]
        return (f"EngineCoreOutput fields differ from vLLM {version}'s: "
                f"added {added}, removed {gone}" + ("" if added or gone else ", reordered"))
    return None


def unknown_engine_core_fields(expected: tuple[str, ...], eco_why: str | None) -> str | None:
    """A field added to or removed from EngineCoreOutput may change what an output
    means (0.33 added `error`): the native loop cannot prove it reads it as vLLM does,
    so vLLM's code processes every request. A reorder only turns off the slot reads."""
    fields = set(getattr(EngineCoreOutput, "__struct_fields__", ()))
    return eco_why if eco_why is not None and fields != set(expected) else None


def check_object_methods(fields: ObjectFields | None = None) -> str | None:
    """The methods the core calls on vLLM's objects, by the names it was given."""
    fields = fields or OBJECT_FIELDS
    classes = {"ParentRequest": ParentRequest, "IncrementalDetokenizer": IncrementalDetokenizer,
               "RequestOutputCollector": RequestOutputCollector, "RequestOutput": RequestOutput,
               "LoRARequestStates": LoRARequestStates, "IterationStats": IterationStats}
    missing = [f"{owner}.{getattr(fields, f)}" for owner, names in _METHOD_OWNERS for f in names
               if not hasattr(classes[owner], getattr(fields, f))]
    return f"vLLM objects lack what the core calls: {missing}" if missing else None


_STATE_ATTRS = ("is_prefilling", "num_cached_tokens", "num_cache_creation_tokens", "prompt_len",
                "sent_tokens_offset", "spec_decode_metrics", "weight_version_starts",
                "remote_prefill_cached_tokens", "lora_name", "stats")
_PARENT_ATTRS = ("child_requests", "parent_request_id")
_COLLECTOR_ATTRS = ("collector_output", "collector_ready", "collector_aggregate")


def check_request_objects(state: Any, parent: Any, queue: Any,
                          fields: ObjectFields | None = None) -> str | None:
    """The instance attributes the core reads and writes, on one request's real
    RequestState (and its ParentRequest and collector, when it has them)."""
    fields = fields or OBJECT_FIELDS
    groups = [("RequestState", state, _STATE_ATTRS), ("ParentRequest", parent, _PARENT_ATTRS),
              ("RequestOutputCollector", queue, _COLLECTOR_ATTRS)]
    missing = [f"{what}.{getattr(fields, f)}" for what, obj, names in groups if obj is not None
               for f in names if not hasattr(obj, getattr(fields, f))]
    return f"vLLM objects lack what the core reads: {missing}" if missing else None


# Plain decode outputs for `check_native_stats`: (new tokens, timestamp,
# last_token_ts, num_generation_tokens before the step).
_DECODE_CASES: tuple[tuple[list[int], float, float, int], ...] = (
    ([7, 8], 12.5, 11.25, 3), ([], 20.0, 12.5, 5), ([9], 3.0e9 + 0.1, 2.9e9 + 0.7, 0),
)


def check_native_stats(native_step: Callable[..., bool]) -> str | None:
    """vLLM's `IterationStats.update_from_output` and the core's native decode
    step on the same plain decode outputs (past prefill, no events, no NaNs):
    None when both leave every attribute of both stats objects the same."""
    for tokens, ts, last, count in _DECODE_CASES:
        eco = EngineCoreOutput(request_id="self-check", new_token_ids=list(tokens))
        ref_its, ref_req = _decode_stats_objects(last, count)
        its, req = _decode_stats_objects(last, count)
        ref_its.update_from_output(eco, ts, False, ref_req, LoRARequestStates(log_stats=True), None)
        try:
            applied = native_step(eco, ts, req, its)
        except Exception as e:  # noqa: BLE001 - names this vLLM does not have
            return f"native decode statistics failed: {type(e).__name__}: {e}"
        if not applied:
            return "native decode statistics did not take a plain decode output"
        want, got = _stats_attrs(ref_its, ref_req), _stats_attrs(its, req)
        if got != want:
            return ("native decode statistics differ from vLLM's update_from_output in "
                    f"{sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))}")
    return None


def _decode_stats_objects(last_token_ts: float, count: int) -> tuple[IterationStats, RequestStateStats]:
    its = IterationStats()
    its.iteration_timestamp = 100.0
    req = RequestStateStats(num_generation_tokens=count, arrival_time=1.5, queued_ts=2.5,
                            scheduled_ts=3.5, first_token_ts=4.5, last_token_ts=last_token_ts,
                            first_token_latency=0.25)
    return its, req


def _stats_attrs(its: IterationStats, req: RequestStateStats) -> dict[str, str]:
    """Every attribute of both objects as its repr (so types count too)."""
    attrs = {f"IterationStats.{k}": repr(v) for k, v in vars(its).items()}
    attrs.update({f"PromptTokenStats.{k}": repr(v) for k, v in vars(its.prompt_token_stats).items()})
    attrs.update({f"RequestStateStats.{k}": repr(v) for k, v in vars(req).items()})
    return attrs


class _Seen:
    """A distinct object per field, to see which fields a merge copies."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


# (next is finished, next's other fields set (else None, with cur's set instead)).
_MERGE_CASES = ((False, True), (True, True), (False, False), (True, False))


def _merge_pair(next_finished: bool, next_set: bool,
                seen: dict[str, _Seen]) -> tuple[RequestOutput, RequestOutput]:
    """A collector's undelivered output and the next one of the same request, built
    by vLLM's constructors; every field the merge may not write gets a `_Seen`."""
    def output(text: str, ids: list[int], finished: bool) -> RequestOutput:
        co = CompletionOutput(index=0, text=text, token_ids=ids, cumulative_logprob=None,
                              logprobs=None)
        return RequestOutput(request_id="self-check", prompt="p", prompt_token_ids=[1],
                             prompt_logprobs=None, outputs=[co], finished=finished)

    cur, nxt = output("ab", [1, 2], False), output("cd", [3], next_finished)
    fixed_co = {MERGE_FIELDS.index, *MERGE_FIELDS.concatenated, *MERGE_FIELDS.extended,
                *MERGE_FIELDS.refused}
    fixed_ro = {"outputs", *MERGE_FIELDS.ro_or}
    marked = (nxt, nxt.outputs[0]) if next_set else (cur, cur.outputs[0])
    for obj, fixed, kind in ((marked[0], fixed_ro, "ro"), (marked[1], fixed_co, "co")):
        for k in vars(obj):
            if k not in fixed:
                setattr(obj, k, seen.setdefault(f"{kind}.{k}", _Seen(f"{kind}.{k}")))
    return cur, nxt


def check_native_merge(native_merge: Callable[..., bool]) -> str | None:
    """vLLM's `RequestOutput.add(next, aggregate=True)` (as patched) and the core's
    merge on the same pairs of outputs: None when both leave the same fields."""
    for next_finished, next_set in _MERGE_CASES:
        seen: dict[str, _Seen] = {}
        ref, ref_next = _merge_pair(next_finished, next_set, seen)
        cur, nxt = _merge_pair(next_finished, next_set, seen)
        ref.add(ref_next, aggregate=True)
        try:
            if not native_merge(cur, nxt):
                return "the native merge did not take a plain delta output"
        except Exception as e:  # noqa: BLE001 - names this vLLM does not have
            return f"the native merge failed: {type(e).__name__}: {e}"
        for what, a, b in (("RequestOutput", ref, cur), ("CompletionOutput", ref.outputs[0], cur.outputs[0])):
            want, got = vars(a), vars(b)
            diff = sorted(k for k in want.keys() | got.keys()
                          if k != "outputs" and not _same(want.get(k), got.get(k)))
            if diff or len(ref.outputs) != len(cur.outputs):
                return f"the native merge differs from vLLM's RequestOutput.add in {what} {diff}"
    refused = _merge_pair(False, True, {})
    setattr(refused[1].outputs[0], MERGE_FIELDS.refused[0], [])
    if native_merge(*refused):
        return f"the native merge took an output with {MERGE_FIELDS.refused[0]}"
    return None


# What AsyncMPClient._ensure_output_queue_task is known to do: read
# `resources.output_socket` and `self.decoder` and start the nested
# `process_outputs_socket`, which awaits `output_socket.recv_multipart(...)` and
# calls `decoder.decode(frames)` in its loop.
_OUTPUT_TASK = "process_outputs_socket"
_OUTPUT_TASK_OUTER_NAMES = frozenset({"resources", "output_socket", "output_queue_task", "decoder"})


def _check_output_task(start: Callable[..., Any]) -> str | None:
    """Why `start` is not the output-task starter receive.py was written against."""
    code = getattr(start, "__code__", None)
    if code is None:
        return f"{start!r} is not a Python function"
    missing = _OUTPUT_TASK_OUTER_NAMES - set(code.co_names) - set(code.co_varnames)
    if missing:
        return f"{code.co_name} no longer uses {sorted(missing)}"
    tasks = [c for c in code.co_consts if getattr(c, "co_name", None) == _OUTPUT_TASK]
    if len(tasks) != 1:
        return f"{code.co_name} has no single nested {_OUTPUT_TASK}"
    task = tasks[0]
    if "output_socket" not in task.co_freevars or "recv_multipart" not in task.co_names:
        return f"{_OUTPUT_TASK} no longer reads output_socket.recv_multipart"
    if "decoder" not in task.co_freevars or "decode" not in task.co_names:
        return f"{_OUTPUT_TASK} no longer calls decoder.decode"
    return None


def _unstarted_output_socket(client: Any) -> Any:
    """The socket the client's output task will read, while that task is not started."""
    resources = getattr(client, "resources", None)
    if resources is None or resources.output_queue_task is not None:
        return None
    return resources.output_socket


# The EngineCoreOutput fields the native reader reads, by kind, with the annotation
# that kind was written for; every other field must default to None (read as nil only).
WIRE_OUTPUT_KINDS: dict[str, tuple[str, Any]] = {
    "request_id": ("str", str),
    "new_token_ids": ("int_list", list[int]),
    "finish_reason": ("opt_enum", FinishReason | None),
    "stop_reason": ("opt_int_or_str", int | str | None),
    "num_nans_in_logits": ("int", int),
}


def outputs_wire() -> OutputsWire | str:
    """The engine-output message layout of the running vLLM, checked against what
    the native reader was written for."""
    import typing

    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackDecoder

    for cls in (EngineCoreOutputs, EngineCoreOutput):
        cfg = getattr(cls, "__struct_config__", None)
        if cfg is None or not cfg.array_like or cfg.tag is not None:
            return f"{cls.__name__} is not an untagged array_like msgspec Struct"
    try:
        hints, top_hints = (typing.get_type_hints(c) for c in (EngineCoreOutput, EngineCoreOutputs))
    except Exception as e:  # noqa: BLE001 - annotations we cannot resolve
        return f"EngineCoreOutput annotations: {type(e).__name__}: {e}"
    kinds = _wire_output_kinds(hints)
    if isinstance(kinds, str):
        return kinds
    values = sorted(int(m.value) for m in FinishReason)
    if values != list(range(len(values))):
        return f"FinishReason values are not 0..{len(values) - 1}: {values}"
    top = list(EngineCoreOutputs.__struct_fields__)
    if len(EngineCoreOutputs.__struct_defaults__) != len(top) or top_hints.get("outputs") != list[EngineCoreOutput]:
        return "EngineCoreOutputs has a required field or no outputs: list[EngineCoreOutput]"
    decoders = [None if f == "outputs" else MsgpackDecoder(top_hints[f]).decode for f in top]
    fields = EngineCoreOutput.__struct_fields__
    return OutputsWire(
        outputs_cls=EngineCoreOutputs, output_cls=EngineCoreOutput, top_fields=len(top),
        outputs_at=top.index("outputs"),
        top_none_default=[d is None for d in EngineCoreOutputs.__struct_defaults__],
        output_fields=list(fields), output_kinds=kinds,
        output_required=len(fields) - len(EngineCoreOutput.__struct_defaults__),
        finish_reasons=[FinishReason(v) for v in values], field_decoders=decoders)


def _wire_output_kinds(hints: dict[str, Any]) -> list[str] | str:
    fields = EngineCoreOutput.__struct_fields__
    defaults = EngineCoreOutput.__struct_defaults__
    required = len(fields) - len(defaults)
    kinds = []
    for i, f in enumerate(fields):
        known = WIRE_OUTPUT_KINDS.get(f)
        if known is not None:
            if hints[f] != known[1]:
                return f"EngineCoreOutput.{f} is {hints[f]}, not {known[1]}"
            # The reader leaves out an int equal to 0 and a nil: their defaults must be so.
            want_default = {"int": 0, "opt_enum": None, "opt_int_or_str": None}.get(known[0])
            if i >= required and defaults[i - required] != want_default:
                return f"EngineCoreOutput.{f} defaults to {defaults[i - required]!r}"
            kinds.append(known[0])
        elif i >= required and defaults[i - required] is None:
            kinds.append("nil")
        else:
            return f"EngineCoreOutput.{f} is neither read nor None by default"
    return kinds


def check_finish_reasons() -> str | None:
    for name, code in FINISH_CODES.items():
        member = FinishReason(code) if code in FinishReason._value2member_map_ else None
        if member is None or str(member) != name:
            return f"FinishReason({code}) is {member!s}, expected {name!r}"
    return None


# --------------------------------------------------------------- serving seams

def _rendered_or_raise(result: Any) -> Any:
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    from vllm.exceptions import GenerationError

    if isinstance(result, ErrorResponse):  # the first render passed, so unexpected
        raise GenerationError(f"re-rendering for retry failed: {result.error.message}")
    return result


class _SkipMMCacheIO:
    """A pooling IO processor whose render requests bypass the P0 mm cache."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def get_request_factory_online(self, ctx: Any) -> list[Any]:
        return [{**params, "skip_mm_cache": True}
                for params in self._inner.get_request_factory_online(ctx)]


# ------------------------------------------------------------------- the adapter

class Adapter(VllmAdapter):
    """vLLM 0.32.x."""

    version = "0.32.0"
    ECO_STRUCT_FIELDS: tuple[str, ...] = ECO_STRUCT_FIELDS
    ECO_FIELDS: EcoFields = ECO_FIELDS
    MISS_CODE = MISS_CODE

    # --- output processor ---------------------------------------------------
    def self_check(self, tokenizer: Any, vocab: Any) -> SelfCheck:
        why, ro_base, co_base = check_outputs()
        eco_why = check_engine_core_output(self.ECO_STRUCT_FIELDS, self.version)
        return SelfCheck(
            outputs=(why or check_finish_reasons() or check_object_methods()
                     or unknown_engine_core_fields(self.ECO_STRUCT_FIELDS, eco_why)),
            eco_offsets=eco_why,
            detok=None if vocab is None else _check_vocab(vocab),
            ro_base=ro_base, co_base=co_base,
        )

    def new_stock_side(self, tokenizer: Any, log_stats: bool, stream_interval: int,
                       tracing_enabled: bool, lora_states: Any) -> StockSide:
        return StockSide(tokenizer, log_stats, stream_interval, tracing_enabled, lora_states)

    def core_spec(self, lora_states: Any, check: SelfCheck, stock: Any) -> CoreSpec:
        members = sorted(FinishReason, key=int)
        return CoreSpec(
            engine_core_output=EngineCoreOutput,
            request_output=RequestOutput,
            completion_output=CompletionOutput,
            collector=RequestOutputCollector,
            weight_span=WeightVersionSpan,
            event=asyncio.Event,
            finish_reasons=[m for i, m in enumerate(members) if int(m) == i],
            finish_stop=int(FinishReason.STOP),
            finish_abort=int(FinishReason.ABORT),
            finish_error=int(FinishReason.ERROR),
            eco_fields=self.ECO_FIELDS,
            output_fields=OUTPUT_FIELDS,
            object_fields=OBJECT_FIELDS,
            merge_fields=MERGE_FIELDS,
            helpers=self.core_helpers(stock),
            lora_states=lora_states,
            eco_offsets=check.eco_offsets is None,
        )

    def core_helpers(self, stock: StockSide) -> CoreHelpers:
        """The Python code the core calls for rare per-request paths (one set per
        output processor): vLLM's own, through the embedded stock processor."""
        return CoreHelpers(
            stock_step=stock.step, stock_abort=stock.abort, hand_over=stock.hand_over,
            take_back=stock.take_back, error_output=stock.error_output,
            finished_stats=stock.finished_stats, adopt_native=_adopt_native,
            failed_output=_failed_output,
        )

    def process_outputs(self, core: Any, spec: CoreSpec, engine_core_outputs: Any,
                        engine_core_timestamp: float | None, iteration_stats: Any,
                        weight_version: str | None) -> tuple[list[Any], list[Any]]:
        """One `process_outputs` step: (request_outputs, reqs_to_abort)."""
        outs: tuple[list[Any], list[Any]] = core.process(
            engine_core_outputs, engine_core_timestamp, iteration_stats, weight_version)
        return outs

    def streaming_input_collector(self) -> type:
        """The collector AsyncLLM gives a streaming-input request."""
        collector: type = RequestOutputCollector
        return collector

    def new_request_state(self, tokenizer: Any, request: Any, prompt: str | None, parent_req: Any,
                          request_index: int, queue: Any, log_stats: bool,
                          stream_interval: int) -> Any:
        return RequestState.from_new_request(
            tokenizer=tokenizer, request=request, prompt=prompt, parent_req=parent_req,
            request_index=request_index, queue=queue, log_stats=log_stats,
            stream_interval=stream_interval,
        )

    def fallback_reason(self, request: Any, state: Any, tracing_enabled: bool) -> str | None:
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
        if tracing_enabled:
            return "tracing"
        if sp.stop and not all(_is_utf8(stop) for stop in sp.stop):
            return "unencodable_stop"  # the native detokenizer holds UTF-8 text only
        if state.detokenizer is None or state.output_kind not in OUTPUT_KIND_CODE:
            return "unsupported_state"
        return None

    def request_identity(self, request: Any, state: Any) -> tuple[str, str, bool, bool]:
        """(internal id, external id, resumable, is_pooling)."""
        return (request.request_id, state.external_req_id, bool(request.resumable),
                request.sampling_params is None)

    def fast_spec(self, state: Any, request: Any, detok_reason: str | None,
                  check: SelfCheck) -> FastSpec:
        parent = state.parent_req
        detok = state.detokenizer
        assert detok is not None
        native = None
        if detok_reason is None:
            if type(detok) is FastIncrementalDetokenizer:
                sp = request.sampling_params
                native = NativeDetokSpec(
                    prompt_token_ids=request.prompt_token_ids,
                    skip_special_tokens=sp.skip_special_tokens,
                    spaces_between_special_tokens=sp.spaces_between_special_tokens,
                    stop=detok.stop,
                    include_stop_str_in_output=detok.include_stop_str_in_output,
                    min_tokens=detok.min_tokens,
                )
            else:
                detok_reason = "no_detokenize" if type(detok) is IncrementalDetokenizer else "detokenizer_class"
        ro_shared, co_shared = shared_templates(check)
        ro = dict(ro_shared)
        ro.update(
            request_id=parent.external_req_id if parent is not None else state.external_req_id,
            prompt=state.prompt, prompt_token_ids=state.prompt_token_ids, metrics=state.stats,
            lora_request=state.lora_request,
        )
        co = dict(co_shared)
        co["index"] = state.request_index
        return FastSpec(
            detokenizer=detok, native=native, detok_reason=detok_reason,
            output_kind=OUTPUT_KIND_CODE[state.output_kind],
            stream_interval=state.stream_interval, num_output_tokens=detok.num_output_tokens(),
            ro_template=ro, co_template=co, ro_shared=ro_shared, co_shared=co_shared,
        )

    def native_vocab(self, tokenizer: Any) -> tuple[Any, str | None]:
        return native_vocab(tokenizer)

    def check_request_objects(self, state: Any, parent: Any, queue: Any) -> str | None:
        return check_request_objects(state, parent, queue)

    def check_native_stats(self, native_step: Callable[..., bool]) -> str | None:
        return check_native_stats(native_step)

    def check_native_merge(self, native_merge: Callable[..., bool]) -> str | None:
        return check_native_merge(native_merge)

    def update_stock_streaming_request(self, stock: StockSide, request: Any,
                                       prompt: str | None) -> bool:
        """vLLM's own streaming-input update of one of the stock processor's
        requests; True when that finished the request."""
        stock.op.add_request(request, prompt)
        return request.request_id not in stock.op.request_states

    def processor_output(self, request_outputs: list[Any], reqs_to_abort: list[str]) -> Any:
        return OutputProcessorOutput(request_outputs=request_outputs, reqs_to_abort=reqs_to_abort)

    def new_lora_states(self, log_stats: bool) -> Any:
        return LoRARequestStates(log_stats)

    def set_admission_count(self, admission_stats: Any, live_requests: int) -> None:
        admission_stats.set_num_requests(live_requests)

    def update_scheduler_stats(self, lora_states: Any, scheduler_stats: Any) -> None:
        lora_states.update_scheduler_stats(scheduler_stats)

    def is_engine_core_request(self, obj: Any) -> bool:
        return isinstance(obj, EngineCoreRequest)

    def is_parent_request(self, obj: Any) -> bool:
        return isinstance(obj, ParentRequest)

    def ensure_request_output_error(self) -> None:
        ensure_request_output_error()

    def output_processor_patches(self, processor_cls: type) -> list[tuple[Any, str, Any]]:
        from vllm.v1.engine import async_llm, llm_engine

        return [
            (RequestOutput, "__init__", _init_with_error(RequestOutput.__init__)),
            (RequestOutput, "add", _add_keeping_error(RequestOutput.add)),
            (async_llm, "OutputProcessor", processor_cls),
            (llm_engine, "OutputProcessor", processor_cls),
        ]

    def engine_classes(self) -> tuple[type[Any], ...]:
        from vllm.v1.engine import async_llm, llm_engine

        return (async_llm.AsyncLLM, llm_engine.LLMEngine)

    def engine_output_processor(self, engine: Any) -> Any:
        return getattr(engine, "output_processor", None)

    def engine_renderer(self, engine: Any) -> Any:
        return engine.renderer

    def prometheus_stat_loggers(self, engine: Any) -> list[Any]:
        from vllm.v1.metrics.loggers import PrometheusStatLogger

        manager = getattr(engine, "logger_manager", None)
        loggers = getattr(manager, "stat_loggers", None) or []
        return [lg for lg in loggers if isinstance(lg, PrometheusStatLogger)]

    def stat_env_reads(self) -> tuple[ModuleType | None, list[str]]:
        import vllm.envs as envs

        # Read through vllm.envs.__getattr__ and os.getenv on every call: in
        # PrometheusStatLogger.record (once per engine-output message) and in
        # IterationStats.update_from_output. The engine core caches every variable
        # at its start (EngineCore.__init__: enable_envs_cache); the API server never does.
        if envs._is_envs_cache_enabled():
            return envs, []
        return envs, [name for name in STAT_ENV_READS if name in envs.environment_variables]

    def miss_error(self, hashes: list[str]) -> Any:
        return miss_error(hashes)

    # --- engine-output receive ----------------------------------------------
    def receive_seam(self) -> ReceiveSeam | str:
        from vllm.v1.engine.core_client import AsyncMPClient

        # vLLM's own starter, even where install() has already wrapped it.
        why = _check_output_task(_patching.original(AsyncMPClient, "_ensure_output_queue_task"))
        if why is not None:
            return why
        return ReceiveSeam(AsyncMPClient, "_ensure_output_queue_task", _unstarted_output_socket)

    def outputs_wire(self) -> OutputsWire | str:
        return outputs_wire()

    # --- the output handler (catchup.py) --------------------------------------
    # Source digests of the vLLM code the catch-up hooks were written against
    # (vllm_adapter/output_handler.py: `digest_targets`, `source_digest`).
    HANDLER_DIGESTS: ClassVar[dict[str, str]] = {
        "AsyncLLM._run_output_handler": "5111696248ec17f0",
        "AsyncMPClient.get_output_async": "17302acc314b2300",
        "StatLoggerManager.record": "fdb104e1ff79e573",
        "PerEngineStatLoggerAdapter.record": "b9b767450d04452c",
        "LoggingStatLogger.record": "0f2b51aa75e8d3da",
        "LoggingStatLogger._track_iteration_stats": "10b9bfeb4cd25e11",
        "AggregatedLoggingStatLogger.record": "865d1fe0793ca4f0",
        "PrometheusStatLogger.record": "a506cbde79285412",
        "IterationStats": "4caffb1b08908232",
        "PromptTokenStats": "5598f78519189eb1",
        "BaseRenderer.stat_mm_cache": "ef5c52ca1179e880",
        "CachingMetrics.observe": "b8f2aab2a9da3e6d",
    }

    def output_handler_seam(self) -> HandlerSeam | str:
        from vllm.v1.engine.async_llm import AsyncLLM

        from vllm_mmretry.vllm_adapter import output_handler

        # vLLM's own handler, even where install() has already wrapped it.
        vllm_start = _patching.original(AsyncLLM, "_run_output_handler")
        targets = {**output_handler.digest_targets(), "AsyncLLM._run_output_handler": vllm_start}
        changed = output_handler.changed_sources(self.HANDLER_DIGESTS, targets)
        if changed:
            return f"vLLM's {', '.join(changed)} differ from what the catch-up hooks were written against"

        def start(engine: Any) -> Any:
            return output_handler.start_with_catch_up(engine, vllm_start)

        return HandlerSeam(AsyncLLM, "_run_output_handler", output_handler.handler_why_not, start,
                           started=lambda engine: engine.output_handler is not None)

    # --- fault switch -------------------------------------------------------
    def lru_receiver_cache(self) -> tuple[type[Any], type[Exception]]:
        """The engine core's P1 receiver cache class for `lru` and the error it raises
        on a miss (vLLM turns it into `EngineCoreOutput.mm_cache_miss_hashes`)."""
        from vllm.multimodal.cache.base import MultiModalCacheMissError
        from vllm.multimodal.cache.lru import LruKeyReplicatedReceiverCache

        return LruKeyReplicatedReceiverCache, MultiModalCacheMissError

    def receiver_entries(self, cache: Any) -> MutableMapping[str, Any]:
        entries: MutableMapping[str, Any] = cache._cache  # LruKeyReplicatedReceiverCache's LRU
        return entries

    # --- doctor
    @staticmethod
    def serve_cli_args() -> ModuleType:
        """The module with `vllm serve`'s parser and its checks of parsed arguments."""
        from vllm.entrypoints.launchers import cli_args

        module: ModuleType = cli_args
        return module

    def serve_parser(self) -> argparse.ArgumentParser:
        """`vllm serve`'s own argument parser."""
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser: argparse.ArgumentParser = self.serve_cli_args().make_arg_parser(
            FlexibleArgumentParser(prog="vllm serve"))
        return parser

    def parse_serve_args(self, argv: list[str]) -> argparse.Namespace:
        """The arguments `vllm serve ARGV` runs with, after vLLM's own checks of them."""
        args = self.serve_parser().parse_args(argv)
        if getattr(args, "model_tag", None):  # `vllm serve MODEL` sets model_tag
            args.model = args.model_tag
        self.serve_cli_args().validate_parsed_serve_args(args)
        return args

    @staticmethod
    def serve_front_end(args: argparse.Namespace) -> str | None:
        """Which of vLLM's other front ends `vllm serve` with `args` puts in front of the
        engine instead of its Python API server ("grpc", "rust"), else None."""
        from vllm import envs

        if getattr(args, "grpc", False):
            return "grpc"
        if envs.VLLM_USE_RUST_FRONTEND and envs.VLLM_RUST_FRONTEND_PATH:
            return "rust"
        return None

    @staticmethod
    def serve_api_servers(args: argparse.Namespace) -> tuple[int, argparse.Namespace]:
        """How many API servers share one engine when `vllm serve` runs with `args`,
        and the arguments one of them runs with (a multi-port supervisor's child's).
        vLLM decides it inside `ServeSubcommand.cmd` (the load-balancing modes, the
        Rust front end, elastic EP), so that runs, with the launchers it picks from
        replaced by a stop that records the choice; vLLM's own errors (two
        load-balancing modes, ...) are raised as vLLM raises them."""
        import copy

        from vllm.entrypoints.cli import serve
        from vllm.entrypoints.launchers import dp_supervisor

        if getattr(args, "grpc", False):
            return 1, args  # one gRPC server process in front of the engine
        chosen: dict[str, Any] = {}

        class _Chosen(Exception):
            pass

        def stop(name: str) -> Callable[..., Any]:
            def launcher(launched: argparse.Namespace, *_: Any, **__: Any) -> Any:
                chosen.update(launcher=name, args=launched)
                raise _Chosen
            return launcher

        launchers = ("run_server", "run_headless", "run_multi_api_server", "run_dp_supervisor")
        saved = {name: getattr(serve, name) for name in launchers}
        try:
            for name in launchers:
                setattr(serve, name, stop(name))
            serve.ServeSubcommand.cmd(copy.copy(args))
        except _Chosen:
            pass
        finally:
            for name, value in saved.items():
                setattr(serve, name, value)
        launched: argparse.Namespace = chosen["args"]
        if chosen["launcher"] == "run_headless":
            return 0, launched
        if chosen["launcher"] == "run_dp_supervisor":  # one API server per local rank
            dp_supervisor.validate_multi_port_external_lb_args(launched)
            return 1, dp_supervisor._build_vllm_dp_server_args(launched, 0)
        if chosen["launcher"] == "run_server":
            return 1, launched
        return int(launched.api_server_count), launched

    @staticmethod
    def serve_tokenizer(target: str, args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
        """Where and how `vllm serve` loads its tokenizer (ModelConfig's defaults: the
        tokenizer's revision is the model's unless given)."""
        return args.tokenizer or target, {
            "tokenizer_mode": args.tokenizer_mode or "auto",
            "trust_remote_code": bool(args.trust_remote_code),
            "revision": args.tokenizer_revision or args.revision,
        }

    def serve_cache_type(self, args: argparse.Namespace, api_servers: int) -> str | None:
        """The multimodal cache type `vllm serve` with `args` picks in an API server."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext

        engine_args = AsyncEngineArgs.from_cli_args(args)
        engine_args._api_process_count = max(api_servers, 1)
        engine_args._api_process_rank = -1 if api_servers > 1 else 0
        config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        module, name = self.mm_cache_type_lookup()
        cache_type: str | None = getattr(module, name)(config)
        return cache_type

    def load_tokenizer(self, source: str, options: dict[str, Any]) -> Any:
        from vllm.tokenizers import get_tokenizer

        return get_tokenizer(source, **options)

    def remove_request_output_error(self) -> list[str]:
        """Drop the `RequestOutput.error` class default `ensure_request_output_error` added."""
        if "error" in RequestOutput.__dict__ and RequestOutput.__dict__["error"] is None:
            del RequestOutput.error
            return ["RequestOutput.error"]
        return []

    def mm_cache_type_lookup(self) -> tuple[ModuleType, str]:
        """(module, function name) of the lookup every multimodal cache factory calls to
        pick `lru` / `shm` / `processor_only` / None for this process's config."""
        from vllm.multimodal.cache import factories

        return factories, "_get_cache_type"

    # --- signatures checked at start-up -------------------------------------
    # (printed by tools/seam_signatures.py; the same on 0.33.0)
    SIGNATURES: ClassVar[dict[str, str]] = {
        'RequestOutput.__init__':
            '(self, request_id, prompt, prompt_token_ids, prompt_logprobs, outputs, finished, '
            'metrics=..., lora_request=..., encoder_prompt=..., encoder_prompt_token_ids=..., '
            'num_cached_tokens=..., num_cache_creation_tokens=..., *, '
            'prompt_token_id_logprobs=..., kv_transfer_params=..., ec_transfer_params=..., '
            '**kwargs)',
        'RequestOutput.add':
            '(self, next_output, aggregate)',
        'vllm.v1.engine.async_llm.OutputProcessor':
            '(tokenizer, *, log_stats, stream_interval=..., tracing_enabled=..., '
            'admission_stats=...)',
        'vllm.v1.engine.llm_engine.OutputProcessor':
            '(tokenizer, *, log_stats, stream_interval=..., tracing_enabled=..., '
            'admission_stats=...)',
        'AsyncLLM.__init__':
            '(self, vllm_config, executor_class, log_stats, usage_context=..., mm_registry=..., '
            'log_requests=..., start_engine_loop=..., stat_loggers=..., '
            'aggregate_engine_logging=..., client_addresses=..., client_count=..., '
            'client_index=..., profiler=...)',
        'LLMEngine.__init__':
            '(self, vllm_config, executor_class, log_stats, aggregate_engine_logging=..., '
            'usage_context=..., stat_loggers=..., mm_registry=..., multiprocess_mode=...)',
        'AsyncLLM._run_output_handler':
            '(self)',
        'vllm.v1.engine.async_llm.IterationStats':
            '()',
        'AsyncMPClient._ensure_output_queue_task':
            '(self)',
        'AsyncLLM.generate':
            '(self, prompt, sampling_params, request_id, *, prompt_text=..., lora_request=..., '
            'tokenization_kwargs=..., trace_headers=..., priority=..., data_parallel_rank=..., '
            'session_id=..., kv_hints=..., reasoning_ended=..., reasoning_parser_kwargs=...)',
        'OpenAIServingChat.create_chat_completion':
            '(self, request, raw_request=...)',
        'OpenAIServingCompletion.create_completion':
            '(self, request, raw_request=...)',
        'PoolingBaseServing.__call__':
            '(self, request, raw_request=...)',
        'vllm.entrypoints.serve.exception_handling.handlers.vllm_error.generation_error_handler':
            '(req, exc)',
        'vllm.entrypoints.openai.responses.api_router._convert_stream_to_sse_events':
            '(generator)',
        'vllm.entrypoints.anthropic.api_router.create_error_response':
            '(message, err_type=..., status_code=..., param=...)',
        'vllm.entrypoints.anthropic.api_router.translate_error_response':
            '(response)',
        'LruKeyReplicatedReceiverCache.get_and_update_item':
            '(self, mm_item, mm_hash)',
        'vllm.multimodal.cache.factories._get_cache_type':
            '(vllm_config)',
        'OutputProcessor':
            '(tokenizer, *, log_stats, stream_interval=..., tracing_enabled=..., '
            'admission_stats=...)',
        'OutputProcessor.process_outputs':
            '(self, engine_core_outputs, engine_core_timestamp=..., iteration_stats=..., '
            'weight_version=...)',
        'OutputProcessor.abort_requests':
            '(self, request_ids, internal)',
        'OutputProcessor.add_request':
            '(self, request, prompt, parent_req=..., request_index=..., queue=...)',
        'OutputProcessor._update_stats_from_output':
            '(self, req_state, engine_core_output, engine_core_timestamp, iteration_stats)',
        'OutputProcessor._update_stats_from_finished':
            '(self, req_state, finish_reason, iteration_stats)',
        'OutputProcessor.do_tracing':
            '(self, engine_core_output, req_state, iteration_stats)',
        'OnlineRenderer.render_chat':
            '(self, request, *, skip_mm_cache=...)',
        'OnlineRenderer.render_completion':
            '(self, request, *, skip_mm_cache=...)',
        'PoolingBaseServing.get_io_processor':
            '(self, request)',
        'PoolingBaseServing._init_ctx':
            '(self, io_processor, request, raw_request=...)',
        'PoolingBaseServing._preprocessing':
            '(self, io_processor, ctx)',
        'PoolingBaseServing._prepare_generators':
            '(self, ctx)',
        'PoolingBaseServing._collect_batch':
            '(self, ctx)',
        'PoolingBaseServing._postprocessing':
            '(self, io_processor, ctx)',
    }

    def called_functions(self) -> dict[str, Any]:
        from vllm.entrypoints.pooling.base.serving import PoolingBaseServing
        from vllm.renderers.online_renderer import OnlineRenderer

        op, pooling = StockOutputProcessor, PoolingBaseServing
        return {
            "OutputProcessor": op,
            "OutputProcessor.process_outputs": op.process_outputs,
            "OutputProcessor.abort_requests": op.abort_requests,
            "OutputProcessor.add_request": op.add_request,
            "OutputProcessor._update_stats_from_output": op._update_stats_from_output,
            "OutputProcessor._update_stats_from_finished": op._update_stats_from_finished,
            "OutputProcessor.do_tracing": op.do_tracing,
            "OnlineRenderer.render_chat": OnlineRenderer.render_chat,
            "OnlineRenderer.render_completion": OnlineRenderer.render_completion,
            "PoolingBaseServing.get_io_processor": pooling.get_io_processor,
            "PoolingBaseServing._init_ctx": pooling._init_ctx,
            "PoolingBaseServing._preprocessing": pooling._preprocessing,
            "PoolingBaseServing._prepare_generators": pooling._prepare_generators,
            "PoolingBaseServing._collect_batch": pooling._collect_batch,
            "PoolingBaseServing._postprocessing": pooling._postprocessing,  # made async per instance
        }

    # --- serving-layer retry (retry.py) -------------------------------------
    def retry_seams(self) -> RetrySeams:
        from vllm.entrypoints.anthropic import api_router as anthropic_router
        from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
        from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
        from vllm.entrypoints.pooling.base.serving import PoolingBaseServing
        from vllm.entrypoints.pooling.embed.serving import ServingEmbedding
        from vllm.entrypoints.serve.exception_handling.handlers import vllm_error
        from vllm.v1.engine.async_llm import AsyncLLM

        return RetrySeams(OpenAIServingChat, OpenAIServingCompletion, PoolingBaseServing,
                          AsyncLLM, vllm_error, pooling_retried=(ServingEmbedding,),
                          self_answering_router=anthropic_router)

    @staticmethod
    def finished_error(output: Any) -> OutputError | None:
        # RequestOutput (its `error` added at install on 0.32) and PoolingRequestOutput.
        error = getattr(output, "error", None)
        if error is None or not output.finished:
            return None
        return OutputError(error.code, error.message, error.retryable)

    @staticmethod
    def retrying_routes() -> tuple[str, ...]:
        # OpenAI chat and completions, Anthropic messages and Cohere chat (both call
        # create_chat_completion), embeddings and Cohere embed (the pooling entry).
        return ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/cohere/v2/chat",
                "/v1/embeddings", "/v2/embed")

    @staticmethod
    def retry_applies(request: Any) -> bool:
        return not request.use_beam_search  # Chat/CompletionRequest fields

    @staticmethod
    def request_streams(request: Any) -> bool:
        return bool(request.stream)

    def read_fields(self) -> dict[str, tuple[Any, tuple[str, ...]]]:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.outputs import PoolingRequestOutput

        endpoint_request = ("stream", "use_beam_search")
        return {
            "ChatCompletionRequest": (ChatCompletionRequest, endpoint_request),
            "CompletionRequest": (CompletionRequest, endpoint_request),
            "RequestError": (RequestError, ("code", "message", "retryable")),
            "RequestOutput": (RequestOutput, ("finished",)),
            "PoolingRequestOutput": (PoolingRequestOutput, ("finished", "error")),
        }

    # AsyncLLM.generate(prompt, sampling_params, request_id, *, ...)
    @staticmethod
    def generate_request_id(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        request_id: str | None = args[2] if len(args) > 2 else kwargs.get("request_id")
        return request_id

    @staticmethod
    def generate_with_prompt(args: tuple[Any, ...], kwargs: dict[str, Any],
                             prompt: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The same generate() call for another rendering of the prompt."""
        if args:
            return (prompt, *args[1:]), kwargs
        return args, {**kwargs, "prompt": prompt}

    @staticmethod
    def retryable_request_error() -> type[Exception]:
        """vLLM's exception for a transient request failure (HTTP 503)."""
        from vllm.exceptions import RetryableRequestError

        error: type[Exception] = RetryableRequestError
        return error

    @staticmethod
    async def render_chat(serving: Any, request: Any, skip_mm_cache: bool) -> list[Any]:
        """Engine inputs of a chat request, as OpenAIServingChat renders them."""
        result = await serving.online_renderer.render_chat(request, skip_mm_cache=skip_mm_cache)
        engine_inputs: list[Any] = _rendered_or_raise(result)[1]
        return engine_inputs

    @staticmethod
    async def render_completion(serving: Any, request: Any, skip_mm_cache: bool) -> list[Any]:
        """Engine inputs of a completion request (one per prompt)."""
        result = await serving.online_renderer.render_completion(
            request, skip_mm_cache=skip_mm_cache)
        engine_inputs: list[Any] = _rendered_or_raise(result)
        return engine_inputs

    @staticmethod
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

    @staticmethod
    def pooling_request_id(attempt: PoolingAttempt) -> str:
        request_id: str = attempt.ctx.request_id
        return request_id

    @staticmethod
    def wrap_pooling_results(attempt: PoolingAttempt,
                             wrap: Callable[[PoolingResults], PoolingResults]) -> None:
        """Interpose on the merged (index, PoolingRequestOutput) stream."""
        attempt.ctx.result_generator = wrap(attempt.ctx.result_generator)

    @staticmethod
    async def pooling_close(attempt: PoolingAttempt) -> None:
        """Stop the attempt's engine requests (the merge aborts those still running)."""
        gen = attempt.ctx.result_generator
        if gen is not None:
            await gen.aclose()

    @staticmethod
    async def pooling_finish(serving: Any, attempt: PoolingAttempt) -> Any:
        """The rest of PoolingBaseServing.__call__: collect (the one place that maps a
        pooling error to GenerationError / RetryableRequestError) and respond."""
        await serving._collect_batch(attempt.ctx)
        return await serving._postprocessing_async(attempt.io_processor, attempt.ctx)

    @staticmethod
    def responses_sse_writer() -> tuple[ModuleType, str]:
        """(module, name) of the function that turns the Responses event stream into SSE.

        vLLM 0.32's Responses stream answers a GenerationError by validating vLLM's error
        JSON as a stream event, which fails: the stream is cut without an error event."""
        from vllm.entrypoints.openai.responses import api_router

        return api_router, "_convert_stream_to_sse_events"

    @staticmethod
    def error_body(exc: Exception) -> dict[str, Any]:
        """vLLM's usual error body for `exc` ({"error": {message, type, code, param}})."""
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

        body: dict[str, Any] = create_error_response(exc).model_dump()
        return body

    @staticmethod
    def generation_error() -> type[Exception]:
        from vllm.exceptions import GenerationError

        error: type[Exception] = GenerationError
        return error

    @staticmethod
    def vllm_error() -> type[Exception]:
        from vllm.exceptions import VLLMError

        error: type[Exception] = VLLMError
        return error
