"""`make bench-py`'s harness at a small size, for real (stock's and our OutputProcessor):
the two take turns step by step, every row is there and sane. No timed assertions."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benches"))

import bench_output_loop  # noqa: E402


def test_run_pair_times_both_sides_every_step(tiny_tokenizer) -> None:
    ids = tiny_tokenizer.encode(bench_output_loop.TEXT, add_special_tokens=False)
    for cfg in bench_output_loop.VARIANTS.values():
        stock, ours = bench_output_loop.run_pair(tiny_tokenizer, ids, 8, 12, **cfg)
        # The first 5 steps are warm-up; one time per processor per later step.
        assert len(stock) == len(ours) == 7
        assert all(t > 0 for t in stock + ours)


def test_run_pair_in_blocks_leaves_each_blocks_first_step_untimed(tiny_tokenizer) -> None:
    ids = tiny_tokenizer.encode(bench_output_loop.TEXT, add_special_tokens=False)
    stock, ours = bench_output_loop.run_pair(tiny_tokenizer, ids, 8, 24, block=4)
    # 6 blocks of 4 steps per processor, 3 timed in each: 18, less 5 of warm-up.
    assert len(stock) == len(ours) == 13
    assert all(t > 0 for t in stock + ours)


def test_rows_carry_paired_ratio_and_spread(tiny_model_path: str) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benches" / "bench_output_loop.py"), "--quick", "--tokenizer",
         tiny_model_path, "--batches", "4,16", "--log-stats"],
        capture_output=True, text=True, timeout=600, check=True)
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    rows = [r for r in lines if "ratio" in r]
    assert {(r["variant"], r["batch"]) for r in rows} == {
        (v, b) for v in bench_output_loop.VARIANTS for b in (4, 16)}
    for r in rows:
        assert r["log_stats"] is True and r["stock_us"] > 0 and r["ours_us"] > 0
        lo, hi = r["ratio_p10_p90"]
        assert 0 < lo <= r["ratio"] <= hi
    rss = [r for r in lines if "rss_mib_after" in r]
    assert len(rss) == 1 and rss[0]["request_steps"] == 100_000


@pytest.mark.parametrize("multiprocess", [False, True])
def test_bench_record_runs_both_loggers(multiprocess: bool, tmp_path: pathlib.Path) -> None:
    """benches/bench_record.py at a small size: both loggers record, a row comes
    out; with PROMETHEUS_MULTIPROC_DIR set, on multiprocess values, patched too."""
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    if multiprocess:
        env["PROMETHEUS_MULTIPROC_DIR"] = str(tmp_path)
    out = subprocess.run(
        [sys.executable, str(ROOT / "benches" / "bench_record.py"), "--blocks", "4", "--per-block", "20"],
        capture_output=True, text=True, timeout=600, check=True, env=env)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["multiprocess"] is multiprocess
    assert row["patched_metrics"] > 20
    assert row["stock_us"] > 0 and row["native_us"] > 0 and row["ratio"] > 0
    assert bool(list(tmp_path.glob("*.db"))) is multiprocess


def test_bench_receive_reads_all_three_ways() -> None:
    """benches/bench_receive.py at a small size: pyzmq, ready-first and the native thread
    read vLLM's message (also awaited, as vLLM's output task does), a row comes out."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benches" / "bench_receive.py"), "--blocks", "4", "--per-block", "50"],
        capture_output=True, text=True, timeout=600, check=True)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["frames_per_message"] == 1
    assert row["pyzmq_us"] > 0 and row["ready_first_us"] > 0 and row["native_thread_us"] > 0
    assert row["awaited_pyzmq_us"] > 0 and row["awaited_ready_first_us"] > 0
    for key in ("ratio", "native_ratio", "awaited_ratio"):
        lo, hi = row[f"{key}_p10_p90"]
        assert 0 < lo <= row[key] <= hi
