"""`make bench-serve`'s harness at its smallest size, for real: stock, the plugin and
vLLM's Rust front end, each behind vLLM's mock engine, loaded by `vllm-rs bench serve`.

Checks that every row is there and sane (the harness itself refuses a run in which a
request failed; the numbers are positive and consistent with each other);
no timed assertions.
Needs `make mock-engine`'s binaries; without them the test is skipped, unless
VLLM_MMRETRY_REQUIRE_MOCK_ENGINE=1 (then it fails)."""

from __future__ import annotations

import json
import os
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benches"))

import bench_serve  # noqa: E402

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def quick_rows(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], pathlib.Path]:
    args = bench_serve.parse_args(["--quick"])
    missing = [str(p) for p in (args.tools.mock_engine, args.tools.vllm_rs) if not os.access(p, os.X_OK)]
    if missing:
        if os.environ.get("VLLM_MMRETRY_REQUIRE_MOCK_ENGINE") == "1":
            pytest.fail(f"missing {missing}: run `make mock-engine`")
        pytest.skip(f"missing {missing}: run `make mock-engine`")
    out = tmp_path_factory.mktemp("bench-serve") / "rows.jsonl"
    rows = bench_serve.main(["--quick", "--json-out", str(out)])
    return rows, out


def test_every_configuration_has_a_sane_row(quick_rows: tuple[list[dict], pathlib.Path]) -> None:
    rows, _ = quick_rows
    assert sorted(r["config"] for r in rows) == sorted(["stock/on", "plugin/on", "rust/on"])
    for r in rows:
        assert (r["endpoint"], r["concurrency"], r["repeats"]) == ("chat", 8, 1)
        assert r["req_s"] > 0 and r["req_s_min"] <= r["req_s"] <= r["req_s_max"]
        # every request produced its 256 tokens: token rate is 256 x request rate
        assert r["tok_s"] == pytest.approx(256 * r["req_s"], rel=0.02)
        assert 0 < r["ttft_p50"] <= r["ttft_p99"]
        # chunks that arrive in one read are ~0 ms apart: only the order is checked
        assert 0 <= r["itl_p50"] <= r["itl_p99"]
        assert r["tpot_p50"] >= 0 and r["ttft_p50"] <= r["e2el_p50"]
        assert r["steady_state_runs"] == 1  # vllm-bench found a steady-state window
        # /proc counts CPU in 10 ms ticks: the Rust front end serves the smoke run's
        # 3,072 tokens in about 0.04 s of CPU, and may show none.
        assert r["cpu_per_1k"] > 0 or (r["config"] == "rust/on" and r["cpu_per_1k"] == 0)
    by = {r["config"]: r for r in rows}
    assert "vs_stock" not in by["stock/on"]
    for name in ("plugin/on", "rust/on"):
        assert by[name]["vs_stock"] == pytest.approx(by[name]["req_s"] / by["stock/on"]["req_s"], rel=0.02)


def test_json_lines_match_the_rows(quick_rows: tuple[list[dict], pathlib.Path]) -> None:
    rows, out = quick_rows
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows
