"""pyzmq's `recv_multipart(copy=False)` (what vLLM's output task calls) against the
ready-first receive's `receive.frames_of_message` and the native receive thread's
`SocketReceiver.pop(zmq.Frame)`, side by side in one process.

Both read waiting engine-output messages (vLLM's own `MsgpackEncoder` encoding of
one `EngineCoreOutputs` with a few outputs, one frame) from the same kind of
non-blocking socket the ready-first receive reads through. They take turns in
blocks (who goes first alternates), so both see the same machine; the ratio is
taken block by block. The native thread reads its own socket pair: it has taken a
block's messages before the block is timed, so its row is what the event loop still
pays per waiting message (the thread's copy runs on another core). Prints one JSON
line: µs per message, medians, and the median of the paired ratios (pyzmq over
ready-first, ready-first over native) with their 10th and 90th percentiles.

The `awaited_` fields time the whole receive as vLLM's output task makes it, `await
sock.recv_multipart(copy=False)` on a zmq.asyncio socket in uvloop's event loop (as
`vllm serve` runs), pyzmq's against the ready-first socket's, which hands a waiting
message over in a `receive.Received` instead of an asyncio Future.

    .venv/bin/python benches/bench_receive.py [--blocks 60] [--per-block 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import uvloop
import zmq
import zmq.asyncio
from paired import paired_ratios, taking_turns
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.serial_utils import MsgpackEncoder

from vllm_mmretry import _core
from vllm_mmretry.receive import frames_of_message, loaded_libzmq, make_ready_first

NONBLOCK = int(zmq.NOBLOCK)


def message() -> list[Any]:
    """One engine-output message as the engine core sends it: 3 requests, 1 token each."""
    outs = [EngineCoreOutput(request_id=f"chatcmpl-{i:032x}-0", new_token_ids=[1000 + i]) for i in range(3)]
    return list(MsgpackEncoder().encode(EngineCoreOutputs(outputs=outs, timestamp=1.0)))


def pyzmq_read(sock: zmq.Socket[Any]) -> Any:
    return sock.recv_multipart(NONBLOCK, copy=False)


def ready_first_read(sock: zmq.Socket[Any]) -> Any:
    return frames_of_message(sock, NONBLOCK, False)


def native_read(receiver: _core.SocketReceiver) -> Any:
    return receiver.pop(zmq.Frame)


def taken(receiver: _core.SocketReceiver, n: int) -> None:
    """Wait until the thread has taken `n` messages that are not popped yet."""
    while receiver.counts()[1] < n:
        time.sleep(0.0005)


def timed_block(push: zmq.Socket[Any], pull: Any, frames: list[Any], n: int,
                read: Callable[[Any], Any]) -> float:
    """Seconds per message to read `n` waiting messages."""
    for _ in range(n):
        push.send_multipart(frames, copy=False)
    if isinstance(pull, _core.SocketReceiver):
        taken(pull, n)
    t0 = time.perf_counter()
    for _ in range(n):
        read(pull)
    return (time.perf_counter() - t0) / n


def sent_and_read(push: zmq.Socket[Any], pull: Any, read: Callable[[Any], Any],
                  frames: list[Any]) -> Any:
    """One message sent and read back (every read must give the frames sent)."""
    push.send_multipart(frames, copy=False)
    if isinstance(pull, _core.SocketReceiver):
        taken(pull, 1)
    return read(pull)


def socket_pair(ctx: zmq.Context[Any], name: str, pull_ctx: Any = None) -> tuple[zmq.Socket[Any], Any]:
    """A PUSH/PULL pair without high-water marks; the PULL from `pull_ctx` if given."""
    push, pull = ctx.socket(zmq.PUSH), (pull_ctx or ctx).socket(zmq.PULL)
    for s in (push, pull):
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
    pull.bind(f"inproc://{name}")
    push.connect(f"inproc://{name}")
    return push, pull


async def awaited_block(push: zmq.Socket[Any], pull: zmq.asyncio.Socket, frames: list[Any], n: int) -> float:
    """Seconds per message to await `n` waiting messages as vLLM's output task does."""
    for _ in range(n):
        push.send_multipart(frames, copy=False)
    while not pull.poll(0):  # inproc: the messages are there once the first is
        await asyncio.sleep(0)
    t0 = time.perf_counter()
    for _ in range(n):
        await pull.recv_multipart(copy=False)
    return (time.perf_counter() - t0) / n


async def awaited_times(blocks: int, per_block: int, frames: list[Any]) -> dict[str, list[float]]:
    """pyzmq's awaited receive and the ready-first socket's, taking turns in blocks."""
    actx = zmq.asyncio.Context()
    ctx = zmq.Context.shadow(actx.underlying)
    sockets = {name: socket_pair(ctx, f"bench-awaited-{name}", actx) for name in ("pyzmq", "ready_first")}
    make_ready_first(sockets["ready_first"][1])
    times: dict[str, list[float]] = {name: [] for name in sockets}
    try:
        for push, pull in sockets.values():  # every side reads the frames sent
            push.send_multipart(frames, copy=False)
            got = await pull.recv_multipart(copy=False)
            assert [bytes(f) for f in got] == [bytes(f) for f in frames], got
        for block in range(blocks):
            for name in taking_turns(list(sockets), block):
                times[name].append(await awaited_block(*sockets[name], frames, per_block))
    finally:
        for push, pull in sockets.values():
            push.close(linger=0)
            pull.close(linger=0)
        actx.term()
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=60)
    ap.add_argument("--per-block", type=int, default=2000)
    args = ap.parse_args()
    ctx = zmq.Context()
    push, pull = socket_pair(ctx, "bench-receive")
    native_push, native_pull = socket_pair(ctx, "bench-receive-native")
    libzmq = loaded_libzmq()
    assert libzmq is not None
    receiver = _core.SocketReceiver(libzmq, native_pull)
    frames = message()
    sides: dict[str, tuple[zmq.Socket[Any], Any, Callable[[Any], Any]]] = {
        "pyzmq": (push, pull, pyzmq_read), "ready_first": (push, pull, ready_first_read),
        "native": (native_push, receiver, native_read)}
    read_back = [[bytes(f) for f in sent_and_read(*side, frames)] for side in sides.values()]
    assert read_back[0] == read_back[1] == read_back[2], read_back
    times: dict[str, list[float]] = {name: [] for name in sides}
    for block in range(args.blocks):
        for name in taking_turns(list(sides), block):
            sender, reader, read = sides[name]
            times[name].append(timed_block(sender, reader, frames, args.per_block, read))
    native = paired_ratios(times["ready_first"], times["native"])
    awaited = uvloop.run(awaited_times(args.blocks, args.per_block, frames))
    print(json.dumps({
        "frames_per_message": len(frames),
        "pyzmq_us": round(statistics.median(times["pyzmq"]) * 1e6, 3),
        "ready_first_us": round(statistics.median(times["ready_first"]) * 1e6, 3),
        "native_thread_us": round(statistics.median(times["native"]) * 1e6, 3),
        **paired_ratios(times["pyzmq"], times["ready_first"]),
        **{f"native_{k}": v for k, v in native.items()},
        "awaited_pyzmq_us": round(statistics.median(awaited["pyzmq"]) * 1e6, 3),
        "awaited_ready_first_us": round(statistics.median(awaited["ready_first"]) * 1e6, 3),
        **{f"awaited_{k}": v for k, v in paired_ratios(awaited["pyzmq"], awaited["ready_first"]).items()},
        "blocks": args.blocks, "per_block": args.per_block,
    }))
    receiver.stop()
    for s in (push, pull, native_push, native_pull):
        s.close(linger=0)
    ctx.term()


if __name__ == "__main__":
    main()
