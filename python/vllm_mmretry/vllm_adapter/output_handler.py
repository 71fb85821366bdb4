"""AsyncLLM's output handler with the statistics of a catch-up recorded once (catchup.py).

vLLM's handler (`AsyncLLM._run_output_handler`) takes one engine-output message at a
time from the engine client's queue and, with statistics on, builds an
`IterationStats` for it and calls the stat loggers' `record` (a dozen Prometheus
updates and vLLM's own bookkeeping) before it takes the next. While the engine is
ahead, the queue holds hundreds of messages and the handler works through all of them
without yielding to the event loop: nothing else runs until it catches up, so nothing
can see the metrics between two of those messages.

`run_output_handler` is vLLM's handler with the records of a catch-up made when it
ends (before the handler waits for the next message, or yields between the chunks of
a big message): the messages of one engine share one `IterationStats` (so its sums and
lists are those of the messages' stats together), and `CatchUp.record` makes one
`record` call per engine for them. That leaves the stat loggers what the per-message
calls leave, because for vLLM's own loggers a record is sums, list observations and
last values, with one exception: the Prometheus logger observes each iteration's token
count (`vllm:iteration_tokens_total`), which `CatchUp` observes per message. Scheduler
statistics (every message of a real engine) are recorded per message, as in stock,
apart from the iteration part: for vLLM's loggers the two parts of `record` are
independent. Everything else in the handler is vLLM's, line for line.

Only where this is known to hold: the stat loggers are exactly vLLM's default classes,
and the sources of vLLM's handler, its queue read, the loggers' `record` and the stats
classes are the ones this module was written against (`digests`: the adapter of each
version lists them). Otherwise vLLM's own handler runs (catchup.py says why)."""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import vllm.envs as envs
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.async_llm import logger as vllm_async_llm_logger
from vllm.v1.engine.core_client import AsyncMPClient
from vllm.v1.metrics.loggers import (
    AggregatedLoggingStatLogger,
    LoggingStatLogger,
    PerEngineStatLoggerAdapter,
    PrometheusStatLogger,
    StatLoggerManager,
)
from vllm.v1.metrics.stats import IterationStats, PromptTokenStats


# The vLLM code whose behaviour the handler and `CatchUp` rely on, by name (the
# adapter's `HANDLER_DIGESTS` holds each one's source digest for its vLLM).
def digest_targets() -> dict[str, Any]:
    from vllm.renderers.base import BaseRenderer

    return {
        "AsyncLLM._run_output_handler": AsyncLLM._run_output_handler,
        "AsyncMPClient.get_output_async": AsyncMPClient.get_output_async,
        "StatLoggerManager.record": StatLoggerManager.record,
        "PerEngineStatLoggerAdapter.record": PerEngineStatLoggerAdapter.record,
        "LoggingStatLogger.record": LoggingStatLogger.record,
        "LoggingStatLogger._track_iteration_stats": LoggingStatLogger._track_iteration_stats,
        "AggregatedLoggingStatLogger.record": AggregatedLoggingStatLogger.record,
        "PrometheusStatLogger.record": PrometheusStatLogger.record,
        "IterationStats": IterationStats,
        "PromptTokenStats": PromptTokenStats,
        "BaseRenderer.stat_mm_cache": BaseRenderer.stat_mm_cache,
    }


def source_digest(obj: Any) -> str:
    """A short digest of `obj`'s source (wrappers unwrapped); "" when it has none."""
    try:
        source = inspect.getsource(inspect.unwrap(obj))
    except (OSError, TypeError):
        return ""
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def changed_sources(expected: dict[str, str], originals: dict[str, Any]) -> list[str]:
    """The names whose vLLM source is not the one written against."""
    return sorted(name for name, obj in originals.items() if source_digest(obj) != expected.get(name))


def loggers_why_not(manager: Any) -> str | None:
    """Why `manager`'s records cannot be made once per catch-up (None: they can)."""
    if type(manager) is not StatLoggerManager:
        return f"the stat logger manager is a {type(manager).__name__}"
    for lg in manager.stat_loggers:
        kind = type(lg)
        if kind is PerEngineStatLoggerAdapter:
            others = {type(x).__name__ for x in lg.per_engine_stat_loggers.values()
                      if type(x) is not LoggingStatLogger}
            if others:
                return f"a stat logger is a {sorted(others)[0]}"
        elif kind not in (PrometheusStatLogger, AggregatedLoggingStatLogger):
            return f"a stat logger is a {kind.__name__}"
    return None


def iteration_tokens(stats: Any) -> int:
    """What the Prometheus logger observes per record in `vllm:iteration_tokens_total`."""
    total: int = stats.prompt_token_stats.computed + stats.num_generation_tokens
    return total


class _EachMessage:
    """One engine's `vllm:iteration_tokens_total` child during a catch-up's record:
    observes each message's token count, where the record asks for their sum."""

    __slots__ = ("child", "values")

    def __init__(self, child: Any, values: list[int]) -> None:
        self.child, self.values = child, values

    def observe(self, amount: float) -> None:
        for value in self.values:
            self.child.observe(value)


@dataclass
class _Pending:
    """The shared statistics of one engine's messages in this catch-up."""

    stats: Any
    values: list[int] = field(default_factory=list)  # each message's iteration tokens
    before: int = 0
    mm_cache_stats: Any = None


class CatchUp:
    """The records one catch-up's messages would each have made, made when it ends."""

    def __init__(self, manager: Any, renderer: Any) -> None:
        self.manager = manager
        self.renderer = renderer
        self._prometheus = [lg for lg in manager.stat_loggers if type(lg) is PrometheusStatLogger]
        self._pending: dict[int, _Pending] = {}
        self._mm_taken = False
        self.records = 0  # record calls made (each stands for one or more messages')
        self.messages = 0  # messages whose statistics went through here

    def stats_for(self, engine_idx: int) -> Any:
        """The IterationStats of the next message from `engine_idx` (its own timestamp,
        as `IterationStats()` would give it)."""
        pending = self._pending.get(engine_idx)
        if pending is None:
            pending = self._pending[engine_idx] = _Pending(IterationStats())
        else:
            pending.stats.iteration_timestamp = time.time()
        pending.before = iteration_tokens(pending.stats)
        return pending.stats

    def add(self, engine_idx: int, scheduler_stats: Any, iteration_stats: Any) -> None:
        """In place of the handler's `record` call for one message."""
        self.messages += 1
        if scheduler_stats is not None:
            self._record(engine_idx, scheduler_stats, None, self._take_mm_cache_stats())
        if iteration_stats is not None:
            pending = self._pending[engine_idx]
            pending.values.append(iteration_tokens(iteration_stats) - pending.before)
            if pending.mm_cache_stats is None:
                pending.mm_cache_stats = self._take_mm_cache_stats()
        elif scheduler_stats is None:
            self._record(engine_idx, None, None, self._take_mm_cache_stats())

    def record(self) -> None:
        """Record what this catch-up holds (nothing when it holds nothing)."""
        pending, self._pending = self._pending, {}
        self._mm_taken = False
        for engine_idx, p in pending.items():
            if p.values:
                self._record(engine_idx, None, p.stats, p.mm_cache_stats, p.values)
            elif p.mm_cache_stats is not None:
                self._record(engine_idx, None, None, p.mm_cache_stats)

    def _take_mm_cache_stats(self) -> Any:
        # Stock hands the renderer's statistics to every record; all but the first
        # of a catch-up are empty (nothing renders while the handler runs).
        if self._mm_taken:
            return None
        self._mm_taken = True
        return self.renderer.stat_mm_cache()

    def _record(self, engine_idx: int, scheduler_stats: Any, iteration_stats: Any,
                mm_cache_stats: Any, values: list[int] | None = None) -> None:
        self.records += 1
        saved = [(lg, lg.histogram_iteration_tokens) for lg in self._prometheus] if values else []
        try:
            for lg, children in saved:
                assert values is not None  # saved is empty without them
                lg.histogram_iteration_tokens = {**children,
                                                 engine_idx: _EachMessage(children[engine_idx], values)}
            self.manager.record(engine_idx=engine_idx, scheduler_stats=scheduler_stats,
                                iteration_stats=iteration_stats, mm_cache_stats=mm_cache_stats)
        finally:
            for lg, children in saved:
                lg.histogram_iteration_tokens = children


@dataclass(frozen=True)
class SliceSteps:
    """What this vLLM's handler does around `process_outputs` for one slice of
    outputs (0.32 and 0.33 differ there)."""

    # (renderer, P0 cache, slice) before process_outputs, and after it
    before: Callable[[Any, Any, Any], None] | None
    after: Callable[[Any, Any, Any], None] | None
    # the exception handler's special case (0.33: a retired elastic-EP rank)
    quiet_failure: Callable[[BaseException], bool] | None = None


def run_output_handler(engine: Any, catch_up: CatchUp, steps: SliceSteps) -> None:
    """`AsyncLLM._run_output_handler`, recording statistics through `catch_up`, laid out
    as vLLM's is (the task's coroutine holds the engine's parts, never the engine).
    catchup.py calls it only while the engine has no handler."""
    engine_core = engine.engine_core
    output_processor = engine.output_processor
    log_stats = engine.log_stats
    engine._logger_ref = [engine.logger_manager]
    logger_ref = engine._logger_ref
    renderer = engine.renderer
    mm_processor_cache = renderer.mm_processor_cache
    chunk_size = envs.VLLM_V1_OUTPUT_PROC_CHUNK_SIZE
    outputs_queue = engine_core.outputs_queue

    async def output_handler() -> None:
        try:
            while True:
                if outputs_queue.empty():
                    catch_up.record()  # caught up: the handler is about to wait
                try:
                    outputs = await engine_core.get_output_async()
                except BaseException:
                    catch_up.record()  # what stock had recorded by now
                    raise
                num_outputs = len(outputs.outputs)
                # A message with several chunks yields between them: stock's way.
                coalesced = num_outputs <= chunk_size and logger_ref[0] is catch_up.manager
                if not coalesced:
                    catch_up.record()
                iteration_stats = None
                if log_stats and num_outputs:
                    iteration_stats = (catch_up.stats_for(outputs.engine_index) if coalesced
                                       else IterationStats())

                engine_core_outputs = outputs.outputs
                for start in range(0, num_outputs, chunk_size):
                    end = start + chunk_size
                    outputs_slice = engine_core_outputs[start:end]
                    if steps.before is not None:
                        steps.before(renderer, mm_processor_cache, outputs_slice)
                    processed_outputs = output_processor.process_outputs(
                        outputs_slice,
                        outputs.timestamp,
                        iteration_stats,
                        weight_version=outputs.weight_version,
                    )
                    assert not processed_outputs.request_outputs
                    if steps.after is not None:
                        steps.after(renderer, mm_processor_cache, outputs_slice)
                    if end < num_outputs:
                        await asyncio.sleep(0)
                    if processed_outputs.reqs_to_abort:
                        await engine_core.abort_requests_async(processed_outputs.reqs_to_abort)

                output_processor.update_scheduler_stats(outputs.scheduler_stats)

                if logger_ref[0]:
                    if coalesced:
                        catch_up.add(outputs.engine_index, outputs.scheduler_stats, iteration_stats)
                    else:
                        logger_ref[0].record(
                            engine_idx=outputs.engine_index,
                            scheduler_stats=outputs.scheduler_stats,
                            iteration_stats=iteration_stats,
                            mm_cache_stats=renderer.stat_mm_cache(),
                        )
        except Exception as e:  # noqa: BLE001 - vLLM's handler hands every error to the requests
            if steps.quiet_failure is not None and steps.quiet_failure(e):
                output_processor.propagate_error(e)
                return
            vllm_async_llm_logger.exception("AsyncLLM output_handler failed.")
            output_processor.propagate_error(e)

    engine.output_handler = asyncio.create_task(output_handler())


def handler_why_not(engine: Any) -> str | None:
    """Why this engine's handler must be vLLM's own (None: it can be ours)."""
    if not engine.log_stats or engine.logger_manager is None:
        return "statistics are off"
    if not isinstance(engine.engine_core, AsyncMPClient):
        return f"the engine client is a {type(engine.engine_core).__name__}"
    if type(engine.engine_core).get_output_async is not AsyncMPClient.get_output_async:
        return f"{type(engine.engine_core).__name__} reads its outputs its own way"
    return loggers_why_not(engine.logger_manager)
