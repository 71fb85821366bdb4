"""Ready-first receive of engine outputs in the API server.

vLLM's async engine client reads every engine-output message in one task, with
`await output_socket.recv_multipart(copy=False)` on a zmq.asyncio socket. For each
message pyzmq builds an asyncio Future, polls the socket's events and registers
and drops the loop's reader, even when the message is already waiting; when the
engine is ahead of the front end that is about a sixth of the API server's samples
(README, "Where the API server's time goes").

Before that task starts, the `recv_multipart` of its socket (that instance only) is
replaced by one that takes a message already waiting with a non-blocking receive
(handed over in a `Received`, which asyncio takes for a done Future) and otherwise
returns pyzmq's own `recv_multipart` Future. The task gets the same frames in the
same order, and a receive cancelled as its message comes in keeps the message as
pyzmq's does. Scheduling does not change: when a message is waiting pyzmq returns an
already-completed Future, whose `await` does not yield to the event loop either. A
waiting message read with `copy=False` (vLLM's) is read frame by frame, each frame
saying whether another follows (`frames_of_message`).

The same starter gives the task a decoder (`NativeOutputsDecoder`) that reads the
common engine-output message natively (`_core.OutputsReader`, rust/src/wire.rs:
request ids, token ids, finish and stop reasons, every other per-request field nil)
and hands every other message to vLLM's `MsgpackDecoder`, which also decodes the
top-level fields the reader does not (scheduler stats, utility replies, ...).

With VLLM_MMRETRY_NATIVE_RECEIVE=1 the socket is instead read by a native thread
(`_core.SocketReceiver`, rust/src/recv.rs) that waits on it and copies each waiting
message out without the GIL; the task's `recv_multipart` pops those messages in
order and, when none waits, awaits an eventfd the thread writes. From the task's
start until the socket is closed only that thread touches the socket: the socket's
`close` stops and joins the thread first.

The adapter names the seam (`receive_seam`) and the message layout (`outputs_wire`)
and checks both against this vLLM; otherwise vLLM's receive or decoder is left
alone (one WARNING). VLLM_MMRETRY_READY_FIRST_RECEIVE=0 leaves the receive alone;
the native decoder is used only with VLLM_MMRETRY_NATIVE_DECODE=1, the native
receive thread only with VLLM_MMRETRY_NATIVE_RECEIVE=1."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import weakref
from collections.abc import Callable, Generator
from typing import Any

import zmq
import zmq.asyncio

from vllm_mmretry import _core, _patching
from vllm_mmretry.switches import switch_on
from vllm_mmretry.vllm_adapter import adapter, vllm_logger
from vllm_mmretry.vllm_adapter.base import ReceiveSeam

ENV_SWITCH = "VLLM_MMRETRY_READY_FIRST_RECEIVE"
DECODE_SWITCH = "VLLM_MMRETRY_NATIVE_DECODE"
NATIVE_RECEIVE_SWITCH = "VLLM_MMRETRY_NATIVE_RECEIVE"
# A plain int: `int & zmq.NOBLOCK` goes through enum.Flag.__rand__.
_NOBLOCK = int(zmq.NOBLOCK)
# Set on the replacement, so a socket is never wrapped twice.
_MARK = "__vllm_mmretry_ready_first__"


def enabled() -> bool:
    return switch_on(ENV_SWITCH)


def native_decode_enabled() -> bool:
    # Off unless asked for: building vLLM's objects natively is slower than msgspec
    # (docs/served-speed.md, "Native engine-output decoding"); it is the reader a native batch
    # path would start from.
    return switch_on(DECODE_SWITCH, default=False)


def native_receive_enabled() -> bool:
    # Off unless asked for, until served runs show it pays
    # (docs/served-speed.md, "Native receive thread").
    return switch_on(NATIVE_RECEIVE_SWITCH, default=False)


class NativeOutputsDecoder:
    """vLLM's `MsgpackDecoder(EngineCoreOutputs)`, with the common message read natively.

    A message of more than one frame (tensors), one the reader does not accept, or
    one whose top-level fields vLLM's decoders reject goes to `inner` whole, so its
    result or its error is vLLM's own. `native` and `stepped_aside` count both."""

    def __init__(self, inner: Any, reader: _core.OutputsReader) -> None:
        self.inner = inner
        self.reader = reader
        self.native = 0
        self.stepped_aside = 0

    def decode(self, bufs: Any) -> Any:
        frame = bufs if isinstance(bufs, (bytes, bytearray, memoryview)) else (
            bufs[0] if len(bufs) == 1 else None)
        if frame is not None:
            try:
                out = self.reader.read(frame)
            except Exception:  # noqa: BLE001 - vLLM's decoder gives this message its answer
                out = None
            if out is not None:
                self.native += 1
                return out
        self.stepped_aside += 1
        return self.inner.decode(bufs)


def native_reader() -> _core.OutputsReader | None:
    """The reader for this vLLM's messages; None (one WARNING) when its layout is unknown."""
    wire = adapter().outputs_wire()
    if isinstance(wire, str):
        vllm_logger("vllm.vllm_mmretry.receive").warning(
            "vllm-mmretry: engine outputs are decoded by vLLM's decoder (%s)", wire)
        return None
    return _core.OutputsReader(wire)


def install() -> list[str]:
    """Patch the adapter's output-task starter; [] when off or on an unknown task."""
    ready_first, native_decode = enabled(), native_decode_enabled()
    native_receive = native_receive_enabled()
    if not (ready_first or native_decode or native_receive):
        return []
    seam = adapter().receive_seam()
    if isinstance(seam, str):
        vllm_logger("vllm.vllm_mmretry.receive").warning(
            "vllm-mmretry: engine outputs are received as vLLM does (%s)", seam)
        return []
    # Built the first time a client starts its task: only the API server's clients
    # decode engine outputs, not every process that loads the plugin.
    reader = functools.cache(native_reader) if native_decode else None
    start = getattr(seam.owner, seam.method)
    return [_patching.patch_attr(seam.owner, seam.method,
                                 _starting_task(start, seam, ready_first, reader, native_receive))]


def _starting_task(start: Callable[..., Any], seam: ReceiveSeam, ready_first: bool,
                   reader: Callable[[], _core.OutputsReader | None] | None,
                   native_receive: bool = False) -> Any:
    """vLLM's output-task starter that first makes the socket ready-first (or read by
    the native thread) and gives the client the native decoder (`reader` builds the
    decoder's reader).

    vLLM calls the starter before every read of an output; once the task runs there
    is nothing left to do, so the client gets vLLM's own starter back (`hand_back`)."""
    @functools.wraps(start)
    def start_output_task(client: Any, *args: Any, **kwargs: Any) -> Any:
        sock = seam.output_socket(client)
        if isinstance(sock, zmq.asyncio.Socket) and not (is_ready_first(sock) or receives_natively(sock)):
            if not (native_receive and make_natively_received(sock)) and ready_first:
                make_ready_first(sock)
        # Only before the task starts: it takes the client's decoder once, then.
        if reader is not None and sock is not None:
            give_native_decoder(client, seam, reader)
        result = start(client, *args, **kwargs)
        if seam.output_socket(client) is None:
            hand_back(client, seam.method, start)
        return result

    return start_output_task


def hand_back(client: Any, method: str, start: Callable[..., Any]) -> None:
    """Give `client` (this instance only) vLLM's `start` as its `method`, bound through a
    weak reference: a bound method would be a cycle, and vLLM cleans a client's
    sockets up when it is collected (weakref.finalize)."""
    # AttributeError: __slots__ or a frozen client; TypeError: no weak references
    with contextlib.suppress(AttributeError, TypeError):
        setattr(client, method, functools.partial(_call_started, weakref.ref(client), start))


def _call_started(client_ref: weakref.ref[Any], start: Callable[..., Any],
                  *args: Any, **kwargs: Any) -> Any:
    return start(client_ref(), *args, **kwargs)


def give_native_decoder(client: Any, seam: ReceiveSeam,
                        reader: Callable[[], _core.OutputsReader | None]) -> None:
    inner = getattr(client, seam.decoder)
    if isinstance(inner, NativeOutputsDecoder):
        return
    built = reader()
    if built is not None:
        setattr(client, seam.decoder, NativeOutputsDecoder(inner, built))
        vllm_logger("vllm.vllm_mmretry.receive").info(
            "vllm-mmretry: common engine-output messages are decoded natively (%s=1)",
            DECODE_SWITCH)


def is_ready_first(sock: Any) -> bool:
    return getattr(sock.recv_multipart, _MARK, False)


def receives_natively(sock: Any) -> bool:
    return isinstance(getattr(sock.recv_multipart, "__self__", None), NativeReceiving)


def make_ready_first(sock: zmq.asyncio.Socket) -> None:
    """Give `sock` a `recv_multipart` that returns a waiting message without a Future."""
    # A shadow is a second, non-owning handle on the same libzmq socket (pyzmq's
    # asyncio socket reads through one too); it is only used while `sock` is open.
    shadow: zmq.Socket[Any] = zmq.Socket.shadow(sock.underlying)
    awaited = sock.recv_multipart
    # A plain int: `int | zmq.NOBLOCK` goes through enum.Flag.__or__ (1.4 µs a receive).
    nonblocking, again = int(zmq.NOBLOCK), zmq.Again

    # Not a coroutine: a receive that waits is pyzmq's own Future, so cancelling it
    # after pyzmq has read the message keeps the message in that Future, as in
    # stock (a coroutine around it would be cancelled with the message in hand).
    def recv_multipart(flags: int = 0, copy: bool = True, track: bool = False) -> Any:
        if not sock.closed:
            try:
                if copy:
                    return Received(shadow.recv_multipart(flags | nonblocking, copy=True, track=track))
                return Received(frames_of_message(shadow, flags | nonblocking, track))
            except again:
                pass
        return awaited(flags, copy=copy, track=track)

    setattr(recv_multipart, _MARK, True)
    sock.recv_multipart = recv_multipart  # type: ignore[method-assign]


class Received:
    """A message already read, as pyzmq gives one that waits: a done Future to asyncio
    (awaiting it does not yield; `ensure_future`, `wait_for`, `gather` and `shield` take
    it as it is; a caller that cancels it still finds the message), without building one.
    An asyncio Future asks for the running loop, and on Python 3.11
    `asyncio.get_running_loop()` makes a getpid() system call each time: making and
    completing one cost about 1 µs a message here, this object a third of that
    (benches/bench_receive.py). The loop is only looked up by the calls that need it."""

    __slots__ = ("_message",)
    # What `asyncio.isfuture` looks for; False: awaiting it never suspends.
    _asyncio_future_blocking = False

    def __init__(self, message: Any) -> None:
        self._message = message

    def __await__(self) -> Generator[Any, None, Any]:
        return self._message
        yield  # a generator that returns at once: `await` gets the message without yielding

    __iter__ = __await__

    def result(self) -> Any:
        return self._message

    def done(self) -> bool:
        return True

    def cancelled(self) -> bool:
        return False

    def cancel(self, msg: Any = None) -> bool:
        return False  # done: the message stays, as with a done Future

    def exception(self) -> BaseException | None:
        return None

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    def add_done_callback(self, fn: Callable[[Any], object], *, context: Any = None) -> None:
        # A done Future schedules the callback at once.
        self.get_loop().call_soon(fn, self, context=context)

    def remove_done_callback(self, fn: Callable[[Any], object]) -> int:
        return 0  # a scheduled callback of a done Future is no longer listed


def frames_of_message(shadow: zmq.Socket[Any], flags: int, track: bool) -> list[zmq.Frame]:
    """pyzmq's `recv_multipart(flags, copy=False, track)`, the same frames in the same
    order. It reads each frame's `more` flag where pyzmq asks the socket
    (`getsockopt(RCVMORE)`), which is most of pyzmq's time for a one-frame message
    (benches/bench_receive.py)."""
    frame = shadow.recv(flags, copy=False, track=track)
    parts = [frame]
    while frame.more:  # a message's later frames are there once its first one is
        frame = shadow.recv(flags, copy=False, track=track)
        parts.append(frame)
    return parts


@functools.cache
def loaded_libzmq() -> str | None:
    """The path of the one libzmq this process has mapped (pyzmq's), or None."""
    zmq.zmq_version()  # pyzmq's backend, and with it its libzmq, is loaded
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            fields = (line.split(None, 5) for line in maps)
            paths = {f[5].strip() for f in fields if len(f) == 6}
    except OSError:
        return None
    libs = {p for p in paths if os.path.basename(p).startswith("libzmq") and ".so" in p}
    return libs.pop() if len(libs) == 1 else None


def make_natively_received(sock: zmq.asyncio.Socket) -> bool:
    """Have a native thread read `sock` for its `recv_multipart`; False (one WARNING)
    when the thread cannot start, and the socket is left as it was."""
    path = loaded_libzmq()
    try:
        if path is None:
            raise OSError("no single loaded libzmq in /proc/self/maps")
        receiver = _core.SocketReceiver(path, sock)
    except (OSError, RuntimeError) as e:
        vllm_logger("vllm.vllm_mmretry.receive").warning(
            "vllm-mmretry: engine outputs are not received natively (%s)", e)
        return False
    NativeReceiving(sock, receiver).install()
    vllm_logger("vllm.vllm_mmretry.receive").info(
        "vllm-mmretry: engine outputs are received by a native thread (%s=1)", NATIVE_RECEIVE_SWITCH)
    return True


def zmq_error(errno: int) -> zmq.ZMQError:
    """The exception pyzmq raises for a failed receive with this errno."""
    if errno == zmq.ETERM:
        return zmq.ContextTerminated(errno)
    if errno == zmq.EAGAIN:
        return zmq.Again(errno)
    return zmq.ZMQError(errno)


class NativeReceiving:
    """`sock.recv_multipart` and `sock.close` over a `_core.SocketReceiver`.

    The frames are what pyzmq's receive gives: `bytes`, or `zmq.Frame`s for
    `copy=False` (vLLM's call). A socket error that stopped the thread is raised as
    pyzmq raises it (`zmq.ZMQError`), once the messages read before it are taken."""

    def __init__(self, sock: zmq.asyncio.Socket, receiver: _core.SocketReceiver) -> None:
        self.sock = sock
        self.receiver = receiver
        self.fd = receiver.fileno()
        self.pyzmq_recv = sock.recv_multipart
        self.pyzmq_close = sock.close
        self.waiter: asyncio.Future[None] | None = None
        self.watched: asyncio.AbstractEventLoop | None = None
        # Our own flag, not `sock.closed`: pyzmq's asks libzmq about the socket
        # (getsockopt), which would touch it while the thread owns it.
        self.closed = False

    def install(self) -> None:
        self.sock.recv_multipart = self.recv_multipart  # type: ignore[method-assign]
        self.sock.close = self.close  # type: ignore[method-assign]

    async def recv_multipart(self, flags: int = 0, copy: bool = True, track: bool = False) -> Any:
        wrap = None if copy else (functools.partial(zmq.Frame, track=True) if track else zmq.Frame)
        while True:
            if self.closed:
                return await self.pyzmq_recv(flags, copy=copy, track=track)  # pyzmq's error
            got = self.receiver.pop(wrap)
            if isinstance(got, list):
                return got
            if got is not None:
                raise zmq_error(got)
            if flags & _NOBLOCK:
                raise zmq.Again()
            await self._woken()

    async def _woken(self) -> None:
        loop = asyncio.get_running_loop()
        if self.watched is not loop:
            self._unwatch()
            loop.add_reader(self.fd, self._on_wake)
            self.watched = loop
        self.waiter = loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def _on_wake(self) -> None:
        self.receiver.clear_wake()
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _unwatch(self) -> None:
        if self.watched is not None and not self.watched.is_closed():
            self.watched.remove_reader(self.fd)
        self.watched = None

    def close(self, linger: int | None = None) -> None:
        """Stop the thread, then pyzmq's close (which cancels a waiting receive, as ours)."""
        self.closed = True
        self._unwatch()  # before the thread's stop closes the eventfd the loop watches
        self.receiver.stop()
        if self.waiter is not None and not self.waiter.done():
            self.waiter.cancel()
        self.pyzmq_close(linger)
