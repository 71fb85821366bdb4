"""`make bench-serve`'s harness at its smallest size, for real: stock, the plugin and
vLLM's Rust front end, each behind vLLM's mock engine, loaded by `vllm-rs bench serve`.

Checks that every row is there and sane (the harness itself refuses a run in which a
request failed; the numbers are positive and consistent with each other), and that
--call-times accounts the Python front ends' engine-output messages; no timed assertions.
Needs `make mock-engine`'s binaries; without them the test is skipped, unless
VLLM_MMRETRY_REQUIRE_MOCK_ENGINE=1 (then it fails)."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benches"))

import bench_serve  # noqa: E402
from e2e_helpers import require_executables  # noqa: E402

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def quick_rows(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], pathlib.Path]:
    args = bench_serve.parse_args(["--quick"])
    require_executables(args.tools.mock_engine, args.tools.vllm_rs)
    out = tmp_path_factory.mktemp("bench-serve") / "rows.jsonl"
    rows = bench_serve.main(["--quick", "--call-times", "--json-out", str(out)])
    return rows, out


def closed_loop(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["request_rate"] is None]


def open_loop(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["request_rate"] is not None]


def test_every_configuration_has_a_sane_row(quick_rows: tuple[list[dict], pathlib.Path]) -> None:
    rows = closed_loop(quick_rows[0])
    assert sorted(r["config"] for r in rows) == sorted(["stock/on", "plugin/on", "rust/on"])
    for r in rows:
        assert (r["endpoint"], r["concurrency"], r["repeats"]) == ("chat", 8, 1)
        assert r["vllm"] == bench_serve.installed_vllm_version()  # the Python front ends' vLLM
        assert r["output_len"] == 256
        assert r["req_s"] > 0 and r["req_s_min"] <= r["req_s"] <= r["req_s_max"]
        assert r["req_s_repeats"] == [r["req_s"]]  # one repeat: its value is the median
        # every request produced its 256 tokens: token rate is 256 x request rate
        assert r["tok_s"] == pytest.approx(256 * r["req_s"], rel=0.02)
        assert 0 < r["ttft_p50"] <= r["ttft_p99"]
        # chunks that arrive in one read are ~0 ms apart: only the order is checked
        assert 0 <= r["itl_p50"] <= r["itl_p99"]
        assert r["tpot_p50"] >= 0 and r["ttft_p50"] <= r["e2el_p50"]
        assert r["steady_state_runs"] == 1  # vllm-bench found a steady-state window
        # streamed events with a choice: the role event, then at most one per token and
        # one with the finish reason (a front end that keeps up sends all of them)
        assert 2 <= r["events_per_req"] <= 1 + 256 + 1
        # /proc counts CPU in 10 ms ticks: the Rust front end serves the smoke run's
        # 8,192 tokens in about 0.1 s of CPU, and may show none.
        assert r["cpu_per_1k"] > 0 or (r["config"] == "rust/on" and r["cpu_per_1k"] == 0)
        assert r["e2el_p50"] <= r["e2el_p99"] and r["ttft_p99"] <= r["e2el_p99"]
        # a response in parts has a gap over 1 ms; none in parts, no gap to report
        assert 0 <= r["split_pct"] <= 100
        assert (r["split_gap_ms"] > 1) == (r["split_pct"] > 0)
    by = {r["config"]: r for r in rows}
    assert "vs_stock" not in by["stock/on"]
    for name in ("plugin/on", "rust/on"):
        assert by[name]["vs_stock"] == pytest.approx(by[name]["req_s"] / by["stock/on"]["req_s"], rel=0.02)
        assert by[name]["vs_stock_repeats"] == [by[name]["vs_stock"]]
        for key in ("ttft_p99", "itl_p99", "e2el_p99"):  # one repeat compared
            at_or_below = int(by[name][key] <= by["stock/on"][key])
            assert by[name][f"{key}_le_stock"] == [at_or_below, 1]


def test_open_loop_rows_keep_the_offered_rate(quick_rows: tuple[list[dict], pathlib.Path]) -> None:
    """--quick's open-loop pass: 30 requests/s for 2 s on each configuration, far below
    what any of them serves, so each completes them at about the offered rate. On a slow
    moment 0.9 x stock's closed-loop rate can round to 30 too (stock at 33.5 requests/s in
    one CI run): then one run serves as both, and its rows also carry `stock_fraction`."""
    rows = [r for r in open_loop(quick_rows[0]) if r["request_rate"] == 30.0]
    assert sorted(r["config"] for r in rows) == sorted(["stock/on", "plugin/on", "rust/on"])
    for r in rows:
        assert (r["endpoint"], r["request_rate"], r["repeats"]) == ("chat", 30.0, 1)
        assert r["concurrency"] == bench_serve.PACED_CONCURRENCY
        # 60 Poisson arrivals; the run ends with the last response, a little after 2 s
        assert 10 < r["req_s"] < 60
        assert r["tok_s"] == pytest.approx(256 * r["req_s"], rel=0.02)
        assert 0 < r["ttft_p50"] <= r["ttft_p99"] and 0 <= r["itl_p50"] <= r["itl_p99"]
    by = {r["config"]: r for r in rows}
    assert by["plugin/on"]["vs_stock"] == pytest.approx(
        by["plugin/on"]["req_s"] / by["stock/on"]["req_s"], rel=0.02)


def test_a_row_at_stocks_saturation_offers_what_stock_served(
        quick_rows: tuple[list[dict], pathlib.Path]) -> None:
    """--stock-fraction (0.9 by default): an open-loop rate of 0.9 x stock/on's
    closed-loop requests/s, run on every statistics-on configuration."""
    rows = quick_rows[0]
    stock_closed = next(r for r in closed_loop(rows) if r["config"] == "stock/on")
    at_saturation = [r for r in open_loop(rows) if "stock_fraction" in r]
    assert sorted(r["config"] for r in at_saturation) == sorted(["stock/on", "plugin/on", "rust/on"])
    for r in at_saturation:
        assert r["stock_fraction"] == 0.9
        assert r["request_rate"] == round(0.9 * stock_closed["req_s"])
        assert bench_serve.load_label(r) == f"{r['request_rate']:g}/s (0.9× stock)"
        assert r["req_s"] > 0


def test_call_times_account_every_message(quick_rows: tuple[list[dict], pathlib.Path]) -> None:
    by = {r["config"]: r for r in closed_loop(quick_rows[0])}
    assert "calls" not in by["rust/on"]  # not a Python process
    for name in ("stock/on", "plugin/on"):
        c = by[name]["calls"]
        # 256 tokens per request, one per engine step: at most 256 messages carry a request
        assert 1 <= c["msgs_per_req"] <= 256 + 1
        assert c["outputs_per_msg"] >= 1
        assert c["cpu_us_per_msg"] > 0
        for part in ("process_outputs", "record", "decode"):
            assert c[part + "_us_per_msg"] > 0
            assert 0 < c[part + "_cpu_share"] < 1
        # the output handler's queue: it catches up at least once per run, and the
        # messages of a catch-up are those of its requests
        assert c["backlog_msgs"] >= 0
        assert c["msgs_per_catch_up"] >= 1 and c["reqs_per_catch_up"] > 0
        assert c["msgs_per_catch_up"] / c["reqs_per_catch_up"] == pytest.approx(c["msgs_per_req"], rel=0.1)


def test_call_times_of_is_per_message() -> None:
    before = {"cpu": 10.0, "calls": {"decode": [5, 0, 0.5], "record": [5, 0, 1.0],
                                      "process_outputs": [5, 10, 1.0]}}
    after = {"cpu": 12.0, "calls": {"decode": [105, 0, 0.52], "record": [105, 0, 1.1],
                                     "process_outputs": [105, 410, 1.2],
                                     "plugin.process_outputs": [100, 400, 0.3]}}
    # 40 asks (the plugin's handler takes the messages waiting behind one in the same
    # ask); no snapshot before the first ask
    after["calls"]["output_queue"] = [40, 1000, 5]
    c = bench_serve.call_times_of(before, after, num_prompts=4)
    # the plugin's own process_outputs is the per-message one when it ran
    assert c["msgs_per_req"] == 25 and c["outputs_per_msg"] == 4
    assert c["cpu_us_per_msg"] == pytest.approx(20000)
    assert c["process_outputs_us_per_msg"] == pytest.approx(3000)
    assert c["record_us_per_msg"] == pytest.approx(1000)
    assert c["decode_us_per_msg"] == pytest.approx(200)
    assert c["record_cpu_share"] == pytest.approx(0.05)
    # 40 asks found 25 messages waiting on average and nothing waiting 5 times: 100
    # messages in 5 catch-ups
    assert c["backlog_msgs"] == 25 and c["msgs_per_catch_up"] == 20
    assert c["reqs_per_catch_up"] == pytest.approx(0.8)
    del after["calls"]["output_queue"]
    assert "backlog_msgs" not in bench_serve.call_times_of(before, after, num_prompts=4)


def test_a_run_is_refused_when_a_front_end_is_not_what_its_name_says(tmp_path: pathlib.Path) -> None:
    """The plugin's start-up lines, as vLLM 0.32 logs them in a served run, decide."""
    plugin_line = ("(MainProcess pid=1) INFO 12-03 19:12:43 [plugin.py:57] vllm-mmretry active for "
                   "vLLM 0.32.0 (MainProcess pid=1): patched RequestOutput.__init__\n")
    stock_line = ("(MainProcess pid=2) INFO 12-03 19:12:42 [plugin.py:57] vllm-mmretry disabled by "
                  "VLLM_MMRETRY=0 (MainProcess pid=2); vLLM left unpatched\n")

    def frontends(logs: dict[str, str]) -> dict[str, bench_serve.Frontend]:
        fes = {}
        for i, (name, text) in enumerate(logs.items()):
            path = tmp_path / f"{name.replace('/', '-')}-{i}.log"
            path.write_text(text)
            fes[name] = bench_serve.Frontend(name, 0, path, proc=None)  # type: ignore[arg-type]
        return fes

    good = {"stock/on": stock_line, "plugin/off": plugin_line, "rust/on": ""}
    bench_serve.check_plugin_state(frontends(good), "0.32.0")
    for bad, version in (({**good, "stock/on": plugin_line}, "0.32.0"),
                         ({**good, "plugin/off": stock_line}, "0.32.0"),
                         (good, "0.33.0")):
        with pytest.raises(RuntimeError, match="its log lacks"):
            bench_serve.check_plugin_state(frontends(bad), version)


def test_json_lines_match_the_rows(quick_rows: tuple[list[dict], pathlib.Path]) -> None:
    rows, out = quick_rows
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows


def test_closed_loop_runs_have_at_least_min_prompts() -> None:
    """4 x concurrency requests per closed-loop run, and at least --min-prompts (256 by
    default): at concurrency 8 the factor alone gave a sub-second run. --quick keeps 32."""
    args = bench_serve.parse_args(["--configs", "stock/on,plugin/on", "--endpoints", "chat",
                                   "--concurrency", "8,32,128", "--rates", ""])
    closed = {(conc, n) for _, _, conc, rate, n in bench_serve.load_points(args, args.configs, 0)
              if rate is None}
    assert closed == {(8, 256), (32, 256), (128, 512)}
    quick = bench_serve.parse_args(["--quick"])
    assert {n for *_, rate, n in bench_serve.load_points(quick, quick.configs, 0) if rate is None} == {32}


def test_output_len_reaches_the_load_and_the_columns() -> None:
    """--output-len sets the load generator's output length and what the token columns
    count: the mock engine emits exactly that many tokens per request."""
    args = bench_serve.parse_args(["--output-len", "1"])
    assert args.output_len == 1
    assert bench_serve.parse_args([]).output_len == 256
    with pytest.raises(SystemExit):
        bench_serve.parse_args(["--output-len", "0"])
    fe = bench_serve.Frontend("stock/on", 8000, pathlib.Path("log"), proc=None)  # type: ignore[arg-type]
    cmd = bench_serve.bench_cmd(args.tools, fe, "m", "chat", 8, 16, pathlib.Path("r.json"), 0,
                                output_len=1)
    assert cmd[cmd.index("--random-output-len") + 1] == "1"
    res = {"completed": 16, "request_throughput": 400.0, "median_ttft_ms": 1.0, "p99_ttft_ms": 2.0,
           "median_itl_ms": 0.0, "p99_itl_ms": 0.0, "median_tpot_ms": 0.0, "median_e2el_ms": 1.0,
           "p99_e2el_ms": 2.0,
           "itls": [[]] * 16}
    m = bench_serve.measurements(res, cpu=0.04, num_prompts=16, output_len=1)
    assert m["tok_s"] == 400.0
    assert m["cpu_per_1k"] == pytest.approx(2.5)  # 0.04 s over 16 requests of 1 token
    assert (m["split_pct"], m["split_gap_ms"]) == (0.0, 0.0)  # every response whole
    assert bench_serve.measurements(res, cpu=0.04, num_prompts=16)["tok_s"] == 400.0 * 256


def test_listen_queue_counts_connections_not_yet_accepted() -> None:
    """The kernel completes a client's connect before the server accepts it; until then
    the connection waits in the listening socket's queue, which /proc reports."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        port = server.getsockname()[1]
        assert bench_serve.listen_queue(port) == 0
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(5)]
        try:
            assert bench_serve.listen_queue(port) == 5
            accepted, _ = server.accept()
            accepted.close()
            assert bench_serve.listen_queue(port) == 4
        finally:
            for c in clients:
                c.close()
    assert bench_serve.listen_queue(port) is None
    assert not bench_serve.is_listening(port)


def test_accept_queue_sampling_sees_a_burst_until_it_is_accepted() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        port = server.getsockname()[1]
        with bench_serve.accept_queue_sampled(port, every_s=0.01) as idle:
            time.sleep(0.1)
        assert idle == {"accept_wait_s": 0.0, "accept_peak": 0.0}
        with bench_serve.accept_queue_sampled(port, every_s=0.01) as burst:
            opened = time.monotonic()
            clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
            time.sleep(0.1)
            for _ in clients:
                server.accept()[0].close()
            accepted = time.monotonic()
            time.sleep(0.1)  # sampled, nothing waiting
        for c in clients:
            c.close()
        assert burst["accept_peak"] == 3.0
        # the samples that saw connections waiting all came before the accepts
        assert 0.0 < burst["accept_wait_s"] <= accepted - opened + 0.01


def test_a_load_run_nobody_answers_fails_with_both_logs(tmp_path: pathlib.Path) -> None:
    """A front end that accepts requests and never answers (as one whose engine drops
    them does): the run ends at its limit with the server's and the engine's log tails,
    instead of waiting as long as vllm-rs bench would."""
    tools = bench_serve.parse_args(["--quick"]).tools
    require_executables(tools.vllm_rs)
    log = tmp_path / "stock-on-1.log"
    log.write_text("server says hello\n")
    from tiny_model import ensure_tiny_model  # tools/, on the path bench_serve set

    model = str(ensure_tiny_model())
    with socket.socket() as server, subprocess.Popen(["sleep", "60"]) as api:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        fe = bench_serve.Frontend("stock/on", server.getsockname()[1], log, proc=api)
        fe.engine_log_path.write_text("failed to decode engine request message\n")
        try:
            started = time.monotonic()
            with pytest.raises(RuntimeError) as err:
                bench_serve.run_load(tools, fe, model, "chat", 2, 2, tmp_path, timeout=3)
            assert time.monotonic() - started < 30
        finally:
            api.kill()
    message = str(err.value)
    assert "did not finish in 3s on stock/on" in message
    assert "server says hello" in message
    assert "failed to decode engine request message" in message


def test_profile_splits_samples_by_thread() -> None:
    """py-spy --threads labels each stack with its thread; the profile keeps all
    threads' samples and can take the event-loop (main) thread's alone."""
    sys.path.insert(0, str(ROOT / "tools"))
    import profile_serve

    raw = ("thread (0x7f01): MainThread;run (asyncio/runners.py:118);"
           "process_outputs (site-packages/vllm/v1/engine/output_processor.py:700) 5\n"
           "thread (0x7f02): ThreadPoolExecutor-3_0;"
           "_encode_plus (site-packages/transformers/tokenization_utils_tokenizers.py:9) 3\n"
           "thread (0x7f03): ZMQbg/IO/0 2\n")
    everything = profile_serve.parse_collapsed(raw)
    main = profile_serve.parse_collapsed(raw, profile_serve.MAIN_THREAD)
    assert [count for _, count in everything] == [5, 3]  # the frameless thread is dropped
    assert main == [(["run (asyncio/runners.py)",
                      "process_outputs (vllm/v1/engine/output_processor.py)"], 5)]
    areas = dict(profile_serve.summarize_profile(main)["areas"])
    assert areas == {"output loop (process_outputs, collectors)": 100.0}
    assert profile_serve.parse_collapsed("a (x.py:1);b (y.py:2) 4\n") == [(["a (x.py)", "b (y.py)"], 4)]


def test_thread_cpu_names_the_main_thread() -> None:
    sys.path.insert(0, str(ROOT / "tools"))
    import profile_serve

    cpu = profile_serve.thread_cpu(os.getpid())
    assert f"{profile_serve.MAIN_THREAD} {os.getpid()}" in cpu
    assert all(v >= 0 for v in cpu.values())
    busy, total = profile_serve.machine_busy()
    assert 0 <= busy <= total


def test_events_per_request_count_each_requests_streamed_events() -> None:
    """`--save-detailed` keeps each request's gaps between streamed events: a request
    with k gaps arrived in k + 1 events."""
    res = {"itls": [[0.5, 0.25, 0.0], [], [1.0]]}
    assert bench_serve.events_per_request(res) == pytest.approx((4 + 1 + 2) / 3)


def test_split_responses_are_those_with_a_gap_over_a_millisecond() -> None:
    res = {"itls": [[0.0002, 0.0004], [0.0001, 0.012], [], [0.003, 0.0005, 0.007]]}
    assert bench_serve.split_responses(res) == {"split_pct": 50.0, "split_gap_ms": pytest.approx(9.5)}
    assert bench_serve.split_responses({"itls": [[0.0009], []]}) == {"split_pct": 0.0, "split_gap_ms": 0.0}


def test_latency_is_compared_with_stocks_repeat_by_repeat() -> None:
    def run(rep: int, ttft: float, itl: float) -> dict[str, float]:
        return {"repeat": rep, "ttft_p99": ttft, "itl_p99": itl, "e2el_p99": ttft + 1}

    stock = [run(0, 100, 0.2), run(1, 90, 20.0), run(2, 80, 5.0)]
    plugin = [run(1, 95, 4.0), run(0, 40, 0.3), run(2, 80, 6.0), run(3, 1, 0.0)]  # 3: no stock run
    assert bench_serve.repeats_at_or_below(plugin, stock) == {
        "ttft_p99_le_stock": [2, 3], "itl_p99_le_stock": [1, 3], "e2el_p99_le_stock": [2, 3]}


def test_the_saturation_rate_is_a_fraction_of_stocks_first_repeat() -> None:
    args = bench_serve.parse_args(["--concurrency", "8,32"])
    assert args.stock_fraction == 0.9
    runs = {("stock/on", "chat", 8, None): [{"repeat": 0, "req_s": 100.0}, {"repeat": 1, "req_s": 400.0}],
            ("stock/on", "chat", 32, None): [{"repeat": 0, "req_s": 150.0}],
            ("plugin/on", "chat", 32, None): [{"repeat": 0, "req_s": 300.0}],
            ("stock/on", "chat", 256, 30.0): [{"repeat": 0, "req_s": 30.0}]}
    assert bench_serve.saturation_rate(args, "chat", runs) == [135]
    runs[("stock/on", "chat", 8, None)][0]["req_s"] = 1000.0  # found once, then kept
    assert bench_serve.saturation_rate(args, "chat", runs) == [135]
    assert bench_serve.saturation_rate(args, "completions", runs) == []  # nothing measured
    assert bench_serve.saturation_rate(bench_serve.parse_args(["--stock-fraction", "0"]), "chat", runs) == []
    points = list(bench_serve.load_points(args, ["stock/on", "stock/off"], 0, runs))
    assert [(p[0], p[1], p[3], p[4]) for p in points if p[3] is not None] == [
        ("stock/on", "chat", 30.0, 180), ("stock/on", "chat", 135, 810), ("stock/on", "completions", 30.0, 180)]
