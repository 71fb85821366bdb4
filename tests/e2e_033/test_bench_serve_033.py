"""`make bench-serve-033`'s harness at its smallest size: the Python front ends on vLLM
0.33.0 or 0.34.0 (this interpreter's), stock and with the plugin, and vLLM's Rust front
end of the same release, each behind that release's mock engine, loaded by `vllm-rs bench
serve`. The harness itself refuses a run whose stock front end loaded the plugin, or
whose plugin front end did not run it (their start-up log lines); no timed assertions."""

from __future__ import annotations

import pathlib
import sys

import pytest
from e033_helpers import TARGETS, installed_vllm_version, requires_plugin_on_this_vllm

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT / "benches") not in sys.path:
    sys.path.insert(0, str(ROOT / "benches"))

import bench_serve  # noqa: E402


@pytest.fixture(scope="module")
def quick_rows() -> list[dict]:
    requires_plugin_on_this_vllm()
    args = bench_serve.parse_args(["--quick"])
    for binary in (args.tools.mock_engine, args.tools.vllm_rs):
        assert binary.exists(), f"{binary} missing: `make {bench_serve.mock_make_target()}`"
    return bench_serve.main(["--quick", "--rates", "", "--stock-fraction", "0"])


def test_rows_are_served_by_the_installed_vllm(quick_rows: list[dict]) -> None:
    version = installed_vllm_version()
    assert version in TARGETS
    assert sorted(r["config"] for r in quick_rows) == sorted(["stock/on", "plugin/on", "rust/on"])
    for r in quick_rows:
        assert r["vllm"] == version
        assert (r["endpoint"], r["concurrency"], r["request_rate"]) == ("chat", 8, None)
        assert r["req_s"] > 0 and r["steady_state_runs"] == 1
        # every request produced its 256 tokens
        assert r["tok_s"] == pytest.approx(256 * r["req_s"], rel=0.02)
        assert 0 < r["ttft_p50"] <= r["ttft_p99"]
    by = {r["config"]: r for r in quick_rows}
    assert by["plugin/on"]["vs_stock"] == pytest.approx(
        by["plugin/on"]["req_s"] / by["stock/on"]["req_s"], rel=0.02)
