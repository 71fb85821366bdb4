"""Statistics of a catch-up of AsyncLLM's output handler recorded once (catchup.py).

vLLM's handler (`AsyncLLM._run_output_handler`) takes one engine-output message at a
time from the engine client's queue and, with statistics on, builds an
`IterationStats` for it and calls the stat loggers' `record` (a dozen Prometheus
updates and vLLM's own bookkeeping) before it takes the next. While the engine is
ahead, the queue holds hundreds of messages and the handler works through all of them
without yielding to the event loop: nothing else runs until it catches up, so nothing
can see the metrics between two of those messages.

`start_with_catch_up` starts vLLM's own handler and hooks it where it builds and
records statistics, so that the records of a catch-up are made when it ends (before
the handler waits for the next message, or before a message big enough to be chunked,
between whose chunks the handler yields):
- the client's `get_output_async` (this client only) ends a catch-up when the queue is
  empty and notes which engine's message the handler took;
- `IterationStats()` in vLLM's handler (async_llm's global, `iteration_stats`) gives
  the messages of one engine in a catch-up one shared `IterationStats`, so its sums and
  lists are those of the messages' stats together;
- the handler's `logger_ref[0]` (`_Recorder`) hands each message's record to `CatchUp`,
  which makes one `record` per engine when the catch-up ends.
Within a catch-up the messages waiting behind the one the handler took are also read
with it (`Merged`, unless VLLM_MMRETRY_MERGE_WAITING=0), while together they fit in one
of the handler's chunks, come from its engine and (but the first) report no missed
multimodal items: the handler takes one message made of
their outputs, and the output processor's `process_outputs` (this engine's instance)
processes each message's outputs in turn with that message's own timestamp and weight
version, and after each does what the handler does after a message (scheduler
statistics, the record), as the next message's `IterationStats()` would begin it. A
message whose processing asks for aborts ends the merge there: the messages after it go
back first in the queue, so the handler sends that message's aborts, then its
statistics, before it reads on, as in stock. The handler did not yield between those
messages in stock either (it yields only between chunks and when it waits), so nothing
else can see the difference; what it saves is the handler's per-message Python, most
of the API server's work per message when the engine sends many small messages.
That leaves the stat loggers what the per-message calls leave, because for vLLM's own
loggers a record is sums, list observations and last values, with one exception: the
Prometheus logger observes each iteration's token count (`vllm:iteration_tokens_total`),
which `CatchUp` observes per message. Scheduler statistics (every message of a real
engine) are recorded per message, as in stock, apart from the iteration part: for
vLLM's loggers the two parts of `record` are independent. Everything else the handler
does (invalidating missed multimodal items, chunking, aborts, errors) is vLLM's code.

Only where this is known to hold: the stat loggers are exactly vLLM's default classes,
and the sources of vLLM's handler, its queue read, the loggers' `record` and the stats
classes are the ones this module was written against (`digests`: the adapter of each
version lists them). Otherwise vLLM's handler runs unhooked (catchup.py says why)."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import hashlib
import inspect
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import msgspec
import vllm.envs as envs
from vllm.v1.engine import EngineCoreOutputs, async_llm
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.core_client import AsyncMPClient
from vllm.v1.metrics.loggers import (
    AggregatedLoggingStatLogger,
    LoggingStatLogger,
    PerEngineStatLoggerAdapter,
    PrometheusStatLogger,
    StatLoggerManager,
)
from vllm.v1.metrics.stats import IterationStats, PromptTokenStats

from vllm_mmretry import _patching
from vllm_mmretry.switches import switch_on

MERGE_SWITCH = "VLLM_MMRETRY_MERGE_WAITING"


# The vLLM code whose behaviour the hooks and `CatchUp` rely on, by name (the
# adapter's `HANDLER_DIGESTS` holds each one's source digest for its vLLM).
def digest_targets() -> dict[str, Any]:
    from vllm.renderers.base import BaseRenderer
    from vllm.v1.metrics.stats import CachingMetrics

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
        "CachingMetrics.observe": CachingMetrics.observe,
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

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self._prometheus = [lg for lg in manager.stat_loggers if type(lg) is PrometheusStatLogger]
        self._pending: dict[int, _Pending] = {}
        self._mm_taken = False
        self._later_mm: list[tuple[int, Any]] = []  # (engine, statistics) after the first
        self._fresh: dict[type, Any] = {}  # one new statistics object per class
        self.records = 0  # record calls made (each stands for one or more messages')
        self.messages = 0  # messages whose statistics went through here
        self.merges = 0  # merged reads (`Merged`) the handler took
        self.merged_messages = 0  # messages processed in them

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

    def holds(self, engine_idx: int, iteration_stats: Any) -> bool:
        """`iteration_stats` is the one this catch-up shares for `engine_idx`."""
        pending = self._pending.get(engine_idx)
        return pending is not None and pending.stats is iteration_stats

    def add(self, engine_idx: int, scheduler_stats: Any, iteration_stats: Any,
            mm_cache_stats: Any) -> None:
        """In place of the handler's `record` call for one message."""
        self.messages += 1
        mm_cache_stats = self._mm_cache_stats_of(engine_idx, mm_cache_stats)
        if scheduler_stats is not None:
            self._record(engine_idx, scheduler_stats, None, mm_cache_stats)
            mm_cache_stats = None
        if iteration_stats is not None:
            pending = self._pending[engine_idx]
            pending.values.append(iteration_tokens(iteration_stats) - pending.before)
            if pending.mm_cache_stats is None:
                pending.mm_cache_stats = mm_cache_stats
        elif scheduler_stats is None:
            self._record(engine_idx, None, None, mm_cache_stats)

    def record(self) -> None:
        """Record what this catch-up holds (nothing when it holds nothing)."""
        pending, self._pending = self._pending, {}
        later, self._later_mm = self._later_mm, []
        self._mm_taken = False
        for engine_idx, p in pending.items():
            if p.values:
                self._record(engine_idx, None, p.stats, p.mm_cache_stats, p.values)
            elif p.mm_cache_stats is not None:
                self._record(engine_idx, None, None, p.mm_cache_stats)
        for engine_idx, stats in later:
            self._record(engine_idx, None, None, stats)

    def _mm_cache_stats_of(self, engine_idx: int, stats: Any) -> Any:
        """Where a message's multimodal-cache statistics go: the first message's (what the
        renderer counted since the last catch-up) with the catch-up's records; a later
        one's, empty unless something rendered during the catch-up, after them (so each
        engine's loggers observe them in stock's order)."""
        if not self._mm_taken:
            self._mm_taken = True
            return stats
        if stats is not None and not self._is_fresh(stats):
            self._later_mm.append((engine_idx, stats))
        return None

    def _is_fresh(self, stats: Any) -> bool:
        # Statistics equal to new ones change no logger (CachingMetrics.observe skips
        # them, the Prometheus counters add 0): stock records one per message.
        fresh = self._fresh.get(type(stats))
        if fresh is None:
            fresh = self._fresh[type(stats)] = type(stats)()
        equal: bool = stats == fresh
        return equal

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


class _Run:
    """One handler's catch-up state: whether the message it works on has its
    statistics recorded with the catch-up's (`coalesced`), and from which engine."""

    __slots__ = ("active", "catch_up", "chunk_size", "coalesced", "engine_idx", "logger_ref", "merged",
                 "recorder")

    def __init__(self, catch_up: CatchUp, logger_ref: list[Any], chunk_size: int) -> None:
        self.active = True  # until the handler's task is done
        self.catch_up = catch_up
        self.logger_ref = logger_ref  # the handler's; elastic EP may put another manager in
        self.chunk_size = chunk_size
        self.coalesced = False
        self.engine_idx = 0
        self.merged: Merged | None = None  # the merged message the handler holds, if any
        self.recorder = _Recorder(self)

    def took(self, outputs: Any) -> None:
        """The handler took `outputs` from the queue."""
        # A message with several chunks yields between them: stock's way.
        self.coalesced = len(outputs.outputs) <= self.chunk_size and self.logger_ref[0] is self.recorder
        if not self.coalesced:
            self.catch_up.record()
        self.engine_idx = outputs.engine_index


# The handler task's run; None in every other task (and in an unhooked handler).
_RUN: contextvars.ContextVar[_Run | None] = contextvars.ContextVar("vllm_mmretry_catch_up", default=None)


def iteration_stats() -> Any:
    """`IterationStats()` as vLLM's handler calls it (async_llm's global while installed):
    the catch-up's shared statistics for a coalesced message, else new ones."""
    run = _RUN.get()
    if run is None or not run.coalesced:
        return IterationStats()
    return run.catch_up.stats_for(run.engine_idx)


class _Recorder:
    """The handler's `logger_ref[0]`: a coalesced message's record goes to the catch-up,
    any other after the catch-up's records, to the stat logger manager."""

    __slots__ = ("run",)

    def __init__(self, run: _Run) -> None:
        self.run = run

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int | None = None) -> None:
        run = self.run
        engine_idx = 0 if engine_idx is None else engine_idx
        if run.coalesced and (iteration_stats is None or run.catch_up.holds(engine_idx, iteration_stats)):
            run.catch_up.add(engine_idx, scheduler_stats, iteration_stats, mm_cache_stats)
            return
        run.catch_up.record()
        run.catch_up.manager.record(engine_idx=engine_idx, scheduler_stats=scheduler_stats,
                                    iteration_stats=iteration_stats, mm_cache_stats=mm_cache_stats)


def install_iteration_stats() -> list[str]:
    """Have vLLM's handler build its `IterationStats` through `iteration_stats`."""
    if _patching.is_patched(async_llm, "IterationStats"):
        return []
    return [_patching.patch_attr(async_llm, "IterationStats", iteration_stats)]


def start_with_catch_up(engine: Any, start: Callable[[Any], None]) -> CatchUp:
    """Start vLLM's handler (`start`: `AsyncLLM._run_output_handler`) with the
    statistics of each catch-up recorded once. catchup.py calls it only while the
    engine has no handler; vLLM's task runs its first step after this returns."""
    install_iteration_stats()
    start(engine)
    catch_up = CatchUp(engine.logger_manager)
    run = _Run(catch_up, engine._logger_ref, envs.VLLM_V1_OUTPUT_PROC_CHUNK_SIZE)
    engine._logger_ref[0] = run.recorder
    waiting = waiting_items(engine.engine_core.outputs_queue) if switch_on(MERGE_SWITCH) else None
    if waiting is not None:
        process_merged(engine, run, waiting)
    read_with_catch_up(engine.engine_core, run, waiting)
    engine.output_handler.add_done_callback(functools.partial(_ended, run))
    return catch_up


def _ended(run: _Run, _task: Any) -> None:
    run.active = False


def read_with_catch_up(client: Any, run: _Run, waiting: deque[Any] | None = None) -> None:
    """Give `client` (this instance only) a `get_output_async` that ends the catch-up
    when nothing waits and tells `run` what the handler took. It reads through what
    the handler would have called: a wrapper someone put on this instance (the last
    handler's hook passes through once that handler is done), else vLLM's method.
    With `waiting` (the queue's items) and no such wrapper, which every message would
    have to pass, the messages waiting behind the one taken are merged with it."""
    own = vars(client).get("get_output_async")
    if own is not None:
        waiting = None
    read = type(client).get_output_async
    queue = client.outputs_queue
    # Through a weak reference: the client's own attribute must not keep it alive
    # (vLLM cleans its sockets up when it is collected).
    client_ref = weakref.ref(client)

    def take() -> Any:
        return own() if own is not None else read(client_ref())

    async def get_output_async() -> Any:
        if not run.active:
            return await take()
        _RUN.set(run)  # in the handler's task: what `iteration_stats` reads
        if queue.empty():
            run.catch_up.record()  # caught up: the handler is about to wait
        try:
            outputs = await take()
        except BaseException:
            run.catch_up.record()  # what stock had recorded by now
            raise
        run.took(outputs)
        if waiting and run.coalesced:
            return merge_waiting(outputs, queue, waiting, run)
        return outputs

    client.get_output_async = get_output_async


def waiting_items(queue: Any) -> deque[Any] | None:
    """The items of the client's output queue, which the merge reads ahead in (an
    `asyncio.Queue` keeps them in its deque `_queue`); None for any other queue."""
    items = getattr(queue, "_queue", None)
    return items if type(queue) is asyncio.Queue and type(items) is deque else None


class Merged:
    """Messages the handler takes as one (`message`): their outputs, in order, and a
    timestamp of its own by which `process_outputs` knows it."""

    __slots__ = ("message", "messages", "token")

    def __init__(self, messages: list[Any]) -> None:
        first = messages[0]
        self.messages = messages
        # A float object no message has: `process_outputs` gets it by identity.
        self.token = first.timestamp + 0.0
        outputs = [eco for msg in messages for eco in msg.outputs]
        self.message = msgspec.structs.replace(first, outputs=outputs, timestamp=self.token)


# A message that reports missed multimodal items is never merged behind another: the
# handler walks a message's misses for P0 (0.33 before, 0.32 after processing it), and
# a merged read that ends early (aborts, an error) must not have walked a later one's.
_misses_of = attrgetter("mm_cache_miss_hashes")


def merge_waiting(first: Any, queue: asyncio.Queue[Any], waiting: deque[Any], run: _Run) -> Any:
    """`first`, or one message made of it and the engine-output messages waiting right
    behind it that fit with it in one chunk and come from its engine."""
    if type(first) is not EngineCoreOutputs or not first.outputs or type(first.timestamp) is not float:
        return first
    engine, room = first.engine_index, run.chunk_size - len(first.outputs)
    messages = [first]
    while waiting:
        nxt = waiting[0]
        if (type(nxt) is not EngineCoreOutputs or nxt.engine_index != engine or not nxt.outputs
                or len(nxt.outputs) > room or type(nxt.timestamp) is not float
                or any(map(_misses_of, nxt.outputs))):
            break
        messages.append(queue.get_nowait())
        room -= len(nxt.outputs)
    if len(messages) == 1:
        return first
    run.merged = Merged(messages)
    run.catch_up.merges += 1
    run.catch_up.merged_messages += len(messages)
    return run.merged.message


def process_merged(engine: Any, run: _Run, waiting: deque[Any]) -> None:
    """Give the engine's output processor (this instance) a `process_outputs` that
    processes a merged message as its messages, one after the other."""
    processor = engine.output_processor
    inner = processor.process_outputs
    renderer = engine.renderer

    def process_outputs(outputs: Any, timestamp: Any = None, iteration_stats: Any = None,
                        *args: Any, **kwargs: Any) -> Any:
        merged = run.merged
        if merged is None or timestamp is not merged.token:
            return inner(outputs, timestamp, iteration_stats, *args, **kwargs)
        run.merged = None
        return _process_each(merged, inner, iteration_stats, processor, renderer, waiting, run)

    processor.process_outputs = process_outputs


def _process_each(merged: Merged, inner: Callable[..., Any], iteration_stats: Any, processor: Any,
                  renderer: Any, waiting: deque[Any], run: _Run) -> Any:
    """Each merged message's outputs, then what the handler does after a message; the
    handler does that for the last one processed, which this makes the merged
    message's. A message with aborts (or an error) ends it: the rest go back."""
    messages = merged.messages
    earlier: list[Any] = []  # request outputs of the messages before (LLMEngine's kind)
    for i, msg in enumerate(messages):
        if i:
            run.catch_up.stats_for(msg.engine_index)  # the message's IterationStats()
        try:
            result = inner(msg.outputs, msg.timestamp, iteration_stats, weight_version=msg.weight_version)
        except BaseException:
            _put_back(waiting, messages[i + 1:], run)
            raise
        if result.reqs_to_abort or i == len(messages) - 1:
            _put_back(waiting, messages[i + 1:], run)
            merged.message.scheduler_stats = msg.scheduler_stats
            if earlier:
                result.request_outputs[:0] = earlier
            return result
        earlier.extend(result.request_outputs)
        # The handler's steps after a message (async_llm.AsyncLLM._run_output_handler).
        processor.update_scheduler_stats(msg.scheduler_stats)
        if run.logger_ref[0]:
            run.logger_ref[0].record(engine_idx=msg.engine_index, scheduler_stats=msg.scheduler_stats,
                                     iteration_stats=iteration_stats, mm_cache_stats=renderer.stat_mm_cache())
    raise AssertionError("unreachable: the last message returns")


def _put_back(waiting: deque[Any], messages: list[Any], run: _Run) -> None:
    """Messages taken from the queue and not processed, first in line again."""
    waiting.extendleft(reversed(messages))
    run.catch_up.merged_messages -= len(messages)


def handler_why_not(engine: Any) -> str | None:
    """Why this engine's handler must be vLLM's own (None: it can be ours)."""
    if not engine.log_stats or engine.logger_manager is None:
        return "statistics are off"
    if not isinstance(engine.engine_core, AsyncMPClient):
        return f"the engine client is a {type(engine.engine_core).__name__}"
    if type(engine.engine_core).get_output_async is not AsyncMPClient.get_output_async:
        return f"{type(engine.engine_core).__name__} reads its outputs its own way"
    return loggers_why_not(engine.logger_manager)
