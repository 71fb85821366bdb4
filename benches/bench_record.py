"""vLLM's `PrometheusStatLogger.record` with prometheus_client's own metric updates
(stock) and with the native ones (prom.py), side by side in one process.

Two loggers are built from the tiny model's config; one gets `prom.speed_up`, and
the vllm.envs reads `record` makes are pinned while it runs (as at an engine build). They
record the same per-message statistics in alternating blocks (who goes first
alternates), so both see the same machine, and the ratio is taken block by block.
The statistics are what one engine-output message of the served benchmark carries:
scheduler stats, a few generated tokens with their inter-token latencies, and now
and then a finished request.

    .venv/bin/python benches/bench_record.py [--blocks 60] [--per-block 500]

With PROMETHEUS_MULTIPROC_DIR set (an empty directory; prometheus_client reads it at
import), the metrics store their values in per-process files, as vLLM's do with
`--api-server-count` > 1, and the row says `"multiprocess": true`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from paired import paired_ratios, taking_turns
from tiny_model import ensure_tiny_model
from vllm.config import DeviceConfig, ModelConfig, VllmConfig
from vllm.v1.engine import FinishReason
from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.metrics.stats import (
    FinishedRequestStats,
    IterationStats,
    PrefixCacheStats,
    SchedulerStats,
)

from vllm_mmretry import prom


def message_stats(rng: random.Random) -> tuple[SchedulerStats, IterationStats]:
    """One engine-output message's statistics, as in the served benchmark."""
    outputs = rng.randint(1, 4)
    sched = SchedulerStats(num_running_reqs=rng.randint(1, 64), num_waiting_reqs=rng.randint(0, 8),
                           kv_cache_usage=rng.random(), prefix_cache_stats=PrefixCacheStats())
    its = IterationStats()
    its.num_generation_tokens = outputs
    its.inter_token_latencies_iter = [rng.random() * 0.01 for _ in range(outputs)]
    if rng.random() < 0.01:
        its.finished_requests.append(FinishedRequestStats(
            finish_reason=FinishReason.LENGTH, e2e_latency=rng.random(), num_prompt_tokens=32,
            num_generation_tokens=256, max_tokens_param=256, queued_time=0.01, prefill_time=0.01,
            inference_time=rng.random(), decode_time=rng.random(), mean_time_per_output_token=0.001))
    return sched, its


def timed_block(logger: Any, block: list[tuple[SchedulerStats, IterationStats]]) -> float:
    t0 = time.perf_counter()
    for sched, its in block:
        logger.record(scheduler_stats=sched, iteration_stats=its, engine_idx=0)
    return (time.perf_counter() - t0) / len(block)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=60)
    ap.add_argument("--per-block", type=int, default=500)
    args = ap.parse_args()
    model = ModelConfig(model=str(ensure_tiny_model()), max_model_len=512, dtype="float32")
    config = VllmConfig(model_config=model, device_config=DeviceConfig(device="cpu"))
    stock = PrometheusStatLogger(config, engine_indexes=[0])
    fast = PrometheusStatLogger(config, engine_indexes=[0])
    assert prom.self_check() is None, prom.self_check()
    patched = len(prom.speed_up([fast]))
    rng = random.Random(0)
    times: dict[str, list[float]] = {"stock": [], "native": []}
    pinned: dict[str, Any] = {}
    for b in range(args.blocks + 2):
        block = [message_stats(rng) for _ in range(args.per_block)]
        for name, logger in taking_turns([("stock", stock), ("native", fast)], b):
            # The pinned vllm.envs reads are process-wide: only while the native side runs.
            if name == "native":
                pinned.update(prom.pin_stat_env_reads())
            t = timed_block(logger, block)
            prom.unpin_envs()
            if b >= 2:  # the first two blocks warm up
                times[name].append(t)
    row = {
        "multiprocess": prom.multiprocess_values(),
        "patched_metrics": patched,
        "pinned_envs": sorted(pinned),
        "stock_us": round(statistics.median(times["stock"]) * 1e6, 2),
        "native_us": round(statistics.median(times["native"]) * 1e6, 2),
        **paired_ratios(times["stock"], times["native"]),
    }
    mode = " (multiprocess files)" if row["multiprocess"] else ""
    print(f"record per message{mode}: stock {row['stock_us']} µs, native metrics {row['native_us']} µs, "
          f"{row['ratio']}x (p10-p90 {row['ratio_p10_p90'][0]}-{row['ratio_p10_p90'][1]}, "
          f"{patched} metrics patched)")
    print(json.dumps(row))


if __name__ == "__main__":
    main()
