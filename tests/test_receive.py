"""Ready-first receive (receive.py) against vLLM's own output task.

vLLM's `AsyncMPClient._ensure_output_queue_task` runs unchanged on a real zmq PULL
socket; a real PUSH socket sends what an engine core sends (vLLM's `MsgpackEncoder`
of `EngineCoreOutputs`: outputs, scheduler stats, utility replies and failures, and
the engine-dead frame). Stock and ready-first must leave the same things, in the same
order, in the client's output queue and utility futures, on hypothesis-generated
message streams sent in bursts (messages waiting) and one by one (the task waiting)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq
import zmq.asyncio
from engine_outputs_support import canon, reader
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason, UtilityOutput
from vllm.v1.engine.core_client import AsyncMPClient, BackgroundResources
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder, UtilityResult

from vllm_mmretry import _patching, receive
from vllm_mmretry.vllm_adapter import adapter
from vllm_mmretry.vllm_adapter.base import ReceiveSeam

ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"
_addresses = itertools.count()


def vllm_start() -> Any:
    """vLLM's own output-task starter, whether or not the plugin patched it."""
    return _patching.original(AsyncMPClient, "_ensure_output_queue_task")


class Wire:
    """A client as vLLM's output task sees it, on a real socket pair."""

    def __init__(self, ready_first: bool, native: bool = False) -> None:
        self.ctx = zmq.asyncio.Context()
        address = f"inproc://receive-{next(_addresses)}"
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(address)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(address)
        self.waits = 0
        self.sent = 0
        self._count_waits()
        self.native = native and receive.make_natively_received(self.pull)
        assert self.native == native
        if ready_first and not native:
            receive.make_ready_first(self.pull)
        client = object.__new__(AsyncMPClient)
        client.resources = BackgroundResources(ctx=self.ctx)
        client.resources.output_socket = self.pull
        client.decoder = MsgpackDecoder(EngineCoreOutputs)
        client.utility_results = {}
        client.outputs_queue = asyncio.Queue()
        self.client = client
        self.encoder = MsgpackEncoder()

    def _count_waits(self) -> None:
        # pyzmq's Future-based receive, counted per call (instrumentation only).
        add = self.pull._add_recv_event

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.waits += 1
            return add(*args, **kwargs)

        self.pull._add_recv_event = counted

    def start(self, start: Any) -> None:
        start(self.client)

    async def send(self, message: EngineCoreOutputs | bytes) -> None:
        frames = [message] if isinstance(message, bytes) else list(self.encoder.encode(message))
        await self.push.send_multipart(frames, copy=False)
        self.sent += 1

    def expect_utility(self, call_id: int) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.client.utility_results[call_id] = future
        return future

    def close(self) -> None:
        task = self.client.resources.output_queue_task
        if task is not None:
            task.cancel()
        self.push.close(linger=0)
        self.pull.close(linger=0)
        self.ctx.term()


def as_tuple(item: Any) -> Any:
    """A queue item in comparable form (every field, with its type)."""
    if isinstance(item, BaseException):
        return ("raised", type(item).__name__)
    return canon(item)


output_st = st.builds(
    EngineCoreOutput,
    request_id=st.text("abc-0123", min_size=1, max_size=6),
    new_token_ids=st.lists(st.integers(0, 2**31 - 1), max_size=4),
    finish_reason=st.none() | st.sampled_from(list(FinishReason)),
    stop_reason=st.none() | st.integers(0, 5) | st.text(max_size=3),
    num_nans_in_logits=st.integers(0, 3),
    mm_cache_miss_hashes=st.none() | st.lists(st.text("0123456789abcdef", min_size=1, max_size=8), max_size=2),
)
stats_st = st.none() | st.builds(SchedulerStats, num_running_reqs=st.integers(0, 9),
                                 num_waiting_reqs=st.integers(0, 9))
outputs_st = st.builds(
    EngineCoreOutputs,
    engine_index=st.integers(0, 3),
    outputs=st.lists(output_st, max_size=5),
    scheduler_stats=stats_st,
    timestamp=st.floats(0, 1e9, allow_nan=False),
    finished_requests=st.none() | st.sets(st.text("xyz", min_size=1, max_size=3), max_size=2),
)
# A message: engine outputs, or a utility reply (its result, or a failure).
message_st = st.one_of(
    outputs_st,
    st.tuples(st.just("utility"), st.integers(-5, 5) | st.text(max_size=4)),
    st.tuples(st.just("failure"), st.text(min_size=1, max_size=8)),
)
# Bursts: each inner list is sent at once, then the sender yields until the task
# has drained the socket (so the task meets both waiting messages and none).
stream_st = st.lists(st.lists(message_st, min_size=1, max_size=6), min_size=1, max_size=5)


async def run_stream(ready_first: bool, bursts: list[list[Any]], dead: bool,
                     native_decode: bool = False, native_receive: bool = False) -> dict[str, Any]:
    wire = Wire(ready_first, native=native_receive)
    if native_decode:
        wire.client.decoder = receive.NativeOutputsDecoder(wire.client.decoder, reader())
    try:
        wire.start(vllm_start())
        utilities: list[asyncio.Future[Any]] = []
        call_ids = itertools.count(1)
        for burst in bursts:
            for message in burst:
                if isinstance(message, tuple):
                    call_id = next(call_ids)
                    utilities.append(wire.expect_utility(call_id))
                    kind, value = message
                    await wire.send(EngineCoreOutputs(utility_output=UtilityOutput(
                        call_id,
                        failure_message=value if kind == "failure" else None,
                        result=UtilityResult(value) if kind == "utility" else None)))
                else:
                    await wire.send(message)
            await drained(wire)
        if dead:
            await wire.send(ENGINE_CORE_DEAD)
        else:
            await wire.send(EngineCoreOutputs(outputs=[EngineCoreOutput("end", [0])], timestamp=1.0))
        queued = []
        while True:
            item = await asyncio.wait_for(wire.client.outputs_queue.get(), 10)
            queued.append(as_tuple(item))
            if isinstance(item, BaseException) or (item.outputs[-1:] and item.outputs[-1].request_id == "end"):
                break
        results = [("raised", str(f.exception())) if f.exception() else ("result", f.result())
                   for f in utilities]
        return {"queued": queued, "utilities": results, "waits": wire.waits,
                "engine_dead": wire.client.resources.engine_dead,
                "native": getattr(wire.client.decoder, "native", None)}
    finally:
        wire.close()


async def drained(wire: Wire) -> None:
    if wire.native:  # the thread owns the socket: ask it, not libzmq
        receiver = wire.pull.recv_multipart.__self__.receiver
        for _ in range(2000):
            if receiver.counts() == (wire.sent, 0):
                break
            await asyncio.sleep(0.001)
    for _ in range(200 if not wire.native else 0):
        if not wire.pull.get(zmq.EVENTS) & zmq.POLLIN:
            break
        await asyncio.sleep(0)
    for _ in range(3):
        await asyncio.sleep(0)


def seam_for(start: Any) -> ReceiveSeam:
    return ReceiveSeam(AsyncMPClient, start.__name__, lambda client: None)


def test_the_installed_starter_gives_the_task_the_native_decoder() -> None:
    """Once, before the task starts; the task then decodes with it."""
    seam = adapter().receive_seam()
    assert isinstance(seam, ReceiveSeam)
    start = receive._starting_task(vllm_start(), seam, ready_first=False, reader=reader)

    async def go() -> tuple[Any, Any, int]:
        wire = Wire(ready_first=False)
        try:
            vllms = wire.client.decoder
            start(wire.client)
            ours = wire.client.decoder
            start(wire.client)
            assert wire.client.decoder is ours
            await wire.send(EngineCoreOutputs(outputs=[EngineCoreOutput("a", [1])], timestamp=1.0))
            await asyncio.wait_for(wire.client.outputs_queue.get(), 10)
            return vllms, ours, ours.native
        finally:
            wire.close()

    vllms, ours, native = asyncio.run(go())
    assert isinstance(ours, receive.NativeOutputsDecoder) and ours.inner is vllms and native == 1


def test_install_builds_the_reader_when_a_client_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not at install: every process loads the plugin, only API-server clients decode.
    Built once per process, however many clients start."""
    owner, name = AsyncMPClient, "_ensure_output_queue_task"
    start = vllm_start()
    monkeypatch.setattr(_patching, "_originals", {})
    monkeypatch.setattr(owner, name, start)
    monkeypatch.setenv(receive.DECODE_SWITCH, "1")
    built: list[Any] = []
    monkeypatch.setattr(receive, "native_reader", lambda: built.append(reader()) or built[-1])
    assert receive.install() == [f"{owner.__name__}.{name}"]
    assert built == []

    async def go() -> list[Any]:
        wires = [Wire(ready_first=False), Wire(ready_first=False)]
        try:
            for wire in wires:
                getattr(owner, name)(wire.client)
            return [wire.client.decoder for wire in wires]
        finally:
            for wire in wires:
                wire.close()

    decoders = asyncio.run(go())
    assert len(built) == 1
    assert all(isinstance(d, receive.NativeOutputsDecoder) and d.reader is built[0]
               for d in decoders)


def test_the_adapter_knows_this_vllm_output_task() -> None:
    seam = adapter().receive_seam()
    assert isinstance(seam, ReceiveSeam), seam
    assert getattr(seam.owner, seam.method) is not None


def test_the_seam_is_vllms_task_while_receive_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a process where the plugin already wraps the starter (vLLM loaded the plugin,
    then doctor or a test asks), the adapter still checks vLLM's own starter."""
    owner, name = AsyncMPClient, "_ensure_output_queue_task"
    if not _patching.is_patched(owner, name):
        start = vllm_start()
        wrapped = receive._starting_task(start, seam_for(start), ready_first=True, reader=None)
        monkeypatch.setitem(_patching._originals, (owner, name), start)
        monkeypatch.setattr(owner, name, wrapped)
    assert getattr(owner, name) is not vllm_start()
    seam = adapter().receive_seam()
    assert isinstance(seam, ReceiveSeam), seam


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bursts=stream_st, dead=st.booleans())
def test_ready_first_queues_what_stock_queues(bursts: list[list[Any]], dead: bool) -> None:
    """Ready-first receive, alone and with the native decoder, against stock."""
    stock = asyncio.run(run_stream(False, bursts, dead))
    ours = asyncio.run(run_stream(True, bursts, dead))
    native = asyncio.run(run_stream(True, bursts, dead, native_decode=True))
    thread = asyncio.run(run_stream(False, bursts, dead, native_receive=True))
    same = {"queued", "utilities", "engine_dead"}
    assert {k: ours[k] for k in same} == {k: stock[k] for k in same}
    assert {k: native[k] for k in same} == {k: stock[k] for k in same}
    assert {k: thread[k] for k in same} == {k: stock[k] for k in same}
    assert thread["waits"] == 0  # pyzmq never read the socket
    if not dead:
        assert native["native"] >= 1  # at least the closing message was read natively
    assert stock["engine_dead"] is dead
    if dead:
        assert stock["queued"][-1] == ("raised", "EngineDeadError")


def test_waiting_messages_are_taken_without_pyzmq_futures() -> None:
    """A burst of 30 waiting messages: stock makes one Future per message, ours none
    for the waiting ones (so this fails if the fast path is never taken)."""
    burst = [EngineCoreOutputs(outputs=[EngineCoreOutput(f"r{i}", [i])], timestamp=float(i)) for i in range(30)]
    stock = asyncio.run(run_stream(False, [burst], dead=False))
    ours = asyncio.run(run_stream(True, [burst], dead=False))
    assert ours["queued"] == stock["queued"] and len(stock["queued"]) == 31
    assert stock["waits"] >= 31
    assert ours["waits"] <= 3


@contextlib.contextmanager
def prepared_pair(kind: str, prepare: Any) -> Iterator[tuple[Any, Any]]:
    """A connected inproc PUSH/PULL pair on a new asyncio context, `prepare(pull)` done;
    both closed and the context ended on the way out."""
    ctx = zmq.asyncio.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    try:
        address = f"inproc://{kind}-{next(_addresses)}"
        pull.bind(address)
        push.connect(address)
        if prepare is not None:
            prepare(pull)
        yield push, pull
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()


async def what_asyncio_makes_of_a_waiting_receive(prepare: Any) -> dict[str, Any]:
    """One waiting message's receive, after `prepare(pull)`, through each of asyncio's
    ways of taking a Future; the answers that show a done Future."""

    async def waiting_receive() -> Any:
        await push.send(b"m")
        for _ in range(200):  # until pyzmq would answer with a done Future too
            if pull.poll(0):
                break
            await asyncio.sleep(0.005)
        return pull.recv_multipart()

    async def others_ran_during_await() -> bool:
        ran = []
        asyncio.get_running_loop().call_soon(ran.append, 1)
        await (await waiting_receive())
        return bool(ran)

    with prepared_pair("asyncio", prepare) as (push, pull):
        got: dict[str, Any] = {}
        received = await waiting_receive()
        got["isfuture"] = asyncio.isfuture(received)
        got["done"] = (received.done(), received.cancelled(), received.exception())
        got["cancel"] = (received.cancel(), received.result())
        got["ensure_future is it"] = asyncio.ensure_future(received) is received
        got["wait_for 0"] = await asyncio.wait_for(await waiting_receive(), 0)
        got["wait_for 10"] = await asyncio.wait_for(await waiting_receive(), 10)
        got["gather"] = await asyncio.gather(await waiting_receive())
        got["shield"] = await asyncio.shield(await waiting_receive())
        done, _ = await asyncio.wait({await waiting_receive()})
        got["wait"] = [d.result() for d in done]
        called: list[Any] = []
        callback_of = await waiting_receive()
        callback_of.add_done_callback(called.append)
        await asyncio.sleep(0)
        got["callback"] = called == [callback_of]
        got["await yields"] = await others_ran_during_await()
        return got


def test_a_waiting_receive_is_a_done_future_to_asyncio() -> None:
    """pyzmq answers a receive whose message waits with a done Future; ours with a
    `Received`, which every asyncio way of taking a Future takes the same way."""
    stock = asyncio.run(what_asyncio_makes_of_a_waiting_receive(None))
    ours = asyncio.run(what_asyncio_makes_of_a_waiting_receive(receive.make_ready_first))
    assert ours == stock
    assert stock["isfuture"] and stock["cancel"] == (False, [b"m"]) and stock["gather"] == [[b"m"]]
    assert stock["await yields"] is False


# Multipart messages of raw frames (empty ones included).
multipart_st = st.lists(st.lists(st.binary(max_size=40), min_size=1, max_size=4), min_size=1, max_size=6)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=multipart_st, copy=st.booleans(), track=st.booleans())
def test_ready_first_receives_the_frames_pyzmq_receives(
        messages: list[list[bytes]], copy: bool, track: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiting multipart messages read through the ready-first socket and through
    pyzmq's own receive: the same frames, in the same order, of the same type."""
    read_by_frames = []

    def counted(*args: Any) -> Any:
        read_by_frames.append(1)
        return frames_of_message(*args)

    frames_of_message = receive.frames_of_message
    with monkeypatch.context() as m:
        m.setattr(receive, "frames_of_message", counted)
        ours = asyncio.run(frames_read(messages, copy, track, receive.make_ready_first))
    assert ours == asyncio.run(frames_read(messages, copy, track, None))
    assert [[frame for _, frame in message] for message in ours] == messages
    # copy=False (vLLM's) reads every waiting message frame by frame
    assert len(read_by_frames) == (0 if copy else len(messages))


def _as_native(sock: Any) -> None:
    assert receive.make_natively_received(sock)


async def cancelled_as_it_arrives(prepare: Any) -> str:
    """A receive that waits, whose message arrives in the same loop turn as its
    cancellation (the loop is blocked while the message comes in and the cancelling
    timer falls due, as with `asyncio.wait_for`): where the message ends up."""
    import time

    ctx, sync_ctx = zmq.asyncio.Context(), zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = sync_ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    if prepare is not None:
        prepare(pull)
    try:
        receiving = pull.recv_multipart(copy=False)
        waiting = asyncio.ensure_future(receiving)
        for _ in range(3):
            await asyncio.sleep(0)
        assert not waiting.done()
        asyncio.get_running_loop().call_later(0.01, waiting.cancel)
        push.send(b"m")
        time.sleep(0.2)  # blocks the loop: the message comes in, the timer falls due
        for _ in range(3):
            await asyncio.sleep(0)
        if not waiting.cancelled():
            return "kept by the cancelled receive"
        try:
            await asyncio.wait_for(pull.recv_multipart(copy=False), 2)
            return "left for the next receive"
        except TimeoutError:
            return "lost"
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        sync_ctx.term()
        ctx.term()


@pytest.mark.parametrize("prepare, kept", [
    (None, "kept by the cancelled receive"),  # pyzmq's Future has the message
    (receive.make_ready_first, "kept by the cancelled receive"),  # it is pyzmq's Future
    (_as_native, "left for the next receive"),  # the thread's queue keeps it
], ids=["pyzmq", "ready-first", "native-thread"])
def test_a_receive_cancelled_as_its_message_arrives_loses_nothing(prepare: Any, kept: str) -> None:
    """A coroutine around pyzmq's Future (ready-first before) was cancelled with the
    message in hand: the message was lost."""
    assert asyncio.run(cancelled_as_it_arrives(prepare)) == kept


async def frames_read(messages: list[list[bytes]], copy: bool, track: bool,
                      prepare: Any, late: bool = False) -> list[list[tuple[str, bytes]]]:
    """`messages` sent on a fresh socket pair, then read with `recv_multipart(copy,
    track)` after `prepare(pull)`; with `late`, one more message sent and read after
    them. Each message as (type name, bytes) per frame."""
    with prepared_pair("frames", prepare) as (push, pull):
        for message in messages:
            await push.send_multipart(message)
        got = [await asyncio.wait_for(pull.recv_multipart(copy=copy, track=track), 10)
               for _ in messages]
        if late:
            await push.send_multipart([b"late"])
            got.append(await asyncio.wait_for(pull.recv_multipart(copy=copy, track=track), 10))
        return [[(type(part).__name__, bytes(part)) for part in parts] for parts in got]


def test_the_installed_starter_makes_the_socket_ready_first() -> None:
    """The patched `_ensure_output_queue_task` (as install() builds it) wraps the
    socket once, before the task starts, and never a started client's socket."""
    seam = adapter().receive_seam()
    assert isinstance(seam, ReceiveSeam)
    start = receive._starting_task(vllm_start(), seam, ready_first=True, reader=None)

    async def go() -> tuple[bool, bool, Any]:
        wire = Wire(ready_first=False)
        try:
            assert not receive.is_ready_first(wire.pull)
            start(wire.client)
            first = receive.is_ready_first(wire.pull)
            recv = wire.pull.recv_multipart
            start(wire.client)  # vLLM calls it before every get; nothing changes
            again = wire.pull.recv_multipart is recv
            await wire.send(EngineCoreOutputs(outputs=[EngineCoreOutput("a", [1])], timestamp=1.0))
            item = await asyncio.wait_for(wire.client.outputs_queue.get(), 10)
            return first, again, item.outputs[0].request_id
        finally:
            wire.close()

    assert asyncio.run(go()) == (True, True, "a")


def test_a_started_client_calls_vllms_starter_directly(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM calls the starter before every read: once the task runs, the client's calls
    go to vLLM's starter without entering the wrapper (it would have nothing to do),
    outputs still flow, and the client holds no cycle through it."""
    owner, name = AsyncMPClient, "_ensure_output_queue_task"
    seam = adapter().receive_seam()
    assert isinstance(seam, ReceiveSeam)
    entered: list[int] = []

    def counted_socket(client: Any) -> Any:
        entered.append(1)
        return seam.output_socket(client)

    counting = ReceiveSeam(seam.owner, seam.method, counted_socket)
    monkeypatch.setattr(owner, name, receive._starting_task(vllm_start(), counting, ready_first=True,
                                                            reader=None))

    async def go() -> tuple[int, Any, bool, str]:
        wire = Wire(ready_first=False)
        try:
            for _ in range(3):
                wire.client._ensure_output_queue_task()
            entered_then = len(entered)  # before and after the one start
            task = wire.client.resources.output_queue_task
            wire.client._ensure_output_queue_task()
            await wire.send(EngineCoreOutputs(outputs=[EngineCoreOutput("a", [1])], timestamp=1.0))
            item = await asyncio.wait_for(wire.client.outputs_queue.get(), 10)
            return (entered_then, wire.client.resources.output_queue_task is task,
                    receive.is_ready_first(wire.pull), item.outputs[0].request_id)
        finally:
            wire.close()

    assert asyncio.run(go()) == (2, True, True, "a")
    client = object.__new__(AsyncMPClient)
    receive.hand_back(client, name, vllm_start())
    assert gc.get_referrers(client) == []  # only this frame's local refers to it


def test_a_started_task_is_left_alone() -> None:
    seam = adapter().receive_seam()
    assert isinstance(seam, ReceiveSeam)

    async def go() -> bool:
        wire = Wire(ready_first=False)
        try:
            vllm_start()(wire.client)
            before = wire.client.decoder
            receive._starting_task(vllm_start(), seam, ready_first=True, reader=reader)(wire.client)
            return receive.is_ready_first(wire.pull) or wire.client.decoder is not before
        finally:
            wire.close()

    assert asyncio.run(go()) is False


def test_a_closed_socket_raises_as_pyzmq_does() -> None:
    async def go(ready_first: bool) -> str:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.PULL)
        sock.bind(f"inproc://closed-{next(_addresses)}")
        if ready_first:
            receive.make_ready_first(sock)
        sock.close(linger=0)
        try:
            await sock.recv_multipart(copy=False)
        except zmq.ZMQError as e:
            return f"{type(e).__name__}: {e.errno}"
        finally:
            ctx.term()
        return "no error"

    assert asyncio.run(go(True)) == asyncio.run(go(False)) != "no error"


def _starts_nothing(self: Any) -> None:
    return None


def _reads_with_recv(self: Any) -> None:
    resources = self.resources
    output_socket = resources.output_socket
    decoder = self.decoder
    if resources.output_queue_task is None:
        async def process_outputs_socket() -> None:
            decoder.decode(await output_socket.recv(copy=False))

        resources.output_queue_task = process_outputs_socket


@pytest.mark.parametrize("start, why", [
    (_starts_nothing, "no longer uses"),
    (_reads_with_recv, "no longer reads output_socket.recv_multipart"),
    (len, "is not a Python function"),
])
def test_an_unknown_output_task_is_refused(start: Any, why: str) -> None:
    from vllm_mmretry.vllm_adapter import v0_32

    reason = v0_32._check_output_task(start)
    assert reason is not None and why in reason


# --- the native receive thread (VLLM_MMRETRY_NATIVE_RECEIVE=1) ---------------------


def receiver_of(sock: Any) -> Any:
    return sock.recv_multipart.__self__.receiver


@settings(max_examples=30, deadline=None)
@given(messages=multipart_st, copy=st.booleans(), track=st.booleans())
def test_the_native_thread_receives_the_frames_pyzmq_receives(
        messages: list[list[bytes]], copy: bool, track: bool) -> None:
    """Multipart messages (empty frames included) read through the native thread and
    through pyzmq: the same frames, in the same order, of the same type."""
    def natively(pull: Any) -> None:
        assert receive.make_natively_received(pull)

    ours = asyncio.run(frames_read(messages, copy, track, natively, late=True))
    assert ours == asyncio.run(frames_read(messages, copy, track, None, late=True))
    assert [[frame for _, frame in message] for message in ours] == [*messages, [b"late"]]


def test_close_stops_the_thread_and_a_waiting_task_ends_as_in_stock() -> None:
    """vLLM's shutdown (`BackgroundResources()` closes the socket) while the output
    task waits: the thread is joined before pyzmq's close, and the task's wait is
    cancelled as pyzmq cancels its own, so the queue ends with EngineDeadError."""
    async def go(native: bool) -> tuple[Any, bool]:
        wire = Wire(ready_first=False, native=native)
        receiver = receiver_of(wire.pull) if native else None
        try:
            wire.start(vllm_start())
            await wire.send(EngineCoreOutputs(outputs=[EngineCoreOutput("a", [1])], timestamp=1.0))
            first = await asyncio.wait_for(wire.client.outputs_queue.get(), 10)
            await asyncio.sleep(0.05)  # the task now waits for the next message
            wire.client.resources.output_queue_task = None  # only the socket is closed
            wire.pull.close(linger=0)
            last = await asyncio.wait_for(wire.client.outputs_queue.get(), 10)
            return [as_tuple(first), as_tuple(last)], receiver is not None and receiver.running
        finally:
            wire.close()

    ours, running = asyncio.run(go(True))
    assert ours == asyncio.run(go(False))[0]
    assert ours[-1] == ("raised", "EngineDeadError")
    assert running is False


def test_while_the_thread_owns_the_socket_the_loop_does_not_touch_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """pyzmq's `closed` asks libzmq (getsockopt) about the socket: the task's receive
    must not, while the thread may be polling that socket."""
    asked: list[int] = []
    closed = zmq.asyncio.Socket.closed  # pyzmq's property, inherited
    watched: list[Any] = []

    def counted(sock: Any) -> bool:
        if sock in watched:  # not other tests' sockets, finalized meanwhile
            asked.append(1)
        return bool(closed.__get__(sock))

    async def go() -> list[str]:
        wire = Wire(ready_first=False, native=True)
        watched.append(wire.pull)
        try:
            wire.start(vllm_start())
            monkeypatch.setattr(zmq.asyncio.Socket, "closed", property(counted))
            for i in range(20):
                await wire.send(EngineCoreOutputs(outputs=[EngineCoreOutput(f"r{i}", [i])], timestamp=1.0))
            got = [(await asyncio.wait_for(wire.client.outputs_queue.get(), 10)).outputs[0].request_id
                   for _ in range(20)]
            monkeypatch.undo()
            return got
        finally:
            wire.close()

    assert asyncio.run(go()) == [f"r{i}" for i in range(20)]
    assert asked == []


def test_vllms_resource_cleanup_stops_the_thread_and_closes_its_eventfd() -> None:
    """The eventfd is released with the socket, not when the receiver is collected."""
    async def go() -> tuple[bool, bool, bool]:
        wire = Wire(ready_first=False, native=True)
        receiver = receiver_of(wire.pull)
        fd = receiver.fileno()
        try:
            wire.start(vllm_start())
            running = receiver.running
            wire.client.resources()  # vLLM's finalizer: closes sockets, cancels the task
            await asyncio.sleep(0)
            return running, receiver.running, fd_is_open(fd)
        finally:
            wire.push.close(linger=0)
            wire.ctx.term()

    assert asyncio.run(go()) == (True, False, False)


def fd_is_open(fd: int) -> bool:
    """Whether `fd` is (still) an eventfd of this process."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventfd]"
    except OSError:
        return False


def test_a_socket_error_in_the_thread_reaches_the_task_as_a_zmq_error() -> None:
    """The context terminated under the socket: libzmq's ETERM stops the thread, the
    messages read before it are still delivered, then the task's receive raises
    ZMQError(ETERM) (what pyzmq's receive raises) and vLLM's task queues it.

    Not compared with stock: there pyzmq's asyncio reader callback raises inside the
    event loop (logged) and the task waits forever (checked below, with a timeout)."""
    import threading

    async def go(native: bool) -> list[Any]:
        wire = Wire(ready_first=False, native=native)
        wire.start(vllm_start())
        await wire.send(EngineCoreOutputs(outputs=[EngineCoreOutput("a", [1])], timestamp=1.0))
        got = [as_tuple(await asyncio.wait_for(wire.client.outputs_queue.get(), 10))]
        wire.push.close(linger=0)
        term = threading.Thread(target=wire.ctx.term, daemon=True)  # ends once pull closes
        term.start()
        try:
            item = await asyncio.wait_for(wire.client.outputs_queue.get(), 10 if native else 1)
            got.append(("raised", type(item).__name__, getattr(item, "errno", None)))
        except TimeoutError:
            got.append("waits")
        wire.pull.close(linger=0)
        term.join(10)
        assert not term.is_alive()
        return got

    ours = asyncio.run(go(True))
    assert ours[0][0] == "EngineCoreOutputs"
    assert ours[1:] == [("raised", "ContextTerminated", zmq.ETERM)]
    assert asyncio.run(go(False))[1:] == ["waits"]


@pytest.mark.parametrize("found", [True, False], ids=["libzmq", "no-libzmq"])
def test_the_installed_starter_has_the_thread_read_the_socket(
        found: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """With the switch, the thread reads the socket; without a loaded libzmq to call,
    the socket is left ready-first, with one WARNING."""
    seam = adapter().receive_seam()
    assert isinstance(seam, ReceiveSeam)
    if not found:
        monkeypatch.setattr(receive, "loaded_libzmq", lambda: "/nonexistent/libzmq.so.5")
    start = receive._starting_task(vllm_start(), seam, ready_first=True, reader=None,
                                   native_receive=True)

    async def go() -> tuple[tuple[bool, bool], str, int]:
        wire = Wire(ready_first=False)
        try:
            start(wire.client)
            how = (receive.receives_natively(wire.pull), receive.is_ready_first(wire.pull))
            await wire.send(EngineCoreOutputs(outputs=[EngineCoreOutput("a", [1])], timestamp=1.0))
            item = await asyncio.wait_for(wire.client.outputs_queue.get(), 10)
            return how, item.outputs[0].request_id, wire.waits
        finally:
            wire.close()

    with caplog.at_level("WARNING"):
        how, request_id, waits = asyncio.run(go())
    assert request_id == "a"
    if found:
        assert how == (True, False) and waits == 0  # pyzmq never read the socket
    else:
        assert how == (False, True)
        assert "not received natively (/nonexistent/libzmq.so.5 is not a loaded library)" in caplog.text


def test_this_process_has_one_libzmq_and_it_is_pyzmqs() -> None:
    path = receive.loaded_libzmq()
    assert path is not None and "libzmq" in path
    with pytest.raises(OSError, match="not a loaded library"):
        _core_receiver("/nonexistent/libzmq.so.5", _Handle(1))
    with pytest.raises(OSError, match="no socket"):
        _core_receiver(path, _Handle(0))


class _Handle:
    def __init__(self, underlying: Any) -> None:
        self.underlying = underlying


def test_the_receiver_takes_a_socket_object_not_a_raw_handle() -> None:
    """A bare int (or anything without an int `underlying`) is an ordinary error,
    never a pointer handed to libzmq; the socket is kept alive until stop()."""
    from vllm_mmretry import _core

    path = receive.loaded_libzmq()
    assert path is not None
    for bad, error in ((1, AttributeError), (_Handle("1"), TypeError), (_Handle(-1), OverflowError),
                       (None, AttributeError)):
        with pytest.raises(error):
            _core.SocketReceiver(path, bad)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    refs = sys.getrefcount(sock)
    receiver = _core.SocketReceiver(path, sock)
    assert sys.getrefcount(sock) == refs + 1
    receiver.stop()
    assert sys.getrefcount(sock) == refs
    sock.close(linger=0)
    ctx.term()


def _core_receiver(path: str, socket: Any) -> Any:
    from vllm_mmretry import _core

    return _core.SocketReceiver(path, socket)


def test_a_message_whose_frames_fail_to_wrap_is_kept_for_the_next_receive() -> None:
    """`zmq.Frame` raising (say MemoryError) fails that receive; the message stays first."""
    async def go() -> tuple[str, list[bytes], list[bytes]]:
        wire = Wire(ready_first=False, native=True)
        try:
            for body in (b"first", b"second"):
                await wire.push.send_multipart([body])
            receiver = receiver_of(wire.pull)
            while receiver.counts()[1] < 2:
                await asyncio.sleep(0.01)

            def failing(_: bytes) -> Any:
                raise MemoryError("no room for a frame")

            with pytest.raises(MemoryError) as raised:
                receiver.pop(failing)
            return (str(raised.value), await wire.pull.recv_multipart(),
                    await wire.pull.recv_multipart())
        finally:
            wire.close()

    assert asyncio.run(go()) == ("no room for a frame", [b"first"], [b"second"])


def _eventually(condition: Callable[[], bool], within_s: float = 10.0) -> bool:
    """A condition another thread makes true: polled, not assumed at once."""
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_an_abandoned_natively_received_socket_is_collected_and_its_thread_stopped() -> None:
    """The socket and its receiver refer to each other; the garbage collector sees
    both references, collects them, and pyzmq's finalizer stops the thread."""
    import weakref

    def threads() -> int:  # this package's receive threads
        names = []
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/comm", encoding="utf-8") as comm:
                    names.append(comm.read().strip())
            except OSError:
                pass
        return names.count("mmretry-recv")

    ctx = zmq.asyncio.Context()
    try:
        gc.collect()
        before = threads()
        sock = ctx.socket(zmq.PULL)
        sock.bind(f"inproc://abandoned-{next(_addresses)}")
        assert receive.make_natively_received(sock)
        fd = receiver_of(sock).fileno()
        # The thread names itself once it runs (Rust's std does so in the new thread).
        assert _eventually(lambda: threads() == before + 1) and fd_is_open(fd)
        gone = weakref.ref(sock)
        del sock
        gc.collect()
        assert gone() is None
        assert _eventually(lambda: threads() == before) and not fd_is_open(fd)
    finally:
        ctx.destroy(linger=0)
