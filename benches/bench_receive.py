"""pyzmq's `recv_multipart(copy=False)` (what vLLM's output task calls) against the
ready-first receive's `receive.frames_of_message`, side by side in one process.

Both read waiting engine-output messages (vLLM's own `MsgpackEncoder` encoding of
one `EngineCoreOutputs` with a few outputs, one frame) from the same kind of
non-blocking socket the ready-first receive reads through. They take turns in
blocks (who goes first alternates), so both see the same machine; the ratio is
taken block by block. Prints one JSON line: µs per message, medians, and the
median of the paired ratios with its 10th and 90th percentiles.

    .venv/bin/python benches/bench_receive.py [--blocks 60] [--per-block 2000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import zmq
from paired import paired_ratios, taking_turns
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.serial_utils import MsgpackEncoder

from vllm_mmretry.receive import frames_of_message

NONBLOCK = int(zmq.NOBLOCK)


def message() -> list[Any]:
    """One engine-output message as the engine core sends it: 3 requests, 1 token each."""
    outs = [EngineCoreOutput(request_id=f"chatcmpl-{i:032x}-0", new_token_ids=[1000 + i]) for i in range(3)]
    return list(MsgpackEncoder().encode(EngineCoreOutputs(outputs=outs, timestamp=1.0)))


def pyzmq_read(sock: zmq.Socket[Any]) -> Any:
    return sock.recv_multipart(NONBLOCK, copy=False)


def ready_first_read(sock: zmq.Socket[Any]) -> Any:
    return frames_of_message(sock, NONBLOCK, False)


def timed_block(push: zmq.Socket[Any], pull: zmq.Socket[Any], frames: list[Any], n: int,
                read: Callable[[zmq.Socket[Any]], Any]) -> float:
    """Seconds per message to read `n` waiting messages."""
    for _ in range(n):
        push.send_multipart(frames, copy=False)
    t0 = time.perf_counter()
    for _ in range(n):
        read(pull)
    return (time.perf_counter() - t0) / n


def sent_and_read(push: zmq.Socket[Any], pull: zmq.Socket[Any], frames: list[Any],
                  read: Callable[[zmq.Socket[Any]], Any]) -> Any:
    """One message sent and read back (both reads must give the frames sent)."""
    push.send_multipart(frames, copy=False)
    return read(pull)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=60)
    ap.add_argument("--per-block", type=int, default=2000)
    args = ap.parse_args()
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    for s in (push, pull):
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
    pull.bind("inproc://bench-receive")
    push.connect("inproc://bench-receive")
    frames = message()
    sides = {"pyzmq": pyzmq_read, "ready_first": ready_first_read}
    assert [bytes(f) for f in sent_and_read(push, pull, frames, pyzmq_read)] == \
        [bytes(f) for f in sent_and_read(push, pull, frames, ready_first_read)]
    times: dict[str, list[float]] = {name: [] for name in sides}
    for block in range(args.blocks):
        for name in taking_turns(list(sides), block):
            times[name].append(timed_block(push, pull, frames, args.per_block, sides[name]))
    print(json.dumps({
        "frames_per_message": len(frames),
        "pyzmq_us": round(statistics.median(times["pyzmq"]) * 1e6, 3),
        "ready_first_us": round(statistics.median(times["ready_first"]) * 1e6, 3),
        **paired_ratios(times["pyzmq"], times["ready_first"]),
        "blocks": args.blocks, "per_block": args.per_block,
    }))
    push.close(linger=0)
    pull.close(linger=0)
    ctx.term()


if __name__ == "__main__":
    main()
