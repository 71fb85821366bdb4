"""Ready-first receive of engine outputs in the API server.

vLLM's async engine client reads every engine-output message in one task, with
`await output_socket.recv_multipart(copy=False)` on a zmq.asyncio socket. For each
message pyzmq builds an asyncio Future, polls the socket's events and registers
and drops the loop's reader, even when the message is already waiting; when the
engine is ahead of the front end that is about a sixth of the API server's samples
(README, "Where the API server's time goes").

Before that task starts, the `recv_multipart` of its socket (that instance only) is
replaced by one that takes a message already waiting with a non-blocking receive and
otherwise awaits pyzmq's own `recv_multipart`. The task gets the same frames in the
same order. Scheduling does not change: when a message is waiting pyzmq returns an
already-completed Future, whose `await` does not yield to the event loop either.

The adapter names the seam (`receive_seam`) and checks that this vLLM's output task
is the one this was written against; otherwise vLLM's receive is left alone (one
WARNING). VLLM_MMRETRY_READY_FIRST_RECEIVE=0 leaves it alone too."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from vllm_mmretry import _patching
from vllm_mmretry.vllm_adapter import adapter, vllm_logger

ENV_SWITCH = "VLLM_MMRETRY_READY_FIRST_RECEIVE"
# Set on the replacement, so a socket is never wrapped twice.
_MARK = "__vllm_mmretry_ready_first__"


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


def install() -> list[str]:
    """Patch the adapter's output-task starter; [] when off or on an unknown task."""
    if not enabled():
        return []
    seam = adapter().receive_seam()
    if isinstance(seam, str):
        vllm_logger("vllm.vllm_mmretry.receive").warning(
            "vllm-mmretry: engine outputs are received as vLLM does (%s)", seam)
        return []
    start = getattr(seam.owner, seam.method)
    return [_patching.patch_attr(seam.owner, seam.method, _starting_ready_first(start, seam.output_socket))]


def _starting_ready_first(start: Callable[..., Any], output_socket: Callable[[Any], Any]) -> Any:
    @functools.wraps(start)
    def start_output_task(client: Any, *args: Any, **kwargs: Any) -> Any:
        sock = output_socket(client)
        if isinstance(sock, zmq.asyncio.Socket) and not is_ready_first(sock):
            make_ready_first(sock)
        return start(client, *args, **kwargs)

    return start_output_task


def is_ready_first(sock: Any) -> bool:
    return getattr(sock.recv_multipart, _MARK, False)


def make_ready_first(sock: zmq.asyncio.Socket) -> None:
    """Give `sock` a `recv_multipart` that returns a waiting message without a Future."""
    # A shadow is a second, non-owning handle on the same libzmq socket (pyzmq's
    # asyncio socket reads through one too); it is only used while `sock` is open.
    shadow: zmq.Socket[Any] = zmq.Socket.shadow(sock.underlying)
    awaited = sock.recv_multipart
    nonblocking, again = zmq.NOBLOCK, zmq.Again

    async def recv_multipart(flags: int = 0, copy: bool = True, track: bool = False) -> Any:
        if not sock.closed:
            try:
                return shadow.recv_multipart(flags | nonblocking, copy=copy, track=track)
            except again:
                pass
        return await awaited(flags, copy=copy, track=track)

    setattr(recv_multipart, _MARK, True)
    sock.recv_multipart = recv_multipart  # type: ignore[method-assign]
