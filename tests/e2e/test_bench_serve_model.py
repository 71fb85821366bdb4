"""`benches/bench_serve_model.py` at its smallest, for real: stock and the plugin each with
the tiny model's own CPU engine, loaded by `vllm-rs bench serve`. The harness refuses a
run in which a request failed or a front end is not what its name says (its start-up log
line); here the rows are checked to be there and consistent. No timed assertions."""

from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benches"))

import bench_serve  # noqa: E402
import bench_serve_model  # noqa: E402
from e2e_helpers import require_executables  # noqa: E402

pytestmark = pytest.mark.e2e


def test_stock_and_the_plugin_serve_the_load_with_a_real_engine() -> None:
    require_executables(bench_serve.MOCK_DIR / "vllm-rs")
    rows = bench_serve_model.main(["--concurrency", "8", "--num-prompts", "16", "--repeat", "1",
                                   "--warm-up", "0"])
    by = {r["config"]: r for r in rows}
    assert sorted(by) == ["plugin/on", "stock/on"]
    for r in rows:
        assert r["repeats"] == 1
        assert r["req_s_min"] == r["req_s"] == r["req_s_max"] > 0
        assert 0 < r["ttft_p99"] <= r["e2el_p99"]
        assert 0 <= r["split_pct"] <= 100 and r["cpu_per_1k"] >= 0
    plugin, stock = by["plugin/on"], by["stock/on"]
    assert "itl_p99_le_stock" not in stock
    for key in ("ttft_p99", "itl_p99", "e2el_p99"):
        assert plugin[f"{key}_le_stock"] == [int(plugin[key] <= stock[key]), 1]
