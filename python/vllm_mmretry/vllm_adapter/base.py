"""The interface every vLLM version module provides, and the typed spec the Rust
core is built from. Nothing here imports vLLM: a version module fills it in.

A new version module (`v0_NN.py`) defines `class Adapter(VllmAdapter)` (usually a
subclass of the previous version's `Adapter`, overriding only what changed) and
is listed in `vllm_adapter.VERSION_MODULES`."""

from __future__ import annotations

import abc
import argparse
from collections.abc import AsyncGenerator, Callable, MutableMapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, ClassVar

# ------------------------------------------------------------ the Rust boundary


@dataclass(frozen=True)
class EcoFields:
    """vLLM's attribute name of each `EngineCoreOutput` field the core reads
    (`rust/src/eco.rs` declares the same roles once, in `eco_fields!`)."""

    request_id: str
    new_token_ids: str
    new_logprobs: str
    new_prompt_logprobs_tensors: str
    pooling_output: str
    finish_reason: str
    stop_reason: str
    kv_transfer_params: str
    ec_transfer_params: str
    prefill_stats: str
    routed_experts: str
    mm_cache_miss_hashes: str
    new_sampling_mask: str
    spec_decode_metrics: str
    prompt_token_id_logprobs: str
    events: str
    num_nans_in_logits: str
    # Fields a release added that vLLM's `IterationStats.update_from_output` reads:
    # the native statistics count an output only when they are all None.
    decode_none: tuple[str, ...] = ()


@dataclass(frozen=True)
class OutputFields:
    """vLLM's attribute names of the output fields the native path fills per
    output (the same fields `RO_FILLED` / `CO_FILLED` name for the self-check)."""

    # RequestOutput
    outputs: str
    finished: str
    kv_transfer_params: str
    ec_transfer_params: str
    num_cached_tokens: str
    num_cache_creation_tokens: str
    error: str
    # CompletionOutput
    text: str
    token_ids: str
    finish_reason: str
    stop_reason: str
    spec_decode_metrics: str
    weight_versions: str


@dataclass(frozen=True)
class ObjectFields:
    """vLLM's names of the attributes and methods of its per-request objects the
    core reads, writes or calls (checked by the adapter's self-check)."""

    # RequestState (num_cached_tokens and num_cache_creation_tokens: PrefillStats too)
    is_prefilling: str
    num_cached_tokens: str
    num_cache_creation_tokens: str
    prompt_len: str
    sent_tokens_offset: str
    spec_decode_metrics: str
    weight_version_starts: str
    remote_prefill_cached_tokens: str
    lora_name: str
    stats: str
    # ParentRequest
    child_requests: str
    parent_request_id: str
    get_outputs: str
    # IncrementalDetokenizer
    detok_update: str
    detok_num_output_tokens: str
    detok_output_token_ids: str
    detok_get_next_output_text: str
    # RequestOutputCollector, RequestOutput
    collector_put: str
    collector_output: str
    collector_ready: str
    collector_aggregate: str
    output_add: str
    # LoRARequestStates, IterationStats
    request_finished: str
    update_from_output: str
    # RequestStateStats, IterationStats: what a native decode step writes
    # (`check_native_stats` compares it with vLLM's update_from_output)
    stats_num_generation_tokens: str
    stats_last_token_ts: str
    iteration_num_generation_tokens: str
    iteration_inter_token_latencies: str
    # the renderer and P0's multimodal processor cache
    mm_processor_cache: str
    invalidate: str


@dataclass(frozen=True)
class MergeFields:
    """How vLLM's `RequestOutput.add(next, aggregate=True)` merges the one
    completion of the same index, as the core's native collector merge does it
    (`rust/src/core/merge.rs`; `check_native_merge` compares it with vLLM's add)."""

    index: str  # CompletionOutput: must be equal
    concatenated: tuple[str, ...]  # completion.f += next.f
    extended: tuple[str, ...]  # completion.f.extend(next.f)
    refused: tuple[str, ...]  # next.f not None: left to vLLM's add
    kept_unless_none: tuple[str, ...]  # if next.f is not None: completion.f = next.f
    replaced: tuple[str, ...]  # completion.f = next.f
    ro_or: tuple[str, ...]  # RequestOutput: self.f |= next.f
    ro_replaced: tuple[str, ...]  # RequestOutput: self.f = next.f
    ro_kept_unless_none: tuple[str, ...]  # RequestOutput: kept unless next.f is None


@dataclass(frozen=True)
class CoreHelpers:
    """vLLM-version Python code the core calls for rare per-request paths. The
    `stock_*`, `hand_over` and `take_back` helpers drive the embedded stock
    OutputProcessor that owns the requests vLLM's own per-request code runs."""

    stock_step: Callable[..., Any]  # (ecos, ts, stats, weight_version) -> (outs, aborts, gone ids, error)
    stock_abort: Callable[..., Any]  # (request_id): vLLM's abort, its abort output included
    hand_over: Callable[..., Any]  # (state): the stock processor takes the request over
    take_back: Callable[..., Any]  # (request_id): the stock processor forgets it, no output
    error_output: Callable[..., Any]  # (state, eco, ts, stats, weight_version, lora_states)
    finished_stats: Callable[..., Any]  # (lora_states, stats, state, finish_reason, eco)
    adopt_native: Callable[..., Any]  # (state, output_token_ids, last_output_text_offset) -> detokenizer
    failed_output: Callable[..., Any]  # (state, message) -> terminal error output


@dataclass(frozen=True)
class CoreSpec:
    """Everything `_core.OutputCore` needs to know about the running vLLM,
    extracted field by field (by name) on the Rust side."""

    engine_core_output: type
    request_output: type
    completion_output: type
    collector: type  # RequestOutputCollector
    weight_span: type  # WeightVersionSpan
    event: type  # asyncio.Event (the collector's `ready`)
    # FinishReason members indexed by their wire code, and the codes the core acts on.
    finish_reasons: list[Any]
    finish_stop: int
    finish_abort: int
    finish_error: int
    eco_fields: EcoFields
    output_fields: OutputFields
    object_fields: ObjectFields
    merge_fields: MergeFields
    helpers: CoreHelpers
    lora_states: Any
    # Self-check results: False turns the part off (getattr reads / vLLM's outputs).
    eco_offsets: bool = True


@dataclass(frozen=True)
class NativeDetokSpec:
    """A request's detokenization parameters, for the native detokenizer."""

    prompt_token_ids: list[int]
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    stop: list[str] | None
    include_stop_str_in_output: bool
    min_tokens: int


@dataclass(frozen=True)
class FastSpec:
    """How the core runs one request on the fast path."""

    detokenizer: Any  # vLLM's IncrementalDetokenizer of the request
    native: NativeDetokSpec | None
    detok_reason: str | None  # why not native (None: native allowed)
    output_kind: int  # 0 cumulative, 1 delta, 2 final only
    stream_interval: int
    num_output_tokens: int
    # `vars()` of a RequestOutput / CompletionOutput as vLLM's constructors build
    # them for this request; the core copies and fills them per output.
    ro_template: dict[str, Any]
    co_template: dict[str, Any]
    # The templates' request-independent part, the same dicts for every request
    # (None: not shared). The core copies these, with the request's own values
    # set over them, so big batches copy one dict that stays in cache.
    ro_shared: dict[str, Any] | None = None
    co_shared: dict[str, Any] | None = None


@dataclass(frozen=True)
class NewRequest:
    """A request the core starts tracking (`_core.OutputCore.add`)."""

    request_id: str
    external_req_id: str
    state: Any  # vLLM's RequestState
    parent: Any | None  # vLLM's ParentRequest (n > 1)
    queue: Any | None  # the request's RequestOutputCollector (AsyncLLM)
    fast: FastSpec | None  # None: vLLM's per-request step runs it, for fallback_reason
    fallback_reason: str | None
    streaming: bool  # streaming input (the request can be resumed)
    is_pooling: bool


# Output fields the native path fills per output; everything else in a template
# comes from vLLM's constructors unchanged (checked at start-up).
RO_FILLED = ("outputs", "finished", "kv_transfer_params", "ec_transfer_params",
             "num_cached_tokens", "num_cache_creation_tokens")
CO_FILLED = ("text", "token_ids", "finish_reason", "stop_reason", "spec_decode_metrics",
             "weight_versions")


@dataclass
class SelfCheck:
    """Start-up comparison of the native path with the running vLLM. Each field
    is None when that native part may run, else what differed."""

    outputs: str | None = None  # native RequestOutput / CompletionOutput building
    eco_offsets: str | None = None  # EngineCoreOutput slot reads
    detok: str | None = None  # native detokenizer on this tokenizer
    stats: str | None = None  # native decode-step statistics (checked on the core)
    merge: str | None = None  # native collector merges (checked on the core)
    # `vars()` of reference outputs built by vLLM's constructors (templates' base).
    ro_base: dict[str, Any] = field(default_factory=dict)
    co_base: dict[str, Any] = field(default_factory=dict)
    # The templates' request-independent part, built by the adapter on first use.
    shared: tuple[dict[str, Any], dict[str, Any]] | None = None

    def failures(self) -> dict[str, str]:
        return {part: why for part, why in (("outputs", self.outputs),
                                            ("eco_offsets", self.eco_offsets),
                                            ("detok", self.detok),
                                            ("stats", self.stats),
                                            ("merge", self.merge)) if why is not None}


# ------------------------------------------------------------ serving seams


@dataclass(frozen=True)
class RetrySeams:
    """The classes and attribute names retry.py wraps."""

    chat_serving: type[Any]  # OpenAIServingChat; entry: create_chat_completion
    completion_serving: type[Any]  # OpenAIServingCompletion; entry: create_completion
    pooling_serving: type[Any]  # PoolingBaseServing; entry: __call__ (embeddings, /v2/embed)
    engine_client: type[Any]  # AsyncLLM; generate()
    error_handlers: Any  # module whose generation_error_handler answers GenerationError
    chat_entry: str = "create_chat_completion"
    completion_entry: str = "create_completion"
    pooling_entry: str = "__call__"
    generate: str = "generate"
    error_handler: str = "generation_error_handler"
    # The pooling servings whose calls retry (embeddings, /v2/embed); the others that
    # share the entry (score, rerank, classify, /pooling) keep vLLM's error handling.
    pooling_retried: tuple[type[Any], ...] = ()
    # The module whose routes answer errors themselves (Anthropic /v1/messages): an
    # exception becomes `error_response(exc)`, sent as `translate_error(that)`.
    self_answering_router: Any = None
    router_error_response: str = "create_error_response"
    router_translate_error: str = "translate_error_response"


@dataclass(frozen=True)
class OutputError:
    """The structured error of a finished engine output, as retry.py reads it."""

    code: str
    message: str
    retryable: bool


@dataclass(frozen=True)
class ReceiveSeam:
    """Where the async engine client reads engine outputs (receive.py).

    `owner.method(client)` starts the client's one output task; before it runs,
    `output_socket(client)` is the zmq.asyncio socket that task will read with
    `await socket.recv_multipart(copy=False)` (None when the task already runs)."""

    owner: type[Any]  # AsyncMPClient
    method: str  # _ensure_output_queue_task
    output_socket: Callable[[Any], Any]
    # The client attribute holding the decoder the task takes when it starts.
    decoder: str = "decoder"


@dataclass(frozen=True)
class HandlerSeam:
    """Where AsyncLLM starts its output handler (catchup.py).

    `owner.method(engine)` starts the engine's one output handler; `why_not(engine)`
    says why that engine's handler must be vLLM's own (None: it need not be), and
    `start(engine)` starts the adapter's handler, which records statistics once per
    catch-up, and returns what it counts with (`records`, `messages`)."""

    owner: type[Any]  # AsyncLLM
    method: str  # _run_output_handler
    why_not: Callable[[Any], str | None]
    start: Callable[[Any], Any]
    started: Callable[[Any], bool]  # the engine's handler already runs


@dataclass(frozen=True)
class OutputsWire:
    """What `_core.OutputsReader` needs to read this vLLM's engine-output messages
    (rust/src/wire.rs): the two msgspec classes, where `outputs` sits among the
    top-level fields, what each EngineCoreOutput field may hold, FinishReason
    members by value, and vLLM's own decoder for every other top-level field."""

    outputs_cls: type[Any]  # EngineCoreOutputs
    output_cls: type[Any]  # EngineCoreOutput
    top_fields: int
    outputs_at: int
    top_none_default: list[bool]
    output_fields: list[str]
    output_kinds: list[str]  # str, int_list, opt_enum, opt_int_or_str, int, nil
    output_required: int
    finish_reasons: list[Any]
    field_decoders: list[Callable[[bytes], Any] | None]


@dataclass
class PoolingAttempt:
    """One submission of a pooling request, not yet collected."""

    io_processor: Any
    ctx: Any  # the serving layer's per-request context (PoolingServeContext)


# The merged (prompt index, PoolingRequestOutput) stream of a pooling attempt.
PoolingResults = AsyncGenerator[tuple[int, Any], None]


class VllmAdapter(abc.ABC):
    """What the rest of the package needs from one vLLM version.

    Output processor (output_processor.py): `core_spec`, `self_check`,
    `new_request_state`, `fallback_reason`, `fast_spec`, `request_identity`,
    `native_vocab`, `new_stock_side`, `check_native_stats`, `update_stock_streaming_request`,
    `processor_output`,
    `new_lora_states`, `update_scheduler_stats`, `set_admission_count`, `is_engine_core_request`,
    `is_parent_request`, `output_processor_patches`, `process_outputs`,
    `streaming_input_collector`, `engine_classes`, `engine_output_processor`,
    `engine_renderer`, `ensure_request_output_error`, `miss_error`.
    Plugin (plugin.py): `remove_request_output_error`.
    Serving retry (retry.py): `retry_seams`, the generate-call, render, pooling and
    error helpers.
    Fault switch (faults.py): `lru_receiver_cache`, `receiver_entries`,
    `mm_cache_type_lookup`.
    Doctor (doctor.py): `serve_parser`, `serve_cache_type`, `load_tokenizer`.
    Engine-output receive (receive.py): `receive_seam`.
    """

    version: str = ""
    # The signature (`_patching.signature_of`) of every vLLM function this adapter's
    # patches replace (by patch label) or that it calls with arguments it builds (by
    # `called_functions` label), as written against; `tools/seam_signatures.py`
    # prints them for the running vLLM. A difference at start-up leaves vLLM unpatched.
    SIGNATURES: ClassVar[dict[str, str]] = {}

    def called_functions(self) -> dict[str, Any]:
        """label -> each vLLM function this adapter calls with arguments it builds."""
        return {}

    # --- output processor
    @abc.abstractmethod
    def new_stock_side(self, tokenizer: Any, log_stats: bool, stream_interval: int,
                       tracing_enabled: bool, lora_states: Any) -> Any:
        """The embedded stock OutputProcessor (with its helpers) for one processor."""

    @abc.abstractmethod
    def core_spec(self, lora_states: Any, check: SelfCheck, stock: Any) -> CoreSpec: ...

    @abc.abstractmethod
    def self_check(self, tokenizer: Any, vocab: Any) -> SelfCheck: ...

    @abc.abstractmethod
    def new_request_state(self, tokenizer: Any, request: Any, prompt: str | None, parent_req: Any,
                          request_index: int, queue: Any, log_stats: bool,
                          stream_interval: int) -> Any: ...

    @abc.abstractmethod
    def fallback_reason(self, request: Any, state: Any, tracing_enabled: bool) -> str | None: ...

    @abc.abstractmethod
    def fast_spec(self, state: Any, request: Any, detok_reason: str | None,
                  check: SelfCheck) -> FastSpec: ...

    @abc.abstractmethod
    def request_identity(self, request: Any, state: Any) -> tuple[str, str, bool, bool]:
        """(internal id, external id, resumable, is_pooling)."""

    @abc.abstractmethod
    def native_vocab(self, tokenizer: Any) -> tuple[Any, str | None]: ...

    @abc.abstractmethod
    def check_request_objects(self, state: Any, parent: Any, queue: Any) -> str | None:
        """What the core needs on one request's vLLM objects and they lack, or None."""

    @abc.abstractmethod
    def check_native_merge(self, native_merge: Callable[..., bool]) -> str | None:
        """None when the core's merge (`native_merge(cur, next)`) leaves outputs as
        vLLM's `RequestOutput.add(next, aggregate=True)` does, else what differed."""

    @abc.abstractmethod
    def check_native_stats(self, native_step: Callable[..., bool]) -> str | None:
        """Where the core's native decode-step statistics (`native_step(eco, ts,
        req_stats, iteration_stats)`) differ from vLLM's, or None."""

    @abc.abstractmethod
    def update_stock_streaming_request(self, stock: Any, request: Any, prompt: str | None) -> bool: ...

    @abc.abstractmethod
    def process_outputs(self, core: Any, spec: CoreSpec, engine_core_outputs: Any,
                        engine_core_timestamp: float | None, iteration_stats: Any,
                        weight_version: str | None) -> tuple[list[Any], list[Any]]: ...

    @abc.abstractmethod
    def streaming_input_collector(self) -> type: ...

    @abc.abstractmethod
    def processor_output(self, request_outputs: list[Any], reqs_to_abort: list[str]) -> Any: ...

    @abc.abstractmethod
    def new_lora_states(self, log_stats: bool) -> Any: ...

    @abc.abstractmethod
    def update_scheduler_stats(self, lora_states: Any, scheduler_stats: Any) -> None: ...

    @abc.abstractmethod
    def set_admission_count(self, admission_stats: Any, live_requests: int) -> None:
        """Tell vLLM's shared admission statistics how many requests are live."""

    @abc.abstractmethod
    def is_engine_core_request(self, obj: Any) -> bool: ...

    @abc.abstractmethod
    def is_parent_request(self, obj: Any) -> bool: ...

    @abc.abstractmethod
    def ensure_request_output_error(self) -> None: ...

    @abc.abstractmethod
    def remove_request_output_error(self) -> list[str]:
        """Undo `ensure_request_output_error`; the labels of what was removed."""

    @abc.abstractmethod
    def output_processor_patches(self, processor_cls: type) -> list[tuple[Any, str, Any]]: ...

    @abc.abstractmethod
    def engine_classes(self) -> tuple[type[Any], ...]: ...

    @abc.abstractmethod
    def engine_output_processor(self, engine: Any) -> Any:
        """The engine's output processor (None when it has none)."""

    @abc.abstractmethod
    def engine_renderer(self, engine: Any) -> Any: ...

    @abc.abstractmethod
    def prometheus_stat_loggers(self, engine: Any) -> list[Any]:
        """The engine's Prometheus stat loggers ([] when statistics are off)."""

    def stat_env_reads(self) -> tuple[ModuleType | None, list[str]]:
        """vLLM's environment module and the variables its statistics code reads
        on every call that the engine core fixes at its start ([] when this
        process caches vLLM's environment already, or when none is known)."""
        return None, []

    def read_fields(self) -> dict[str, tuple[Any, tuple[str, ...]]]:
        """label -> (a vLLM class, the fields of it the package reads), checked at
        start-up beside the signatures."""
        return {}

    @abc.abstractmethod
    def miss_error(self, hashes: list[str]) -> Any: ...

    # --- serving retry
    @abc.abstractmethod
    def retry_seams(self) -> RetrySeams: ...

    @abc.abstractmethod
    def finished_error(self, output: Any) -> OutputError | None:
        """The structured error a finished output (generation or pooling) ends with,
        None for a running output or one without an error."""

    @abc.abstractmethod
    def retrying_routes(self) -> tuple[str, ...]:
        """The HTTP routes whose requests reach the retrying entry points."""

    @abc.abstractmethod
    def retry_applies(self, request: Any) -> bool:
        """Whether an endpoint request may be retried here (beam search keeps vLLM's
        own policy)."""

    @abc.abstractmethod
    def request_streams(self, request: Any) -> bool: ...

    @abc.abstractmethod
    def generate_request_id(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """The request id of an engine client `generate(*args, **kwargs)` call (None
        when the call does not name one)."""

    @abc.abstractmethod
    def generate_with_prompt(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                             prompt: Any) -> tuple[tuple[Any, ...], dict[str, Any]]: ...

    @abc.abstractmethod
    def retryable_request_error(self) -> type[Exception]: ...

    @abc.abstractmethod
    def generation_error(self) -> type[Exception]: ...

    @abc.abstractmethod
    def vllm_error(self) -> type[Exception]: ...

    @abc.abstractmethod
    def error_body(self, exc: Exception) -> dict[str, Any]: ...

    @abc.abstractmethod
    async def render_chat(self, serving: Any, request: Any, skip_mm_cache: bool) -> list[Any]: ...

    @abc.abstractmethod
    async def render_completion(self, serving: Any, request: Any,
                                skip_mm_cache: bool) -> list[Any]: ...

    @abc.abstractmethod
    async def pooling_submit(self, serving: Any, request: Any, raw_request: Any, *,
                             skip_mm_cache: bool = False,
                             request_id: str | None = None) -> PoolingAttempt: ...

    @abc.abstractmethod
    def pooling_request_id(self, attempt: PoolingAttempt) -> str: ...

    @abc.abstractmethod
    def wrap_pooling_results(self, attempt: PoolingAttempt,
                             wrap: Callable[[PoolingResults], PoolingResults]) -> None: ...

    @abc.abstractmethod
    async def pooling_close(self, attempt: PoolingAttempt) -> None: ...

    @abc.abstractmethod
    async def pooling_finish(self, serving: Any, attempt: PoolingAttempt) -> Any: ...

    @abc.abstractmethod
    def responses_sse_writer(self) -> tuple[ModuleType, str]: ...

    # --- engine-output receive
    @abc.abstractmethod
    def receive_seam(self) -> ReceiveSeam | str:
        """The seam, or why this vLLM's output task is not the one receive.py knows."""

    @abc.abstractmethod
    def output_handler_seam(self) -> HandlerSeam | str:
        """The seam, or why this vLLM's output handler is not the one catchup.py knows."""

    @abc.abstractmethod
    def outputs_wire(self) -> OutputsWire | str:
        """The engine-output message layout, or why the native reader cannot read it."""

    # --- fault switch
    @abc.abstractmethod
    def lru_receiver_cache(self) -> tuple[type[Any], type[Exception]]: ...

    @abc.abstractmethod
    def receiver_entries(self, cache: Any) -> MutableMapping[str, Any]:
        """The received items of the P1 receiver `cache`, by multimodal hash."""

    @abc.abstractmethod
    def mm_cache_type_lookup(self) -> tuple[ModuleType, str]: ...

    # --- doctor
    @abc.abstractmethod
    def serve_parser(self) -> argparse.ArgumentParser: ...

    @abc.abstractmethod
    def parse_serve_args(self, argv: list[str]) -> argparse.Namespace: ...

    @abc.abstractmethod
    def serve_front_end(self, args: argparse.Namespace) -> str | None: ...

    @abc.abstractmethod
    def serve_api_servers(self, args: argparse.Namespace) -> tuple[int, argparse.Namespace]: ...

    @abc.abstractmethod
    def serve_tokenizer(self, target: str,
                        args: argparse.Namespace) -> tuple[str, dict[str, Any]]: ...

    @abc.abstractmethod
    def serve_cache_type(self, args: argparse.Namespace, api_servers: int) -> str | None: ...

    @abc.abstractmethod
    def load_tokenizer(self, source: str, options: dict[str, Any]) -> Any: ...
