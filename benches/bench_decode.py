"""vLLM's `MsgpackDecoder(EngineCoreOutputs)` vs the native reader (`_core.OutputsReader`
through `receive.NativeOutputsDecoder`) on the same engine-output messages, in one run.

Messages as vLLM's `MsgpackEncoder` writes them: 1, 3 and 64 per-request outputs of one
token each (the mock engine sends 1.8-3.5 per message, a real engine about one per
running request), with and without scheduler stats. The two decoders take turns, 2,000
decodes per sample, 15 samples; prints µs per message (median, min-max) and the ratio
of the medians, as a table and one JSON line per row.

Usage: python benches/bench_decode.py [--samples N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from paired import taking_turns
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from vllm_mmretry.receive import NativeOutputsDecoder, native_reader

CALLS = 2000


def message(outputs: int, stats: bool) -> list[bytes]:
    outs = [EngineCoreOutput(request_id=f"chatcmpl-{i:032x}-abcd", new_token_ids=[1234 + i])
            for i in range(outputs)]
    msg = EngineCoreOutputs(outputs=outs, scheduler_stats=SchedulerStats() if stats else None)
    return [bytes(f) for f in MsgpackEncoder().encode(msg)]


def per_call_us(decode: Callable[[Any], Any], frames: list[bytes]) -> float:
    t0 = time.perf_counter()
    for _ in range(CALLS):
        decode(frames)
    return (time.perf_counter() - t0) / CALLS * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=15)
    args = ap.parse_args()
    reader = native_reader()
    if reader is None:
        raise SystemExit("this vLLM's engine-output layout is not the one the reader knows")
    vllm = MsgpackDecoder(EngineCoreOutputs)
    ours = NativeOutputsDecoder(MsgpackDecoder(EngineCoreOutputs), reader)
    print(f"{'outputs':>7} {'stats':>5} {'vLLM µs':>18} {'native µs':>18} {'native/vLLM':>11}")
    for outputs in (1, 3, 64):
        for stats in (False, True):
            frames = message(outputs, stats)
            samples: dict[str, list[float]] = {"vllm": [], "native": []}
            for s in range(args.samples):
                for side in taking_turns(("vllm", "native"), s):
                    dec = vllm.decode if side == "vllm" else ours.decode
                    samples[side].append(per_call_us(dec, frames))
            assert ours.stepped_aside == 0, "the benchmark's messages must be read natively"
            med = {k: statistics.median(v) for k, v in samples.items()}
            ratio = med["native"] / med["vllm"]
            cells = [f"{med[k]:.2f} ({min(samples[k]):.2f}-{max(samples[k]):.2f})" for k in ("vllm", "native")]
            print(f"{outputs:>7} {'on' if stats else 'off':>5} {cells[0]:>18} {cells[1]:>18} {ratio:>11.2f}")
            print(json.dumps({"outputs": outputs, "scheduler_stats": stats, "vllm_us": round(med["vllm"], 3),
                              "native_us": round(med["native"], 3), "native_over_vllm": round(ratio, 3)}))


if __name__ == "__main__":
    main()
