"""Stock vLLM OutputProcessor vs vllm_mmretry.OutputProcessor on the same
synthetic decode streams, in one run.

Every request gets one new token per step, DELTA streaming, detokenization on,
AsyncLLM mode (one RequestOutputCollector per request, drained every step, or every
K steps with --drain-every K: a consumer that is behind, whose collectors merge),
with the start-up heap frozen as vLLM's API server does (`freeze_gc_heap`).
Variants: plain decode, two stop strings, n=4 (batch counts child requests).
The two processors take turns step by step; prints a table and one JSON line per row
(µs per request-step, medians; ratio: the median of the step-paired ratios, with
their 10th and 90th percentiles), then
the current RSS (/proc/self/statm) of this process before and after 1M
request-steps through our processor (after a warm-up), which should be flat.

Usage: python benches/bench_output_loop.py [--quick] [--tokenizer DIR] [--python-detok]
       [--log-stats] [--drain-every K] [--block K]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import random
import statistics
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from paired import paired_ratios, taking_turns  # noqa: E402
from vllm.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402
from vllm.tokenizers import get_tokenizer  # noqa: E402
from vllm.utils.gc_utils import freeze_gc_heap  # noqa: E402
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest  # noqa: E402
from vllm.v1.engine.output_processor import OutputProcessor as StockOP  # noqa: E402
from vllm.v1.engine.output_processor import RequestOutputCollector  # noqa: E402
from vllm.v1.engine.parallel_sampling import ParentRequest  # noqa: E402
from vllm.v1.metrics.stats import IterationStats  # noqa: E402

from vllm_mmretry.output_processor import OutputProcessor as OurOP  # noqa: E402

TEXT = (
    "The quick brown fox jumps over the lazy dog. Multimodal serving engines keep a "
    "processor cache on both sides of the process boundary; when they drift, requests "
    "fail unless the front end retries them with the data attached. "
) * 40
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {"stop": None, "n": 1},
    "stop2": {"stop": ["zebra", "\n\n"], "n": 1},
    "n4": {"stop": None, "n": 4},
}


OUR_KW: dict[str, Any] = {}
BOTH_KW: dict[str, Any] = {"log_stats": False}
# Steps between takes of the collectors' outputs (--drain-every).
DRAIN_EVERY = 1


def _setup(
    cls: type, tok: Any, ids: list[int], batch: int, stop: list[str] | None, n: int
) -> tuple[Any, list, list[str]]:
    op = cls(tok, **BOTH_KW, **(OUR_KW if cls is OurOP else {}))
    collectors: list[RequestOutputCollector] = []
    child_ids: list[str] = []
    for p in range(batch // n):
        sp = SamplingParams(max_tokens=1 << 20, output_kind=RequestOutputKind.DELTA, stop=stop, n=n)
        rid = f"r{p}"
        req = EngineCoreRequest(
            request_id=rid,
            prompt_token_ids=ids[:16],
            mm_features=None,
            sampling_params=sp,
            pooling_params=None,
            arrival_time=time.time(),
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
            external_req_id=rid,
        )
        q = RequestOutputCollector(RequestOutputKind.DELTA, rid)
        collectors.append(q)
        if n == 1:
            op.add_request(req, None, None, 0, q)
            child_ids.append(rid)
            continue
        parent = ParentRequest(req)
        for idx in range(n):
            cid, csp = parent.get_child_info(idx)
            child = EngineCoreRequest(
                request_id=cid,
                prompt_token_ids=ids[:16],
                mm_features=None,
                sampling_params=csp,
                pooling_params=None,
                arrival_time=req.arrival_time,
                lora_request=None,
                cache_salt=None,
                data_parallel_rank=None,
                external_req_id=rid,
            )
            op.add_request(child, None, parent, idx, q)
            child_ids.append(cid)
    return op, collectors, child_ids


def step_outputs(child_ids: list[str], ids: list[int], offs: list[int], s: int) -> list[EngineCoreOutput]:
    return [EngineCoreOutput(request_id=cid, new_token_ids=[ids[(offs[i] + s) % len(ids)]])
            for i, cid in enumerate(child_ids)]


def timed_step(op: Any, outs: list[EngineCoreOutput]) -> float:
    stats = IterationStats() if BOTH_KW["log_stats"] else None
    t0 = time.perf_counter()
    op.process_outputs(outs, time.monotonic(), stats)
    return time.perf_counter() - t0


def run_pair(
    tok: Any, ids: list[int], batch: int, steps: int, stop: list[str] | None = None, n: int = 1,
    block: int = 1,
) -> tuple[list[float], list[float]]:
    """Seconds per process_outputs call of stock and ours, paired (after warm-up).

    The two processors take turns (who goes first alternates), so both see the same
    machine: this VM's CPU speed drifts by up to about 2x within seconds
    (tools/cpu_drift.py), which made runs seconds apart disagree by as much. With
    block=1 they take turns every step. With block=K each runs K steps in a row and
    the first of them is not timed: it starts with caches holding the other
    processor's working set, which a server's output loop never does (there, the
    step before is its own, with its own consumers in between)."""
    sides = [_setup(cls, tok, ids, batch, stop, n) for cls in (StockOP, OurOP)]
    rng = random.Random(0)
    offs = [rng.randrange(len(ids)) for _ in sides[0][2]]
    times: list[list[float]] = [[], []]
    for start in range(0, steps, block):
        for k in taking_turns((0, 1), start // block):
            op, collectors, child_ids = sides[k]
            for s in range(start, min(start + block, steps)):
                t = timed_step(op, step_outputs(child_ids, ids, offs, s))
                if block == 1 or s > start:
                    times[k].append(t)
                if (s + 1) % DRAIN_EVERY == 0:
                    for q in collectors:
                        q.get_nowait()
    c = sides[1][0].counters()  # every request ran the fast loop, with the detokenizer asked for
    assert c["fallback_steps"] == 0 and c["native_detok"] == (0 if OUR_KW else len(sides[1][2])), c
    return times[0][5:], times[1][5:]


def rss_mib() -> float:
    """Current resident set size (not the peak)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def rss_run(tok: Any, ids: list[int], request_steps: int, batch: int = 1024) -> tuple[float, float]:
    """RSS after a warm-up of 50 steps, and after `request_steps` more."""
    op, collectors, child_ids = _setup(OurOP, tok, ids, batch, None, 1)
    offs = list(range(len(child_ids)))

    def step(s: int) -> None:
        op.process_outputs(step_outputs(child_ids, ids, offs, s))
        for q in collectors:
            q.get_nowait()

    for s in range(50):
        step(s)
    gc.collect()
    before = rss_mib()
    for s in range(request_steps // batch):
        step(50 + s)
    gc.collect()
    return before, rss_mib()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--quick", action="store_true", help="fewer batches/steps (smoke run)")
    ap.add_argument("--python-detok", action="store_true", help="force vLLM's Python detokenizer in ours")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes")
    ap.add_argument("--log-stats", action="store_true", help="both processors with log_stats=True and IterationStats")
    ap.add_argument("--repeat", type=int, default=3, help="paired stock/ours runs per row (their steps pooled)")
    ap.add_argument("--block", type=int, default=1,
                    help="steps each processor runs in a row, the first untimed (1: turns every step)")
    ap.add_argument("--drain-every", type=int, default=1,
                    help="take the collectors' outputs every K steps (K > 1: outputs are merged)")
    args = ap.parse_args()
    global DRAIN_EVERY
    DRAIN_EVERY = max(1, args.drain_every)
    if args.python_detok:
        OUR_KW["native_detok"] = False
    if args.log_stats:
        BOTH_KW["log_stats"] = True
    if args.tokenizer is None:
        from tiny_model import ensure_tiny_model

        args.tokenizer = str(ensure_tiny_model())
    tok = get_tokenizer(args.tokenizer)
    ids = tok.encode(TEXT, add_special_tokens=False)
    # As vLLM's API server does after start-up (the output loop runs there):
    # the start-up heap is frozen so full collections skip it.
    freeze_gc_heap()
    batches = (64, 1024) if args.quick else (64, 256, 1024, 4096)
    if args.batches:
        batches = tuple(int(b) for b in args.batches.split(","))
    block = max(1, args.block)
    print(f"statistics {'on' if BOTH_KW['log_stats'] else 'off'}, collectors drained every {DRAIN_EVERY} step(s), "
          f"turns every {block} step(s)")
    print(f"{'variant':8s} {'batch':>6s} {'stock_us':>9s} {'ours_us':>9s} {'ratio':>6s}")
    rows = []
    for variant in args.variants.split(","):
        cfg = VARIANTS[variant]
        for b in batches:
            steps = 12 if args.quick else (60 if b < 4096 else 25)
            steps *= 1 if block == 1 else 2  # at least as many timed steps when a block's first is dropped
            stock_t: list[float] = []
            ours_t: list[float] = []
            for _ in range(1 if args.quick else args.repeat):
                st, ot = run_pair(tok, ids, b, steps, **cfg, block=block)
                stock_t += st
                ours_t += ot
            stock = statistics.median(stock_t)
            ours = statistics.median(ours_t)
            row = {
                "variant": variant,
                "batch": b,
                "log_stats": BOTH_KW["log_stats"],
                "drain_every": DRAIN_EVERY,
                "block": block,
                "stock_us": round(stock * 1e6 / b, 3),
                "ours_us": round(ours * 1e6 / b, 3),
                **paired_ratios(stock_t, ours_t),
            }
            rows.append(row)
            print(f"{variant:8s} {b:6d} {row['stock_us']:9.2f} {row['ours_us']:9.2f} {row['ratio']:6.2f}")
    for row in rows:
        print(json.dumps(row))
    total = 100_000 if args.quick else 1_000_000
    before, after = rss_run(tok, ids, total)
    print(json.dumps({"rss_mib_before": round(before, 1), "rss_mib_after": round(after, 1), "request_steps": total}))


if __name__ == "__main__":
    main()
