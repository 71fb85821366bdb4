"""vLLM's `AsyncLLM._run_output_handler` with the catch-up hooks (catchup.py: statistics
recorded once per catch-up) against the same handler without them.

Both run on a real AsyncLLM's parts: vLLM's AsyncMPClient (its output queue, its
`get_output_async`, and its `abort_requests_async` sending on a real zmq socket), this
package's output processor with vLLM's collectors (wired to drop missed items as the
plugin wires it, or not, so that only the handler does), vLLM's StatLoggerManager with
its default loggers for two engines (the logging ones included), and the tiny model's
renderer with its real P0 multimodal cache. The engine's messages (hypothesis-generated:
outputs with events, prefill statistics, stop strings, finishes and misses, scheduler
statistics, messages bigger than a chunk, two engines, and the renderer counting a
multimodal request while a message is processed) arrive in bursts; after each burst,
once the handler waits for the next message, both sides must hold the same: every
collector's output, the aborts sent to the engine, whether P0's cache still serves the
missed item, every sample of every Prometheus metric the logger holds, and the whole
state of vLLM's logging stat loggers. The frontend clock is injected (both sides read it
once per message with outputs)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from typing import Any

import pytest
import zmq
import zmq.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from output_processor_support import Side
from test_differential_stats import TextWalk, _build, _specs, outputs_form
from vllm.v1.engine import EngineCoreOutputs, FinishReason
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.core_client import AsyncMPClient, BackgroundResources
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.metrics import stats as vllm_stats
from vllm.v1.metrics.loggers import PerEngineStatLoggerAdapter, PrometheusStatLogger, StatLoggerManager
from vllm.v1.metrics.stats import PrefixCacheStats, SchedulerStats
from vllm.v1.serial_utils import MsgpackEncoder

from vllm_mmretry import _patching, prom
from vllm_mmretry.output_processor import OutputProcessor
from vllm_mmretry.vllm_adapter import adapter
from vllm_mmretry.vllm_adapter import output_handler as handler_module

TEXT = "The quick brown fox jumps over the lazy dog.\nA cab of zzz, the end."
CHUNK = 4  # VLLM_V1_OUTPUT_PROC_CHUNK_SIZE here: messages above it are chunked
MISSED = "abc123"  # the multimodal hash the engine reports missing
_addresses = itertools.count()


@pytest.fixture(scope="module")
def text_tokens(tiny_tokenizer: Any) -> list[int]:
    return tiny_tokenizer.encode(TEXT, add_special_tokens=False)


@pytest.fixture(scope="module")
def renderers(vllm_config: Any) -> list[Any]:
    """One renderer per side (each has its own multimodal cache statistics)."""
    from vllm.renderers import renderer_from_config

    return [renderer_from_config(vllm_config) for _ in range(2)]


class Clock:
    """`time` for vLLM's stats module and the handler: `time()` counts up."""

    def __init__(self) -> None:
        self.now = 1000.0

    def time(self) -> float:
        self.now += 0.25
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def stock_start() -> Any:
    return _patching.original(AsyncLLM, "_run_output_handler")


def ours_start(engine: Any) -> Any:
    """The adapter's handler; returns its CatchUp."""
    seam = adapter().output_handler_seam()
    assert not isinstance(seam, str), seam
    assert seam.why_not(engine) is None
    return seam.start(engine)


class _AsyncLLM(AsyncLLM):
    """vLLM's AsyncLLM, without the shutdown at collection (it has no engine here)."""

    def __del__(self) -> None:
        pass


class Served:
    """An AsyncLLM as its output handler sees it, with a real client and loggers."""

    def __init__(self, tokenizer: Any, vllm_config: Any, renderer: Any, wired: bool = True) -> None:
        self.ctx = zmq.asyncio.Context()
        address = f"inproc://catchup-{next(_addresses)}"
        self.engine_side = self.ctx.socket(zmq.PULL)
        self.engine_side.bind(address)
        client = object.__new__(AsyncMPClient)
        client.resources = BackgroundResources(ctx=self.ctx)
        client.resources.output_queue_task = asyncio.get_running_loop().create_future()
        client.outputs_queue = asyncio.Queue()
        client.input_socket = self.ctx.socket(zmq.PUSH)
        client.input_socket.connect(address)
        client.encoder = MsgpackEncoder()
        client.core_engine = b"\x00\x00"
        self.client = client
        engine = object.__new__(_AsyncLLM)
        engine.engine_core = client
        engine.log_stats = True
        engine.logger_manager = default_stat_loggers(vllm_config)
        prom.speed_up([engine.logger_manager])  # what the plugin does to a served engine
        renderer._mm_cache_stats = type(renderer._mm_cache_stats)()
        seed_missed_hash(renderer)
        engine.renderer = renderer
        engine.output_handler = None
        self.side = Side(OutputProcessor(tokenizer, log_stats=True), async_mode=True)
        engine.output_processor = self.side.op
        if wired:  # as the plugin wires a served engine's output processor (it drops misses itself)
            self.side.op.mm_processor_cache = adapter().engine_renderer(engine)
        self.engine = engine
        self.seen: list[Any] = []

    async def settle(self) -> None:
        """Until the handler waits on an empty queue (or has ended)."""
        queue, task = self.client.outputs_queue, self.engine.output_handler
        for _ in range(10_000):
            if task.done() or (queue.empty() and any(not f.done() for f in queue._getters)):
                return
            await asyncio.sleep(0)
        raise AssertionError("the handler never caught up")

    def aborts(self) -> list[list[bytes]]:
        sent = []
        while True:
            try:
                sent.append([bytes(f) for f in self.engine_side.recv_multipart(flags=zmq.NOBLOCK)])
            except zmq.Again:
                return sent

    async def observe(self) -> None:
        """What any other task could see of the statistics whenever it runs: each
        distinct state, in order (the handler yields between the chunks of a big
        message, and when it waits)."""
        while True:
            state = (prometheus_form(self.engine.logger_manager), logging_form(self.engine.logger_manager))
            if not self.seen or self.seen[-1] != state:
                self.seen.append(state)
            await asyncio.sleep(0)

    def snapshot(self) -> dict[str, Any]:
        drained = self.side.drain()
        return {
            "outputs": {k: outputs_form([v]) if not isinstance(v, Exception) else repr(v)
                        for k, v in drained.items()},
            "aborts": self.aborts(),
            "p0_serves_missed": p0_serves(self.engine.renderer, MISSED),
            "prometheus": prometheus_form(self.engine.logger_manager),
            "logging": logging_form(self.engine.logger_manager),
        }

    def close(self) -> None:
        if self.engine.output_handler is not None:
            self.engine.output_handler.cancel()
        self.client.input_socket.close(linger=0)
        self.engine_side.close(linger=0)
        self.ctx.term()


def default_stat_loggers(vllm_config: Any) -> StatLoggerManager:
    """vLLM's default stat loggers for engines 0 and 1, the logging ones included: vLLM
    adds those only where its logger would print INFO, which under pytest it would not."""
    from vllm.v1.metrics import loggers

    level = loggers.logger.level
    loggers.logger.setLevel(logging.INFO)
    try:
        manager = StatLoggerManager(vllm_config=vllm_config, engine_idxs=[0, 1])
    finally:
        loggers.logger.setLevel(level)
    assert logging_form(manager), "no logging stat loggers"
    return manager


def seed_missed_hash(renderer: Any) -> None:
    """P0's sender cache holds the item the engine will report missing, and no
    invalidation is pending (so each side's handler must drop it itself)."""
    from vllm.multimodal.inputs import MultiModalKwargsItem

    renderer.mm_processor_cache.clear_cache()
    renderer.mm_processor_cache.get_and_update_item((MultiModalKwargsItem.dummy(), []), MISSED)
    if hasattr(renderer, "_pending_mm_cache_invalidations"):  # vLLM 0.33's queue
        renderer._pending_mm_cache_invalidations.clear()


def p0_serves(renderer: Any, mm_hash: str) -> bool:
    """P0 would still send `mm_hash` by hash only at its next render."""
    pending = getattr(renderer, "_pending_mm_cache_invalidations", set())
    return bool(renderer.mm_processor_cache.is_cached_item(mm_hash)) and mm_hash not in pending


def prometheus_form(manager: Any) -> list[Any]:
    out = []
    for lg in manager.stat_loggers:
        if isinstance(lg, PrometheusStatLogger):
            for m in prom.metric_children(lg):
                if not m._is_parent():
                    out.append((m._name, m._labelvalues, prom.samples(m)))
    return sorted(out, key=repr)


def _form(obj: Any, depth: int = 0) -> Any:
    """Every attribute, recursively (deques and lists as lists), by repr at the leaves."""
    if depth > 4:
        return repr(obj)
    if isinstance(obj, list | tuple | deque):
        return [_form(x, depth + 1) for x in obj]
    if isinstance(obj, dict):
        return sorted((repr(k), _form(v, depth + 1)) for k, v in obj.items())
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith("vllm."):
        return (type(obj).__name__, sorted((k, _form(v, depth + 1)) for k, v in vars(obj).items()
                                           if k not in ("vllm_config", "last_log_time")))
    return repr(obj)


def logging_form(manager: Any) -> list[Any]:
    return [_form(lg.per_engine_stat_loggers) for lg in manager.stat_loggers
            if isinstance(lg, PerEngineStatLoggerAdapter)]


# ------------------------------------------------------------------ generation


def _plan(data: st.DataObject, live: list[str], prompt_len: dict[str, int],
          tokens: list[int]) -> list[dict[str, Any]]:
    """Bursts of engine messages; each burst arrives at once."""
    walk = TextWalk(tokens, prompt_len)
    engine_ts = 5000.0
    bursts = []
    for _ in range(data.draw(st.integers(1, 5), label="bursts")):
        burst = []
        for _ in range(data.draw(st.integers(1, 8), label="messages")):
            new_ts = engine_ts + data.draw(st.floats(0.001, 1.0))
            outputs = []
            for rid in [r for r in live if data.draw(st.sampled_from([True, True, False]))]:
                step = walk.step(data, rid, engine_ts, new_ts, 3, st.sampled_from([0] * 8 + [1]))
                step["miss"] = data.draw(st.sampled_from([None] * 12 + [[MISSED]]))
                if step["miss"]:
                    step["finish"] = FinishReason.ERROR
                outputs.append((rid, step))
            sched = None
            if data.draw(st.integers(0, 3)) == 0:
                sched = (data.draw(st.integers(0, 9)), data.draw(st.integers(0, 9)),
                         data.draw(st.floats(0, 1)), data.draw(st.integers(0, 4)), data.draw(st.integers(0, 4)))
            if not outputs and sched is None:
                continue  # the output task queues no such message
            # a multimodal request rendered while the handler works on this message
            render = data.draw(st.sampled_from([None] * 6 + [(1, 0), (2, 1)])) if outputs else None
            burst.append({"engine": data.draw(st.sampled_from([0, 0, 0, 1])), "outputs": outputs,
                          "sched": sched, "ts": new_ts, "render": render})
            engine_ts = new_ts
        mm = data.draw(st.none() | st.tuples(st.integers(0, 3), st.integers(0, 3)))
        bursts.append({"messages": burst, "mm": mm})
    return bursts


def render_during(served: Served, renderer: Any, plan: list[dict[str, Any]]) -> None:
    """The renderer counts a multimodal request while the handler processes a message
    that says so (the first slice of it): what a renderer thread may do meanwhile."""
    renders = {msg["ts"]: msg["render"] for burst in plan for msg in burst["messages"] if msg.get("render")}
    op = served.engine.output_processor
    process = op.process_outputs

    def process_outputs(outputs: Any, timestamp: float | None = None, *args: Any, **kwargs: Any) -> Any:
        out = process(outputs, timestamp, *args, **kwargs)
        render = renders.pop(timestamp, None)
        if render is not None:
            renderer._mm_cache_stats.record(*render)
        return out

    op.process_outputs = process_outputs


def _message(msg: dict[str, Any]) -> EngineCoreOutputs:
    outputs = []
    for rid, step in msg["outputs"]:
        eco = _build(rid, step, None)
        eco.mm_cache_miss_hashes = step["miss"]
        outputs.append(eco)
    sched = None
    if msg["sched"] is not None:
        running, waiting, usage, queries, hits = msg["sched"]
        sched = SchedulerStats(num_running_reqs=running, num_waiting_reqs=waiting, kv_cache_usage=usage,
                               prefix_cache_stats=PrefixCacheStats(requests=1, queries=queries + hits, hits=hits))
    return EngineCoreOutputs(engine_index=msg["engine"], outputs=outputs, scheduler_stats=sched,
                             timestamp=msg["ts"])


async def run_side(start: Any, specs: list[Any], arrivals: list[float], plan: list[dict[str, Any]],
                   dead: bool, wired: bool, tokenizer: Any, vllm_config: Any,
                   renderer: Any) -> list[dict[str, Any]]:
    clock = Clock()
    saved = vllm_stats.time, handler_module.time
    vllm_stats.time = handler_module.time = clock  # type: ignore[assignment]
    served = Served(tokenizer, vllm_config, renderer, wired)
    try:
        for spec, arrival in zip(specs, arrivals, strict=True):
            served.side.add(spec, arrival=arrival)
        render_during(served, renderer, plan)
        start(served.engine)
        observer = asyncio.create_task(served.observe())
        snapshots = []
        for i, burst in enumerate(plan):
            if burst["mm"] is not None:
                renderer._mm_cache_stats.record(*burst["mm"])
            for msg in burst["messages"]:
                served.client.outputs_queue.put_nowait(_message(msg))
            if dead and i == len(plan) - 1:  # the engine dies right after its last messages
                served.client.outputs_queue.put_nowait(EngineDeadError())
            await served.settle()
            snapshots.append(served.snapshot())
        assert served.engine.output_handler.done() == dead
        observer.cancel()
        snapshots.append({"seen": served.seen})
        return snapshots
    finally:
        served.close()
        vllm_stats.time, handler_module.time = saved


def _set_chunk_size(monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    import vllm.envs as envs

    monkeypatch.setenv("VLLM_V1_OUTPUT_PROC_CHUNK_SIZE", str(size))
    if envs._is_envs_cache_enabled():
        envs.__getattr__.cache_clear()
    assert envs.VLLM_V1_OUTPUT_PROC_CHUNK_SIZE == size


@pytest.mark.parametrize("chunk", [CHUNK, 64], ids=["small_chunks", "roomy_chunks"])
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_same_outputs_aborts_and_statistics_as_vllms_handler(
        tiny_tokenizer: Any, vllm_config: Any, renderers: list[Any], text_tokens: list[int],
        monkeypatch: pytest.MonkeyPatch, chunk: int, data: st.DataObject) -> None:
    """With small chunks big messages are chunked and small ones merged in twos; with
    roomy ones the hooked handler reads most of a burst's messages as one (`Merged`), so
    stop strings, misses and sibling aborts happen in the middle of a merged read."""
    _set_chunk_size(monkeypatch, chunk)
    same_as_vllms_handler(tiny_tokenizer, vllm_config, renderers, text_tokens, data)


def same_as_vllms_handler(tiny_tokenizer: Any, vllm_config: Any, renderers: list[Any],
                          text_tokens: list[int], data: st.DataObject) -> None:
    specs = _specs(data, text_tokens)
    arrivals = [1000.0 + data.draw(st.floats(0.0, 1.0)) for _ in specs]
    probe = Side(OutputProcessor(tiny_tokenizer, log_stats=False), async_mode=True)
    live = [cid for spec in specs for cid in probe.add(spec)]
    prompt_len = {cid: len(spec.prompt_ids) for spec in specs for cid in probe.children[spec.request_id]}
    plan = _plan(data, live, prompt_len, text_tokens)
    dead = data.draw(st.booleans(), label="engine_dies")
    # Unwired, only the handlers drop missed items from P0 (on 0.33: before process_outputs).
    wired = data.draw(st.booleans(), label="output_processor_drops_misses")
    want, got = (asyncio.run(run_side(start, specs, arrivals, plan, dead, wired, tiny_tokenizer, vllm_config, r))
                 for start, r in ((stock_start(), renderers[0]), (ours_start, renderers[1])))
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        assert b == a, f"after burst {i}"


def test_a_catch_up_is_recorded_once(tiny_tokenizer: Any, vllm_config: Any, renderers: list[Any],
                                     text_tokens: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Forty messages waiting at once: one record for their iteration statistics
    (and one per message with scheduler statistics), the token histogram still
    observed once per message."""
    _set_chunk_size(monkeypatch, 128)  # vLLM's default: all forty fit in one chunk
    async def run() -> tuple[Any, list[Any]]:
        served = Served(tiny_tokenizer, vllm_config, renderers[1])
        try:
            specs = _specs_plain(text_tokens)
            for spec in specs:
                served.side.add(spec)
            catch_up = ours_start(served.engine)
            for i in range(40):
                served.client.outputs_queue.put_nowait(_message(plain_message(
                    i, [s.request_id for s in specs], text_tokens[i % 5],
                    sched=(1, 0, 0.5, 2, 1) if i % 10 == 0 else None)))
            await served.settle()
            return catch_up, prometheus_form(served.engine.logger_manager)
        finally:
            served.close()

    catch_up, samples = asyncio.run(run())
    assert (catch_up.merges, catch_up.merged_messages) == (1, 40)  # read as one message
    assert catch_up.messages == 40
    assert catch_up.records == 1 + 4  # the iteration part once, scheduler parts per message
    counts = {labels[1]: s[2] for name, labels, ss in samples if name == "vllm:iteration_tokens_total"
              for s in ss if s[0] == "_count"}
    assert counts == {"0": "40.0", "1": "0.0"}


def test_a_wrapper_on_the_clients_read_stays_in_its_path(
        tiny_tokenizer: Any, vllm_config: Any, renderers: list[Any], text_tokens: list[int]) -> None:
    """Someone's wrapper on the client instance's `get_output_async` (a fault injector,
    a tracer) is what the hooked handler reads through, as vLLM's handler would; the
    hook of an earlier handler, cancelled before the wrapper went on, passes through."""
    async def run() -> tuple[Any, Any, list[int]]:
        served = Served(tiny_tokenizer, vllm_config, renderers[1])
        try:
            for spec in _specs_plain(text_tokens):
                served.side.add(spec)
            first = ours_start(served.engine)
            await served.settle()
            served.engine.output_handler.cancel()
            await asyncio.sleep(0)
            assert served.engine.output_handler.done()
            served.engine.output_handler = None
            seen: list[int] = []
            inner = served.client.get_output_async

            async def traced() -> Any:
                outputs = await inner()
                seen.append(len(outputs.outputs))
                return outputs

            served.client.get_output_async = traced
            second = ours_start(served.engine)
            for i in range(3):
                served.client.outputs_queue.put_nowait(_message(plain_message(i, ["p0", "p1"], text_tokens[i])))
            await served.settle()
            return first, second, seen
        finally:
            served.close()

    first, second, seen = asyncio.run(run())
    assert seen == [2, 2, 2]
    assert (second.messages, second.records) == (3, 1)
    assert (first.messages, first.records) == (0, 0)


def test_a_render_during_a_catch_up_is_observed_as_stock_observes_it(
        tiny_tokenizer: Any, vllm_config: Any, renderers: list[Any], text_tokens: list[int]) -> None:
    """The renderer counts requests while the handler works through a catch-up (after
    the first message took what it had counted before): each engine's logging logger
    observes those statistics after the first message's, as in stock."""
    specs = _specs_plain(text_tokens)
    rids = [s.request_id for s in specs]
    plan = [{"mm": (2, 1), "messages": [
        plain_message(i, rids, text_tokens[i], engine=engine, render=render)
        for i, (engine, render) in enumerate([(0, None), (1, (1, 0)), (0, (3, 2)), (0, None)])]}]
    want, got = (asyncio.run(run_side(start, specs, [1000.0] * len(specs), plan, False, True,
                                      tiny_tokenizer, vllm_config, r))
                 for start, r in ((stock_start(), renderers[0]), (ours_start, renderers[1])))
    assert got == want
    engine0 = dict(want[0]["logging"][0])[repr(0)]
    queue = dict(dict(engine0[1])["mm_caching_metrics"][1])["query_queue"]
    assert queue == [["1", "2", "1"], ["1", "3", "2"]]  # the burst's, then the render's


def test_a_stop_string_in_a_merged_read_is_aborted_before_the_rest_is_read(
        tiny_tokenizer: Any, vllm_config: Any, renderers: list[Any], text_tokens: list[int],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One request of three stops on a stop string in the middle of a burst of waiting
    messages: the merged read ends after that message, whose abort goes to the engine
    (its own message, as stock sends it) before the rest are read, merged again."""
    from output_processor_support import ReqSpec

    _set_chunk_size(monkeypatch, 128)  # the whole burst fits in one chunk

    specs = [ReqSpec(request_id=f"s{i}", external_id=f"s{i}", prompt_ids=text_tokens[:3],
                     stop=["zzz"] if i == 1 else None) for i in range(3)]
    rids = [s.request_id for s in specs]
    sched = (3, 0, 0.5, 2, 1)
    plan = [{"mm": None, "messages": [plain_message(i, rids, text_tokens[i], sched=sched if i % 7 == 0 else None)
                                      for i in range(len(text_tokens))]}]
    catch_ups: list[Any] = []

    def start(engine: Any) -> None:
        catch_ups.append(ours_start(engine))

    want, got = (asyncio.run(run_side(s, specs, [1000.0] * 3, plan, False, True, tiny_tokenizer, vllm_config, r))
                 for s, r in ((stock_start(), renderers[0]), (start, renderers[1])))
    assert got == want
    assert len(want[0]["aborts"]) == 1  # the stop string's
    (catch_up,) = catch_ups
    assert catch_up.merges == 2 and catch_up.merged_messages == len(text_tokens)


def plain_message(i: int, rids: list[str], token: int, engine: int = 0, sched: Any = None,
                  render: tuple[int, int] | None = None) -> dict[str, Any]:
    """A planned message (as `_plan` draws them): one token for each of `rids`, nothing
    else happening, at engine time 5000 + i."""
    step = {"tokens": [token], "finish": None, "events": None, "prefill": None, "nans": 0, "miss": None}
    return {"engine": engine, "ts": 5000.0 + i, "sched": sched, "render": render,
            "outputs": [(rid, dict(step)) for rid in rids]}


def _specs_plain(tokens: list[int]) -> list[Any]:
    from output_processor_support import ReqSpec

    return [ReqSpec(request_id=f"p{i}", external_id=f"p{i}", prompt_ids=tokens[:3]) for i in range(3)]
