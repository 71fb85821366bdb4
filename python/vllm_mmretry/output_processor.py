"""Drop-in replacement for vLLM's `OutputProcessor`, backed by the Rust core.

What changes compared to stock vLLM 0.32:
- a generation request that fails with a P1 multimodal cache miss
  (`finish_reason=ERROR` + `mm_cache_miss_hashes`) gets one terminal
  `RequestOutput` with `error=RequestError(code="multimodal_cache_miss",
  retryable=True)`; for n>1 every live sibling is aborted (here and, through
  `reqs_to_abort`, in the engine core) and the parent gets exactly that one output;
- every missing hash of a step is invalidated in P0's sender cache once, before
  any output of the step is published.
- a bug in the native loop (a Rust panic) in one request's step fails that
  request only: one terminal output with `error=RequestError(code="internal_error",
  retryable=False)` (n>1: to the parent, siblings aborted), its ids in
  `reqs_to_abort`; the step goes on for the other requests and returns normally
  (raising would make AsyncLLM's output handler fail every request).
  VLLM_MMRETRY_TEST_PANIC_ON_REQUEST=<id>[,<id>...] forces it, for tests.
Everything else produces the outputs stock vLLM produces (tests/test_differential*).

Speed: requests without per-request Python features run the fast loop in Rust.
The others (logprobs, pooling, streaming input, ...) are owned by an embedded stock
`OutputProcessor` (the adapter's `StockSide`): vLLM's own code steps and aborts
them; the core routes their outputs to it in one batch per run.
When the tokenizer is a Hugging Face fast tokenizer (vLLM's
FastIncrementalDetokenizer path) whose definition the Rust `tokenizers` crate
loads, its vocabulary is loaded once (`native_vocab`) and such requests are
detokenized natively too (stop strings, min_tokens, surplus-token trimming);
otherwise vLLM's Python detokenizer runs, counted by reason in
`counters()["python_detok"]`. `native_detok=False` or VLLM_MMRETRY_NATIVE_DETOK=0
forces the Python detokenizer. A native request that later needs vLLM's Python
path has its ids replayed into its stock detokenizer first. `request_states`
of native requests hold vLLM's detokenizer as it was at add time.

Everything vLLM-specific comes from the adapter of the running vLLM
(`vllm_adapter`). When a processor is built, the adapter's self-check compares the
native parts with that vLLM (output constructors as other plugins left them,
EngineCoreOutput fields, FinishReason codes, the native vocabulary); a part that
differs is turned off for this processor (one WARNING, `counters()
["self_check_failed"]`) and vLLM's own code does its work.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterable
from typing import Any

from vllm_mmretry import _core, prom, switches
from vllm_mmretry import metrics as _metrics  # vllm-mmretry metrics hook
from vllm_mmretry.switches import switch_on
from vllm_mmretry.vllm_adapter import adapter, vllm_logger
from vllm_mmretry.vllm_adapter.base import NewRequest, SelfCheck

_vllm = adapter()
MISS_CODE = "multimodal_cache_miss"
# "0" forces vLLM's Python detokenizer (the output loop stays native).
NATIVE_DETOK_ENV = "VLLM_MMRETRY_NATIVE_DETOK"
# Tests: comma-separated native parts whose start-up self-check is made to fail
# ("outputs", "eco_offsets", "detok", "objects"), to show vLLM's own code taking over.
FORCE_SELF_CHECK_FAIL_ENV = switches.FORCE_SELF_CHECK_FAIL_ENV
FORCE_OBJECTS = "objects"  # checked on the first request, not at build time

# Names kept for callers of this module (the facts live in the adapter).
miss_error = _vllm.miss_error
ensure_request_output_error = _vllm.ensure_request_output_error


def native_vocab(tokenizer: Any) -> tuple[Any, str | None]:
    """See the adapter's `native_vocab`."""
    return _vllm.native_vocab(tokenizer)


def native_detok_enabled(native_detok: bool | None = None) -> bool:
    """The native detokenizer is used: as asked, else by VLLM_MMRETRY_NATIVE_DETOK."""
    if native_detok is not None:
        return native_detok
    return switch_on(NATIVE_DETOK_ENV)


_logger: logging.Logger | None = None


def _log() -> logging.Logger:
    global _logger
    if _logger is None:
        _logger = vllm_logger("vllm.vllm_mmretry.output_processor")
    return _logger


def _forced_failures() -> set[str]:
    return {p.strip() for p in os.environ.get(FORCE_SELF_CHECK_FAIL_ENV, "").split(",") if p.strip()}


def run_self_check(tokenizer: Any, vocab: Any) -> SelfCheck:
    """The adapter's start-up self-check, plus failures forced for tests."""
    check = _vllm.self_check(tokenizer, vocab)
    for part in _forced_failures():
        if hasattr(check, part) and getattr(check, part) is None:
            setattr(check, part, f"forced by {FORCE_SELF_CHECK_FAIL_ENV}")
    return check


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
        _vllm.ensure_request_output_error()
        self.log_stats = log_stats
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self.lora_states = _vllm.new_lora_states(log_stats)
        self.tracing_enabled = tracing_enabled
        self.admission_stats = admission_stats
        self._detok_reason: str | None
        vocab, self._detok_reason = (native_vocab(tokenizer) if native_detok_enabled(native_detok)
                                     else (None, "disabled"))
        # Built now, after every plugin has loaded: what vLLM's constructors build
        # is what the native path must build.
        self._check = run_self_check(tokenizer, vocab)
        if self._check.detok is not None:
            vocab, self._detok_reason = None, "self_check"
        # Requests that need vLLM's own per-request code are owned by an embedded
        # stock processor; the core routes their outputs and aborts to it.
        self._stock = _vllm.new_stock_side(tokenizer, log_stats, stream_interval, tracing_enabled,
                                           self.lora_states)
        self._spec = _vllm.core_spec(self.lora_states, self._check, self._stock)
        self._core = _core.OutputCore(self._spec)
        self._core.native_vocab = vocab
        # The native decode-step statistics are compared with vLLM's on this core.
        if self._check.stats is None:
            self._check.stats = _vllm.check_native_stats(self._core.native_decode_stats)
        self._core.native_stats = self._check.stats is None
        # So is the native collector merge with vLLM's RequestOutput.add.
        if self._check.merge is None:
            self._check.merge = _vllm.check_native_merge(self._core.native_merge_outputs)
        self._core.native_merge = self._check.merge is None
        self._self_check_failed = self._check.failures()
        for part, why in self._self_check_failed.items():
            _log().warning("vllm-mmretry: native %s turned off for this output processor, "
                           "vLLM's own code runs instead: %s", _PART_NAMES[part], why)
        # Kinds of request objects (`_OBJECT_KINDS`) whose attributes
        # passed `check_request_objects`; a failure sends every request to vLLM.
        self._objects_checked: set[str] = set()
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
    def request_states(self) -> dict[str, Any]:
        """Snapshot {internal id: vLLM RequestState} (fields synced)."""
        return self._core.states()

    @property
    def parent_requests(self) -> dict[str, Any]:
        return self._core.parents()

    def counters(self) -> dict[str, Any]:
        """Fast/fallback step counts, fallbacks by reason, P0 invalidations,
        native parts the start-up self-check turned off (`self_check_failed`)."""
        counters = self._core.counters()
        counters["self_check_failed"] = {part: 1 for part in self._self_check_failed}
        return counters

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

    def update_scheduler_stats(self, scheduler_stats: Any) -> None:
        _vllm.update_scheduler_stats(self.lora_states, scheduler_stats)

    def _update_admission_stats(self) -> None:
        if self.admission_stats is not None:
            _vllm.set_admission_count(self.admission_stats, len(self._core))

    # -- requests
    def abort_requests(self, request_ids: Iterable[str], internal: bool) -> list[str]:
        aborted = self._core.abort(request_ids, internal)
        self._update_admission_stats()
        return aborted

    def add_request(
        self,
        request: Any,
        prompt: str | None,
        parent_req: Any = None,
        request_index: int = 0,
        queue: Any = None,
    ) -> None:
        if not _vllm.is_engine_core_request(request):
            raise TypeError(f"add_request expects an EngineCoreRequest, got {type(request).__name__}")
        request_id = request.request_id
        if self._core.has(request_id):
            if not self._core.is_streaming(request_id):
                raise ValueError(f"request {request_id!r} is already tracked by the output processor")
            # Streaming-input requests are the stock processor's: vLLM's own update.
            if _vllm.update_stock_streaming_request(self._stock, request, prompt):
                self._core.finish_request(request_id)
                self._update_admission_stats()
            return
        if parent_req is not None and not _vllm.is_parent_request(parent_req):
            raise TypeError("parent_req must be a ParentRequest or None")
        state = _vllm.new_request_state(self.tokenizer, request, prompt, parent_req, request_index,
                                        queue, self.log_stats, self.stream_interval)
        reason = _vllm.fallback_reason(request, state, self.tracing_enabled)
        if reason is None and self._check.outputs is not None:
            reason = "self_check_outputs"
        if reason is None and not self._request_objects_ok(state, parent_req, queue):
            reason = "self_check_objects"
        fast = None if reason else _vllm.fast_spec(state, request, self._detok_reason, self._check)
        _, external_id, streaming, is_pooling = _vllm.request_identity(request, state)
        self._core.add(NewRequest(
            request_id=request_id, external_req_id=external_id, state=state, parent=parent_req,
            queue=queue, fast=fast, fallback_reason=reason, streaming=streaming,
            is_pooling=is_pooling,
        ))
        if fast is None:
            self._stock.hand_over(state)
        self._update_admission_stats()

    def _request_objects_ok(self, state: Any, parent: Any, queue: Any) -> bool:
        """The core's attribute names hold on this request's vLLM objects (checked
        once per kind of object, on the first request that has one)."""
        if "objects" in self._self_check_failed:
            return False
        checked = self._objects_checked
        # The usual request: every kind of object it has was checked before.
        if ("state" in checked and (parent is None or "parent" in checked)
                and (queue is None or "queue" in checked)):
            return True
        new = {kind for kind, obj in zip(_OBJECT_KINDS, (state, parent, queue), strict=True)
               if obj is not None and kind not in checked}
        if not new:
            return True
        why = _vllm.check_request_objects(state, parent if "parent" in new else None,
                                          queue if "queue" in new else None)
        if FORCE_OBJECTS in _forced_failures():
            why = why or f"forced by {FORCE_SELF_CHECK_FAIL_ENV}"
        if why is None:
            self._objects_checked |= new
            return True
        self._self_check_failed["objects"] = why
        _log().warning("vllm-mmretry: native %s turned off for this output processor, "
                       "vLLM's own code runs instead: %s", _PART_NAMES["objects"], why)
        return False

    def process_outputs(
        self,
        engine_core_outputs: list[Any],
        engine_core_timestamp: float | None = None,
        iteration_stats: Any = None,
        weight_version: str | None = None,
    ) -> Any:
        request_outputs, reqs_to_abort = _vllm.process_outputs(
            self._core, self._spec, engine_core_outputs, engine_core_timestamp,
            iteration_stats, weight_version)
        if self.admission_stats is not None:
            self._update_admission_stats()
        return _vllm.processor_output(request_outputs, reqs_to_abort)


_OBJECT_KINDS = ("state", "parent", "queue")
_PART_NAMES = {
    "outputs": "output building (RequestOutput/CompletionOutput)",
    "eco_offsets": "EngineCoreOutput slot reads",
    "detok": "detokenizer",
    "stats": "decode-step statistics",
    "merge": "collector merges (RequestOutput.add)",
    "objects": "output loop (vLLM's request objects differ)",
}


# ------------------------------------------------------------------------- install

def install() -> list[str]:
    """Make AsyncLLM and LLMEngine use this OutputProcessor, wired to P0's
    multimodal sender cache, and give RequestOutput its `error` field."""
    from vllm_mmretry._patching import patch_attr

    _vllm.ensure_request_output_error()
    labels = [patch_attr(owner, name, new)
              for owner, name, new in _vllm.output_processor_patches(OutputProcessor)]
    for engine_cls in _vllm.engine_classes():
        labels.append(patch_attr(engine_cls, "__init__", _after_engine_init(engine_cls.__init__)))
    return labels


def _after_engine_init(init: Any) -> Any:
    """The engine's __init__, then: its output processor wired to P0's cache,
    and native updates for its stat loggers' prometheus metrics (prom.py)."""

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        prom.speed_up_engine(self)
        op = _vllm.engine_output_processor(self)
        if isinstance(op, OutputProcessor):
            # The renderer, not its cache: read at each miss, so a rebuilt cache
            # is still the one invalidated.
            op.mm_processor_cache = _vllm.engine_renderer(self)

    return __init__
