"""How steady this machine's CPU speed is: a fixed pure-Python loop, timed N times.

On the 2-core CI VM the same 2M-iteration loop took 0.070-0.136 s over 30 consecutive
runs (no steal time reported), which is why `benches/bench_output_loop.py` times stock
and ours in alternate steps rather than in separate runs.

Usage: python tools/cpu_drift.py [N]
"""

from __future__ import annotations

import statistics
import sys
import time


def timed_loop(n: int = 2_000_000) -> float:
    t0 = time.perf_counter()
    s = 0
    for i in range(n):
        s += i
    return time.perf_counter() - t0


def main() -> None:
    times = [timed_loop() for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 20)]
    print(f"min {min(times):.3f} s, median {statistics.median(times):.3f} s, max {max(times):.3f} s, "
          f"max/min {max(times) / min(times):.2f}")


if __name__ == "__main__":
    main()
