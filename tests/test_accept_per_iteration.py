"""The mechanism behind a closed-loop run's first-wave TTFT (docs/served-speed.md, "Why:
the first wave's connections wait to be accepted"), checked against the installed event
loops: uvloop, which `vllm serve` runs, accepts one new connection per loop iteration;
asyncio's own loop accepts every waiting one at once. Counts iterations, not time."""

from __future__ import annotations

import asyncio

import uvloop
from accept_per_iteration import accept_burst  # tools/


def test_uvloop_accepts_one_connection_per_busy_iteration() -> None:
    iterations, _ = uvloop.run(accept_burst(connections=20, busy_s=0.001))
    assert iterations >= 20


def test_asyncio_accepts_a_burst_in_a_few_iterations() -> None:
    iterations, _ = asyncio.run(accept_burst(connections=20, busy_s=0.001))
    assert iterations < 10
