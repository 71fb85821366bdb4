"""vLLM 0.33: what changed since 0.32 at the package's seams (everything else is
inherited from `v0_32`). See docs/vllm-0.33-seams.md for the line-by-line reading.

- `EngineCoreOutput` has a trailing `error: RequestError | None`. With a queue
  (AsyncLLM), vLLM puts `error.to_exception()` into it and finishes the request
  without an output or stats; that runs here, before the core sees the step.
  Without a queue (LLMEngine) the output goes the ordinary way (finish ERROR).
- A streaming-input request whose sub-request finishes with ERROR or ABORT ends
  (0.32 kept it alive), and a finished streaming-input request is always aborted
  in the engine (an in-flight chunk may re-create the session).
- Parents discard finished children (`_finish_request`).
- AsyncLLM's output handler queues miss invalidations on the renderer
  (`queue_mm_cache_invalidations`) before `process_outputs`; the renderer drains
  them before its next cache lookup. So on AsyncLLM the output loop invalidates
  nothing itself (touching the sender cache from the output handler is the race
  0.33 removed); LLMEngine still invalidates directly, as in 0.32.
- Streaming input uses `StreamingInputOutputCollector` (a subclass: the core
  calls its own `put`).
- Pooling outputs are returned before the `stream_interval` check: pooling runs
  vLLM's `make_request_output`, so nothing to do here.
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass, field, replace
from operator import attrgetter
from typing import Any

from vllm.outputs import RequestError
from vllm.v1.engine import EngineCoreOutput, FinishReason
from vllm.v1.engine.output_processor import (
    EMPTY_CPU_TENSOR,
    RequestState,
    StreamingInputOutputCollector,
)
from vllm.v1.metrics.stats import IterationStats, LoRARequestStates

from vllm_mmretry import metrics as _metrics  # vllm-mmretry metrics hook
from vllm_mmretry.vllm_adapter import v0_32
from vllm_mmretry.vllm_adapter.base import CoreSpec, SelfCheck

# EngineCoreOutput's fields in 0.33, in declaration order (slot order).
ECO_STRUCT_FIELDS: tuple[str, ...] = (*v0_32.ECO_STRUCT_FIELDS, "error")
# Finish reasons that end a streaming-input request instead of a chunk.
_ENDS_STREAMING_INPUT = (FinishReason.ABORT, FinishReason.ERROR)
_error_of = attrgetter("error")


@dataclass
class StepState:
    """Per-processor state of the Python step code: streaming-input requests the
    fallback step finished this step (vLLM 0.33 aborts them in the engine too)."""

    streaming_finished: list[str] = field(default_factory=list)


def _fallback_step(
    step: StepState,
    req_state: RequestState,
    eco: EngineCoreOutput,
    engine_core_timestamp: float | None,
    iteration_stats: IterationStats | None,
    weight_version: str | None,
    lora_states: LoRARequestStates,
) -> tuple[Any, FinishReason | None, bool]:
    """vLLM 0.33's loop body for one output of one request (steps 1-4), for
    requests whose features live in vLLM's Python objects; as `v0_32._fallback_step`
    except for the streaming-input chunk boundary."""
    v0_32._update_iteration_stats(req_state, eco, engine_core_timestamp, iteration_stats,
                                  lora_states)
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
            code=v0_32.MISS_CODE, message="Multi-modal processor cache miss.", retryable=True
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
            v0_32.StockOutputProcessor._trim_surplus_tokens(req_state, eco, num_prev_tokens)
        if eco.new_sampling_mask is not None:
            req_state.sampling_mask_chunks.append(eco.new_sampling_mask)
        req_state.logprobs_processor.update_from_output(eco)

    chunk_boundary = req_state.streaming_input and finish_reason not in _ENDS_STREAMING_INPUT
    request_output = req_state.make_request_output(
        new_token_ids, pooling_output, finish_reason, stop_reason,
        eco.kv_transfer_params, eco.ec_transfer_params, error=request_error,
    )
    if request_output is not None and chunk_boundary:
        request_output.finished = False
    release = True
    if finish_reason is not None:
        if chunk_boundary:
            release = False
            if req_state.input_chunk_queue:
                req_state.apply_streaming_update(req_state.input_chunk_queue.popleft())
            else:
                req_state.input_chunk_queue = None
        elif req_state.streaming_input and eco.finished:
            # The core aborts only what the engine has not finished.
            step.streaming_finished.append(req_state.request_id)
    return request_output, finish_reason, release


def _reject(core: Any, eco: EngineCoreOutput, aborts: list[str]) -> bool:
    """vLLM 0.33's handling of `EngineCoreOutput.error` for a request with a
    queue: the exception goes into the queue, the request finishes without an
    output or stats. False when the output goes the ordinary way instead."""
    rid = eco.request_id
    if not core.has(rid):
        return True  # output for an already-aborted request: ignored
    state = core.state(rid)
    if state.queue is None:
        return False
    state.queue.put(eco.error.to_exception())
    if state.parent_req is not None:
        state.parent_req.child_requests.discard(rid)
    core.finish_request(rid)
    if state.streaming_input:
        aborts.append(rid)
    return True


class Adapter(v0_32.Adapter):
    """vLLM 0.33.x."""

    version = "0.33.0"
    ECO_STRUCT_FIELDS = ECO_STRUCT_FIELDS


    # --- doctor
    def serve_parser(self) -> argparse.ArgumentParser:
        """`vllm serve`'s own argument parser (0.33 moved it to entrypoints.common)."""
        from vllm.entrypoints.common.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser: argparse.ArgumentParser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
        return parser
    def core_spec(self, lora_states: Any, tracing_enabled: bool, check: SelfCheck) -> CoreSpec:
        step = StepState()
        spec = super().core_spec(lora_states, tracing_enabled, check)
        helpers = replace(spec.helpers, fallback_step=functools.partial(_fallback_step, step))
        return replace(spec, helpers=helpers, step_state=step)

    def process_outputs(self, core: Any, spec: CoreSpec, engine_core_outputs: Any,
                        engine_core_timestamp: float | None, iteration_stats: Any,
                        weight_version: str | None) -> tuple[list[Any], list[Any]]:
        # The scan runs in C (map); outputs with `error` are rare (a paused engine).
        if not any(map(_error_of, engine_core_outputs)):
            outs, aborts = core.process(engine_core_outputs, engine_core_timestamp,
                                        iteration_stats, weight_version)
        else:
            outs, aborts = self._process_with_errors(
                core, engine_core_outputs, engine_core_timestamp, iteration_stats,
                weight_version)
        step: StepState = spec.step_state
        if step.streaming_finished:
            aborts.extend(step.streaming_finished)
            step.streaming_finished.clear()
        return outs, aborts

    @staticmethod
    def _process_with_errors(core: Any, ecos: Any, ts: float | None, stats: Any,
                             weight_version: str | None) -> tuple[list[Any], list[Any]]:
        """The step in order: runs of ordinary outputs go to the core, rejected
        requests are finished in between (so outputs and aborts keep vLLM's order)."""
        outs: list[Any] = []
        aborts: list[Any] = []
        run: list[Any] = []

        def flush() -> None:
            if run:
                o, a = core.process(list(run), ts, stats, weight_version)
                outs.extend(o)
                aborts.extend(a)
                run.clear()

        for eco in ecos:
            if eco.error is None:
                run.append(eco)
                continue
            flush()
            if not _reject(core, eco, aborts):
                run.append(eco)
        flush()
        return outs, aborts

    def streaming_input_collector(self) -> type:
        collector: type = StreamingInputOutputCollector
        return collector

    def engine_renderer(self, engine: Any) -> Any:
        """What the output loop invalidates missed hashes in: nothing on AsyncLLM
        (its output handler queues them on the renderer before `process_outputs`),
        the renderer on LLMEngine (it still invalidates after `process_outputs`)."""
        from vllm.v1.engine.async_llm import AsyncLLM

        return None if isinstance(engine, AsyncLLM) else engine.renderer
