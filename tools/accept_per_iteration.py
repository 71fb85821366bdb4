"""How many event-loop iterations a burst of new connections takes to be accepted, on
uvloop (what `vllm serve` runs) and on asyncio's own loop, with every iteration busy.

A closed-loop run of `benches/bench_serve.py` opens all of its first wave's connections
at once; under load their wait to be accepted is most of the row's TTFT p99
(docs/served-speed.md, "Why: the first wave's connections wait to be accepted"). This
shows the mechanism apart from vLLM: uvloop's libuv accepts one connection per
iteration (libuv PR #3696), asyncio's selector loop accepts every waiting one at once.

    .venv/bin/python tools/accept_per_iteration.py [--connections 50] [--busy-ms 10]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import time
from collections.abc import Callable
from typing import Any

import uvloop


async def accept_burst(connections: int, busy_s: float) -> tuple[int, float]:
    """Open `connections` at once to a server on this loop, with one callback per loop
    iteration that holds the loop for `busy_s`; return the iterations and the seconds
    until the server had accepted them all."""
    loop = asyncio.get_running_loop()
    accepted = 0

    class Count(asyncio.Protocol):
        def connection_made(self, transport: Any) -> None:
            nonlocal accepted
            accepted += 1

    server = await loop.create_server(Count, "127.0.0.1", 0, backlog=2048)
    port = server.sockets[0].getsockname()[1]
    iterations = 0
    done = loop.create_future()

    def busy_iteration() -> None:
        nonlocal iterations
        iterations += 1
        time.sleep(busy_s)  # the rest of a loaded server's iteration
        if accepted >= connections:
            done.set_result(None)
        else:
            loop.call_soon(busy_iteration)

    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(connections)]
    start = time.monotonic()
    loop.call_soon(busy_iteration)
    try:
        await done
        return iterations, time.monotonic() - start
    finally:
        for client in clients:
            client.close()
        server.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connections", type=int, default=50)
    ap.add_argument("--busy-ms", type=float, default=10.0)
    args = ap.parse_args()
    runners: dict[str, Callable[[Any], tuple[int, float]]] = {
        "uvloop": uvloop.run, "asyncio": asyncio.run}
    for name, run in runners.items():
        iterations, seconds = run(accept_burst(args.connections, args.busy_ms / 1000))
        print(f"{name:8s} {args.connections} connections accepted after {iterations} busy "
              f"iterations ({seconds:.2f} s)")


if __name__ == "__main__":
    main()
