"""Served speed: stock vLLM's API server, the plugin, and vLLM's Rust front end, each in
front of vLLM's own mock engine, loaded by vLLM's own Rust load generator, in one run.

Every configuration is one front end plus one `vllm-mock-engine` joined to its headless
handshake (`--data-parallel-size-local 0`), so the front end, not a model, is the
bottleneck. Configurations (started once, all kept up, reused by every repeat):
  stock/on   `vllm-mmretry serve` with VLLM_MMRETRY=0, statistics on (vllm serve's default)
  plugin/on  the same with the plugin
  stock/off, plugin/off   the same with --disable-log-stats (chat only by default, to keep
             the whole run under 15 minutes on 2 cores; --off-endpoints)
  rust/on    `vllm-rs serve` (vLLM's Rust front end, text only); rust/off on request
  permsg/on  on request: the plugin with statistics recorded per engine-output message,
             as vLLM does (VLLM_MMRETRY_CATCHUP_RECORDS=0): what the catch-up records give
  unmerged/on  on request: the plugin with the handler reading one waiting message at a
             time (VLLM_MMRETRY_MERGE_WAITING=0): what the merged reads give
Load: `vllm-rs bench serve`, streaming chat and streaming completions, random 32-token
prompts, 256 output tokens each (--output-len; ignore_eos: the mock engine stops by length),
closed loop at each concurrency with 4 x concurrency requests (--prompts-factor), and at least 256
(--min-prompts: at concurrency 8, 32 requests took the plugin about 0.3 s). Repeats alternate the
configurations (the order rotates every repeat), so load changes on a shared machine hit
all of them. After the closed-loop rows of an endpoint, open-loop rows at each of --rates
(default 30 requests/s, Poisson arrivals, 6 s per run) and at stock's saturation
(--stock-fraction, default 0.9 x stock/on's highest closed-loop requests/s on that endpoint
in the first repeat; the load column shows "(0.9× stock)") on the statistics-on
configurations: the same offered load for all is where inter-token latency compares fairly
(in the closed loop stock's responses arrive whole: see load_points()).

Per row (configuration, endpoint, concurrency), medians over the repeats: requests/s over
vllm-bench's steady-state window (whole run when it has none) with its min-max; output
tokens/s = output length x that (the engine's count: see measurements()); TTFT and inter-token
latency p50/p99, TPOT p50 and end-to-end latency p50/p99 as vllm-bench reports them (whole
run); split %: the responses that came in parts (two events more than 1 ms apart), with the
median of their longest gaps (what a closed-loop ITL p99 is made of: split_responses());
API-server CPU seconds per 1,000 output tokens (utime+stime of the API server process, all threads, from /proc over the
whole load run); `vs_stock`: this row's requests/s over stock's with the same statistics
setting in the same repeat, median and min-max over the repeats.
accept wait: how long connections waited in the kernel's queue for the front end to accept
them during the run (sampled every 50 ms; a closed loop's first wave opens them all at
once: accept_queue_sampled()), with the most that waited at once (`accept_peak`).
Prints a table; then each row's latency beside stock's (p99s with their min-max, and in how
many repeats the row was at or below stock's p99 of the same repeat); then one JSON line per
row, then the elapsed time.

The Python front ends run the vLLM of the interpreter that runs this script: `.venv`'s
0.32.0 (`make bench-serve`), `.venv-033`'s 0.33.0 (`make bench-serve-033`) or `.venv-034`'s
0.34.0 (`make bench-serve-034`); the header and every JSON row name it ("vllm"). vllm-rs and
the mock engine are 0.33.0's for the first two and 0.34.0's for the third (each release
has its own wire format; `servers.mock_dir()`).

Usage: python benches/bench_serve.py [--quick] [--repeat N] [--concurrency 8,32,...]
       [--endpoints chat,completions] [--configs stock/on,plugin/on,...] [--json-out F]
       [--profile SECONDS]   (py-spy record of the API server, stock/on and plugin/on)
BENCH_SERVE_QUICK=1 is the same as --quick (the smoke-test size).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from servers import free_port, listen_queue, mock_dir, mock_make_target, server_env  # noqa: E402

from vllm_mmretry.vllm_adapter import installed_vllm_version  # noqa: E402

MOCK_DIR = mock_dir()  # where `make mock-engine` (-034 for vLLM 0.34) puts both binaries
CALL_TIMES_SITE = ROOT / "tools" / "call_times"  # a sitecustomize, put on PYTHONPATH
PROMPT_LEN, OUTPUT_LEN = 32, 256
# Open-loop runs: a cap on requests in flight that a run below saturation never reaches.
PACED_CONCURRENCY = 256
SPLIT_GAP_S = 0.001  # a longer gap between two events of one response splits it
ACCEPT_SAMPLE_S = 0.05  # how often a load run reads the front end's accept queue
# A load run's limit. vllm-rs bench waits without end on a request nobody answers; the
# smoke test's lower limit (--quick) fits within pytest's 900 s per test, so the harness's
# error with both logs reaches the test report instead of a killed worker.
LOAD_TIMEOUT_S, QUICK_LOAD_TIMEOUT_S = 900.0, 240.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
ENDPOINT_BACKEND = {"chat": "openai-chat", "completions": "openai"}
ALL_CONFIGS = ("stock/on", "plugin/on", "permsg/on", "unmerged/on", "rust/on", "stock/off", "plugin/off", "rust/off")
# Plugin configurations with one of its parts switched off (on request): what that part gives.
PLUGIN_VARIANTS = {"permsg": {"VLLM_MMRETRY_CATCHUP_RECORDS": "0"},
                   "unmerged": {"VLLM_MMRETRY_MERGE_WAITING": "0"}}
DEFAULT_CONFIGS = ("stock/on", "plugin/on", "rust/on", "stock/off", "plugin/off")


@dataclass(frozen=True)
class Tools:
    """vLLM's binaries: vllm-rs (Rust front end + load generator) and, for front ends
    served in front of it, the mock engine (None where a real engine serves)."""
    vllm_rs: pathlib.Path
    mock_engine: pathlib.Path | None = None


@dataclass
class Frontend:
    """One served configuration: a front end and the mock engine behind it."""
    name: str
    port: int
    log_path: pathlib.Path
    proc: subprocess.Popen
    engine: subprocess.Popen | None = None
    call_times: pathlib.Path | None = None  # folder of tools/call_times snapshots (--call-times)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def engine_log_path(self) -> pathlib.Path:
        """Where the mock engine behind this front end logs."""
        return self.log_path.with_suffix(".engine.log")

    @property
    def api_pid(self) -> int:
        """The process that answers HTTP (with one API server, the launched one)."""
        return self.proc.pid


def stat_cpu_seconds(stat: str | pathlib.Path) -> float:
    """utime + stime from a /proc stat file (a process's, or one thread's under task/)."""
    with open(stat) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (all its threads), from /proc/<pid>/stat."""
    return stat_cpu_seconds(f"/proc/{pid}/stat")


def is_listening(port: int) -> bool:
    """True when some process has a TCP socket in LISTEN state on 127.0.0.1/0.0.0.0:port
    (read from /proc, so the front end's ZMQ socket never sees a stray connection)."""
    return listen_queue(port) is not None


@contextlib.contextmanager
def accept_queue_sampled(port: int, every_s: float = ACCEPT_SAMPLE_S) -> Iterator[dict[str, float]]:
    """Sample the front end's accept queue while the block runs; afterwards the dict holds
    `accept_wait_s` (how long connections were waiting to be accepted, to the sampling
    interval) and `accept_peak` (the most that waited at once).

    A closed-loop run opens `concurrency` connections at once. vLLM's API server runs on
    uvloop, whose libuv accepts one connection per event-loop iteration (libuv PR #3696),
    so under load the last of them waits in the kernel's queue for as many iterations:
    that wait is the first wave's share of the row's TTFT p99."""
    stop = threading.Event()
    waiting: list[int] = []

    def sample() -> None:
        while not stop.wait(every_s):
            waiting.append(listen_queue(port) or 0)

    thread = threading.Thread(target=sample, name="accept-queue", daemon=True)
    found: dict[str, float] = {}
    thread.start()
    try:
        yield found
    finally:
        stop.set()
        thread.join()
        found["accept_wait_s"] = every_s * sum(1 for n in waiting if n)
        found["accept_peak"] = float(max(waiting, default=0))


def wait_for(check: Any, what: str, timeout: float, fe: Frontend) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if fe.proc.poll() is not None:
            raise RuntimeError(f"{fe.name}: front end exited with {fe.proc.returncode}; "
                               f"log tail:\n{tail(fe.log_path)}")
        if check():
            return
        time.sleep(0.3)
    raise TimeoutError(f"{fe.name}: {what} not ready in {timeout:.0f}s; log tail:\n{tail(fe.log_path)}")


def tail(path: pathlib.Path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def popen(cmd: list[str], log_path: pathlib.Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log_path, "ab") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)


def launch_frontend(name: str, model: str, tools: Tools, log_dir: pathlib.Path,
                    call_times: bool = False) -> tuple[Frontend, int]:
    """Start the front end of one configuration (headless: it waits for an engine)."""
    port, rpc = free_port(), free_port()
    log_path = log_dir / f"{name.replace('/', '-')}-{port}.log"
    env = server_env()
    kind, stats = name.split("/")
    times_dir = None
    if kind == "rust":
        cmd = [str(tools.vllm_rs), "serve", model]
    else:
        env["VLLM_MMRETRY"] = "0" if kind == "stock" else "1"
        env.update(PLUGIN_VARIANTS.get(kind, {}))
        cmd = [sys.executable, "-m", "vllm_mmretry.cli", "serve", model]
        if call_times:
            times_dir = log_dir / f"call-times-{port}"
            times_dir.mkdir()
            env["BENCH_CALL_TIMES_DIR"] = str(times_dir)
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(CALL_TIMES_SITE), env.get("PYTHONPATH", "")) if p)
    # Headless: no local engine; the mock engine joins the handshake on `rpc`.
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", "512",
            "--data-parallel-size", "1", "--data-parallel-size-local", "0",
            "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc)]
    if stats == "off":
        cmd.append("--disable-log-stats")
    return Frontend(name, port, log_path, popen(cmd, log_path, env), call_times=times_dir), rpc


def attach_engine(fe: Frontend, rpc: int, tools: Tools, timeout: float) -> None:
    """Start the mock engine once the handshake socket listens; it gives up after 5 s
    without one, so retry until the front end answers /health."""
    if tools.mock_engine is None:
        raise ValueError(f"{fe.name}: no mock engine given to attach")
    wait_for(lambda: is_listening(rpc), f"handshake port {rpc}", timeout, fe)
    cmd = [str(tools.mock_engine), "--handshake-address", f"tcp://127.0.0.1:{rpc}",
           "--vocab-size", "32000", "--seed", "0"]
    deadline = time.monotonic() + timeout
    while True:
        fe.engine = popen(cmd, fe.engine_log_path, server_env())
        with contextlib.suppress(TimeoutError):
            wait_for(lambda: healthy(fe.base_url) or fe.engine.poll() is not None,
                     "/health", max(1.0, deadline - time.monotonic()), fe)
        if healthy(fe.base_url):
            return
        stop_proc(fe.engine)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{fe.name}: mock engine never joined; log tail:\n{tail(fe.log_path)}")
        time.sleep(1)


def stop_proc(proc: subprocess.Popen | None) -> None:
    """SIGTERM the process group, then SIGKILL what is left."""
    if proc is None:
        return
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def plugin_state_line(kind: str, vllm_version: str | None) -> str | None:
    """What the plugin logs at start-up in a Python front end of this kind."""
    if kind in PLUGIN_VARIANTS:
        kind = "plugin"
    return {"plugin": f"vllm-mmretry active for vLLM {vllm_version}",
            "stock": "vllm-mmretry disabled by VLLM_MMRETRY=0"}.get(kind)


def check_plugin_state(fes: dict[str, Frontend], vllm_version: str | None) -> None:
    """Refuse a run whose Python front ends are not what their names say (a stock row
    with the plugin loaded, or a plugin row on another vLLM, would compare nothing)."""
    for fe in fes.values():
        line = plugin_state_line(fe.name.split("/")[0], vllm_version)
        if line is not None and line not in fe.log_path.read_text(errors="replace"):
            raise RuntimeError(f"{fe.name}: its log lacks {line!r}; log tail:\n{tail(fe.log_path)}")


@contextlib.contextmanager
def serving(names: list[str], model: str, tools: Tools, log_dir: pathlib.Path,
            timeout: float = 300.0, call_times: bool = False) -> Iterator[dict[str, Frontend]]:
    """All configurations up at once (idle ones cost almost no CPU), stopped at the end."""
    fes: dict[str, Frontend] = {}
    try:
        launched = []
        for name in names:  # start-ups overlap; each engine joins as its socket appears
            fe, rpc = launch_frontend(name, model, tools, log_dir, call_times)
            fes[name] = fe
            launched.append((fe, rpc))
        for fe, rpc in launched:
            attach_engine(fe, rpc, tools, timeout)
        check_plugin_state(fes, installed_vllm_version())
        yield fes
    finally:
        for fe in fes.values():
            stop_proc(fe.proc)
            stop_proc(fe.engine)


def bench_cmd(tools: Tools, fe: Frontend, model: str, endpoint: str, concurrency: int,
              num_prompts: int, result: pathlib.Path, seed: int, rate: float | None = None,
              output_len: int = OUTPUT_LEN) -> list[str]:
    return [str(tools.vllm_rs), "bench", "serve",
            "--backend", ENDPOINT_BACKEND[endpoint], "--base-url", fe.base_url,
            "--model", model, "--tokenizer", model, "--dataset-name", "random",
            "--random-input-len", str(PROMPT_LEN), "--random-output-len", str(output_len),
            "--ignore-eos", "--num-prompts", str(num_prompts),
            "--max-concurrency", str(concurrency), "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", str(result.parent),
            "--result-filename", result.name, "--request-rate", "inf" if rate is None else str(rate)]


def run_load(tools: Tools, fe: Frontend, model: str, endpoint: str, concurrency: int,
             num_prompts: int, work: pathlib.Path, seed: int = 0,
             rate: float | None = None, output_len: int = OUTPUT_LEN,
             timeout: float = LOAD_TIMEOUT_S) -> dict[str, float]:
    """One load run against one front end, closed loop (`rate` None: all requests queued
    at once, at most `concurrency` in flight) or open (`rate` requests/s, Poisson
    arrivals); returns the row's measurements."""
    result = work / f"{fe.name.replace('/', '-')}-{endpoint}-{concurrency}-{time.monotonic_ns()}.json"
    cmd = bench_cmd(tools, fe, model, endpoint, concurrency, num_prompts, result, seed, rate, output_len)
    calls0 = call_snapshot(fe)
    cpu0 = cpu_seconds(fe.api_pid)
    with accept_queue_sampled(fe.port) as accepts:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                 env=server_env())
        except subprocess.TimeoutExpired:
            raise stalled(fe, timeout) from None
    cpu = cpu_seconds(fe.api_pid) - cpu0
    if out.returncode != 0 or not result.exists():
        raise RuntimeError(f"vllm-rs bench serve failed ({out.returncode}) on {fe.name}:\n"
                           f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}\nserver log:\n{tail(fe.log_path)}")
    m = measurements(json.loads(result.read_text()), cpu, num_prompts, output_len)
    m.update(accepts)
    if calls0 is not None:
        m["calls"] = call_times_of(calls0, call_snapshot(fe, fresh=True), num_prompts)
    return m


def stalled(fe: Frontend, timeout: float) -> RuntimeError:
    """The error of a load run that did not finish: vllm-rs bench waits for as long as a
    front end or its engine leaves requests unanswered (an engine that cannot decode the
    front end's requests logs that and drops them), so both logs' tails say why."""
    return RuntimeError(f"vllm-rs bench serve did not finish in {timeout:.0f}s on {fe.name}; "
                        f"server log tail:\n{tail(fe.log_path)}\n"
                        f"engine log tail:\n{tail(fe.engine_log_path, 2000)}")


def call_snapshot(fe: Frontend, fresh: bool = False) -> dict[str, Any] | None:
    """The API server's latest tools/call_times snapshot (None without --call-times);
    `fresh` waits for one written after this call (they come every 0.2 s)."""
    if fe.call_times is None:
        return None
    path = fe.call_times / f"{fe.api_pid}.json"
    if fresh:
        t = time.time()
        deadline = time.monotonic() + 10
        while not (path.exists() and path.stat().st_mtime > t):
            if time.monotonic() > deadline or fe.proc.poll() is not None:
                raise RuntimeError(f"{fe.name}: no call-times snapshot in {path} for 10 s; "
                                   f"server log tail:\n{tail(fe.log_path)}")
            time.sleep(0.05)
    return json.loads(path.read_text()) if path.exists() else {"cpu": 0.0, "calls": {}}


def call_times_of(before: dict[str, Any], after: dict[str, Any], num_prompts: int) -> dict[str, float]:
    """Per engine-output message over one run: how many, their outputs, and each wrapped
    function's µs per message and share of the API server's CPU."""
    cpu = after["cpu"] - before["cpu"]
    delta = {name: [a - b for a, b in zip(v, before["calls"].get(name, [0, 0, 0.0]), strict=True)]
             for name, v in after["calls"].items()}
    top = "plugin.process_outputs" if delta.get("plugin.process_outputs", [0])[0] else "process_outputs"
    msgs = delta.get(top, [0])[0]
    out: dict[str, float] = {"msgs_per_req": msgs / num_prompts,
                             "outputs_per_msg": delta[top][1] / msgs if msgs else 0.0,
                             "cpu_us_per_msg": 1e6 * cpu / msgs if msgs else 0.0}
    for name, label in ((top, "process_outputs"), ("record", "record"), ("decode", "decode")):
        _, _, secs = delta.get(name, [0, 0, 0.0])
        out[f"{label}_us_per_msg"] = 1e6 * secs / msgs if msgs else 0.0
        out[f"{label}_cpu_share"] = secs / cpu if cpu else 0.0
    out.update(output_queue_of(delta.get("output_queue"), num_prompts, msgs))
    return out


def output_queue_of(counts: list[float] | None, num_prompts: int, msgs: float) -> dict[str, float]:
    """What vLLM's output handler found waiting when it asked for the next message:
    the mean backlog, and per catch-up (an ask that found nothing waiting) how many
    of the run's `msgs` messages it had worked through (the plugin's handler takes the
    messages waiting behind one in the same ask) and how many requests the run completed."""
    if not counts or not counts[0]:
        return {}
    asks, waiting, caught_up = counts
    return {"backlog_msgs": waiting / asks,
            "msgs_per_catch_up": msgs / caught_up if caught_up else float(msgs),
            "reqs_per_catch_up": num_prompts / caught_up if caught_up else float(num_prompts)}


def measurements(res: dict[str, Any], cpu: float, num_prompts: int,
                 output_len: int = OUTPUT_LEN) -> dict[str, float]:
    """The columns of one run, from vllm-bench's result JSON.

    Output tokens are the engine's, not the client's count: the client counts what it can
    see in the streamed text (random token ids include special tokens, which are not
    shown), while the mock engine emits exactly max_tokens per request and a request
    completes only after its last one, so tokens = output_len x completed requests."""
    completed = res["completed"]
    if completed != num_prompts or res.get("failed", 0):
        raise RuntimeError(f"{completed} of {num_prompts} requests completed: {res.get('errors')}")
    ss = res.get("steady_state") or {}
    req_s = ss.get("request_throughput") or res["request_throughput"]
    return {
        "req_s": req_s, "tok_s": req_s * output_len,
        "ttft_p50": res["median_ttft_ms"], "ttft_p99": res["p99_ttft_ms"],
        "itl_p50": res["median_itl_ms"], "itl_p99": res["p99_itl_ms"],
        "tpot_p50": res["median_tpot_ms"], "e2el_p50": res["median_e2el_ms"],
        "e2el_p99": res["p99_e2el_ms"],
        "cpu_per_1k": cpu / (num_prompts * output_len / 1000),
        "events_per_req": events_per_request(res),
        **split_responses(res),
        "steady": 1.0 if ss else 0.0,
    }


def split_responses(res: dict[str, Any]) -> dict[str, float]:
    """The responses that came in parts (two of their events more than SPLIT_GAP_S apart),
    as a share of all, and the median of their longest gaps. At saturation a Python front
    end's responses mostly arrive whole, and these gaps are then what its ITL p99 is made
    of: the p99 is such a gap once more than about 1 % of the samples are."""
    longest = [max(gaps) for gaps in res["itls"] if gaps]
    split = [gap for gap in longest if gap > SPLIT_GAP_S]
    return {"split_pct": 100 * len(split) / len(res["itls"]),
            "split_gap_ms": 1000 * statistics.median(split) if split else 0.0}


def events_per_request(res: dict[str, Any]) -> float:
    """Mean streamed events with a choice per request (`--save-detailed`'s per-request
    inter-token gaps, plus the first event). A consumer that is behind gets its deltas
    merged in the collector, so a response can arrive in far fewer events than tokens;
    TTFT and ITL are then times between these events, not between tokens."""
    itls = res["itls"]
    return statistics.mean(len(gaps) + 1 for gaps in itls)


def num_prompts_for(concurrency: int, factor: float, minimum: int) -> int:
    """Closed loop: the first `concurrency` requests start together and, all getting one
    token per engine step, finish together; the rest keep the concurrency up meanwhile.
    At low concurrency `minimum` keeps a run long enough to have a steady state: this
    VM's CPU speed drifts within seconds, and a sub-second run samples one moment."""
    return max(int(concurrency * factor), concurrency + 8, minimum)


def warm_up(tools: Tools, fes: dict[str, Frontend], model: str, endpoints: list[str],
            work: pathlib.Path, timeout: float = LOAD_TIMEOUT_S) -> None:
    """First requests pay one-off costs (template compilation, caches): keep them out."""
    for fe in fes.values():
        for endpoint in endpoints:
            run_load(tools, fe, model, endpoint, 4, 8, work, timeout=timeout)


def rotated(items: list[str], k: int) -> list[str]:
    k %= len(items)
    return items[k:] + items[:k]


# A row: (configuration, endpoint, concurrency, request rate; None = closed loop).
RowKey = tuple[str, str, int, float | None]


def load_points(args: argparse.Namespace, names: list[str], rep: int,
                runs: dict[RowKey, list[dict[str, float]]] | None = None
                ) -> Iterator[tuple[str, str, int, float | None, int]]:
    """One repeat's runs: (configuration, endpoint, concurrency, rate, requests).

    Closed loop at every concurrency (throughput at saturation), then open loop at each
    of --rates and at stock's saturation rate (saturation_rate()) on the statistics-on
    configurations: the same offered load for all, where inter-token latency compares
    fairly. At saturation the mock engine is far ahead of a Python front end, whose
    deltas merge in the collector until a response arrives whole: TPOT is then 0 and ITL
    only measures the rare split response. `runs`: what is measured so far (read when the
    open-loop points of an endpoint are reached)."""
    for endpoint in args.endpoints:
        for conc in args.concurrency:
            for name in rotated(names, rep):
                if not (name.endswith("/off") and endpoint not in args.off_endpoints):
                    yield name, endpoint, conc, None, num_prompts_for(conc, args.prompts_factor, args.min_prompts)
        for rate in dict.fromkeys([*args.rates, *saturation_rate(args, endpoint, runs or {})]):
            for name in rotated(names, rep):
                if name.endswith("/on"):
                    yield name, endpoint, PACED_CONCURRENCY, rate, max(8, int(rate * args.paced_seconds))


def saturation_rate(args: argparse.Namespace, endpoint: str,
                    runs: dict[RowKey, list[dict[str, float]]]) -> list[float]:
    """The open-loop rate at stock's saturation: --stock-fraction x stock/on's highest
    closed-loop requests/s on this endpoint in the first repeat (kept for the later
    repeats, so that their rows share one offered load). No rate without stock/on or with
    --stock-fraction 0; the rate found is kept in args.saturation_rates."""
    if endpoint not in args.saturation_rates:
        first = [m["req_s"] for (name, ep, _, rate), ms in runs.items()
                 if (name, ep, rate) == ("stock/on", endpoint, None) for m in ms if m["repeat"] == 0]
        if not (args.stock_fraction and first):
            return []
        args.saturation_rates[endpoint] = float(round(args.stock_fraction * max(first)))
    return [args.saturation_rates[endpoint]]


def measure(args: argparse.Namespace, fes: dict[str, Frontend], model: str,
            work: pathlib.Path) -> dict[RowKey, list[dict[str, float]]]:
    """All repeats; every repeat runs every load point on every configuration."""
    runs: dict[RowKey, list[dict[str, float]]] = {}
    for rep in range(args.repeat):
        for name, endpoint, conc, rate, n in load_points(args, list(fes), rep, runs):
            m = run_load(args.tools, fes[name], model, endpoint, conc, n, work, seed=rep, rate=rate,
                         output_len=args.output_len, timeout=args.load_timeout)
            m["repeat"] = rep
            runs.setdefault((name, endpoint, conc, rate), []).append(m)
            calls = m.get("calls")
            per_msg = (f"  {calls['outputs_per_msg']:.1f} outputs/msg "
                       f"{calls['cpu_us_per_msg']:.0f} µs/msg" if calls else "")
            load = f"c={conc:<4d}" if rate is None else f"{rate:g}/s"
            print(f"  repeat {rep} {endpoint:11s} {load:6s} {name:10s} "
                  f"{m['req_s']:8.2f} req/s  cpu/1k {m['cpu_per_1k']:.3f}s  "
                  f"ITL p99 {m['itl_p99']:.1f} ms{per_msg}  "
                  f"[{time.monotonic() - args.t0:.0f}s]", flush=True)
    return runs


def baseline_of(name: str) -> str:
    """Stock with the same statistics setting."""
    return "stock/" + name.split("/")[1]


def summarize(runs: dict[RowKey, list[dict[str, float]]]) -> list[dict[str, Any]]:
    rows = []
    for (name, endpoint, conc, rate), ms in runs.items():
        row: dict[str, Any] = {"config": name, "endpoint": endpoint, "concurrency": conc,
                               "request_rate": rate, "repeats": len(ms)}
        for key in ("req_s", "tok_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "tpot_p50",
                    "e2el_p50", "e2el_p99", "cpu_per_1k", "events_per_req", "split_pct", "split_gap_ms",
                    "accept_wait_s", "accept_peak"):
            vals = [m[key] for m in ms]
            digits = 2 if key in ("req_s", "tok_s", "events_per_req", "split_pct", "accept_wait_s") else 4
            row[key] = round(statistics.median(vals), digits)
            if key in ("req_s", "tok_s", "cpu_per_1k", "ttft_p99", "itl_p99", "e2el_p99", "split_pct",
                       "accept_wait_s"):
                row[key + "_min"], row[key + "_max"] = round(min(vals), digits), round(max(vals), digits)
        row["req_s_repeats"] = [round(m["req_s"], 2) for m in ms]
        row["steady_state_runs"] = int(sum(m["steady"] for m in ms))
        if all("calls" in m for m in ms):
            row["calls"] = {k: round(statistics.median(m["calls"][k] for m in ms), 3)
                            for k in ms[0]["calls"]}
        base = runs.get((baseline_of(name), endpoint, conc, rate))
        if base and name != baseline_of(name):
            ratios = [m["req_s"] / b["req_s"] for m, b in same_repeats(ms, base)]
            row["vs_stock"] = round(statistics.median(ratios), 2)
            row["vs_stock_repeats"] = [round(r, 2) for r in ratios]
            row["vs_stock_min"], row["vs_stock_max"] = round(min(ratios), 2), round(max(ratios), 2)
            row.update(repeats_at_or_below(ms, base))
        rows.append(row)
    order = {n: i for i, n in enumerate(ALL_CONFIGS)}
    rows.sort(key=lambda r: (r["request_rate"] is not None, r["endpoint"], r["request_rate"] or 0,
                             r["concurrency"], order.get(r["config"], 99)))
    return rows


def same_repeats(ms: list[dict[str, float]], base: list[dict[str, float]]
                 ) -> list[tuple[dict[str, float], dict[str, float]]]:
    """Each run of a row with its baseline's run of the same repeat (where there is one)."""
    by_rep = {b["repeat"]: b for b in base}
    return [(m, by_rep[m["repeat"]]) for m in ms if m["repeat"] in by_rep]


def repeats_at_or_below(ms: list[dict[str, float]], base: list[dict[str, float]]) -> dict[str, list[int]]:
    """In how many repeats this row's latency percentiles were at or below stock's of the
    same repeat: [at or below, compared], per percentile."""
    pairs = same_repeats(ms, base)
    return {f"{key}_le_stock": [sum(m[key] <= b[key] for m, b in pairs), len(pairs)]
            for key in ("ttft_p99", "itl_p99", "e2el_p99")}


def print_latency_check(rows: list[dict[str, Any]]) -> None:
    """Each row against stock with the same statistics setting in the same repeats: its
    p99s (median, min-max over repeats) beside stock's, and in how many repeats it was
    at or below stock; the share of responses that came in parts beside stock's; how long
    connections waited to be accepted beside stock's (accept_queue_sampled())."""
    by_key = {(r["endpoint"], r["concurrency"], r["request_rate"], r["config"]): r for r in rows}
    print("\n| endpoint | load | config | TTFT p99 ms, stock | at or below | ITL p99 ms, stock "
          "| at or below | split %, stock | E2E p99 ms, stock's TTFT p99 | accept wait s, stock |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        base = by_key.get((r["endpoint"], r["concurrency"], r["request_rate"], baseline_of(r["config"])))
        if "ttft_p99_le_stock" not in r or base is None:
            continue
        cells = []
        for key in ("ttft_p99", "itl_p99"):
            k, n = r[f"{key}_le_stock"]
            cells.append(f"{spread(r, key)}, {spread(base, key)} | {k}/{n}")
        print(f"| {r['endpoint']} | {load_label(r)} | {r['config']} | {' | '.join(cells)} "
              f"| {spread(r, 'split_pct', 1)}, {spread(base, 'split_pct', 1)} "
              f"| {r['e2el_p99']:.0f}, {base['ttft_p99']:.0f} "
              f"| {spread(r, 'accept_wait_s')}, {spread(base, 'accept_wait_s')} |")


def spread(row: dict[str, Any], key: str, digits: int = 2) -> str:
    """A row's median of `key` with its min-max over the repeats."""
    return f"{row[key]:.{digits}f} ({row[key + '_min']:.{digits}f}-{row[key + '_max']:.{digits}f})"


def load_label(row: dict[str, Any]) -> str:
    """A row's load: its concurrency (closed loop) or its offered rate (open loop)."""
    rate = row["request_rate"]
    if rate is None:
        return str(row["concurrency"])
    at_saturation = f" ({row['stock_fraction']:g}× stock)" if "stock_fraction" in row else ""
    return f"{rate:g}/s{at_saturation}"


def print_table(rows: list[dict[str, Any]]) -> None:
    """A Markdown table (reads in a terminal, pastes into the README); open-loop rows
    show their rate (requests/s offered) in the load column."""
    print("| endpoint | load | config | req/s (min-max) | out tok/s | TTFT p50 / p99 ms "
          "| ITL p50 / p99 ms | TPOT p50 ms | E2E p50 / p99 ms | events / req | split % (gap ms) "
          "| API CPU s / 1k tok | vs stock (min-max) |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ratio = (f"**{r['vs_stock']:.2f}** ({r['vs_stock_min']:.2f}-{r['vs_stock_max']:.2f})"
                 if "vs_stock" in r else "-")
        load = load_label(r)
        print(f"| {r['endpoint']} | {load} | {r['config']} "
              f"| {r['req_s']:.2f} ({r['req_s_min']:.2f}-{r['req_s_max']:.2f}) | {r['tok_s']:.0f} "
              f"| {r['ttft_p50']:.0f} / {r['ttft_p99']:.0f} | {r['itl_p50']:.2f} / {r['itl_p99']:.2f} "
              f"| {r['tpot_p50']:.3f} | {r['e2el_p50']:.0f} / {r['e2el_p99']:.0f} "
              f"| {r['events_per_req']:.1f} | {r['split_pct']:.1f} ({r['split_gap_ms']:.1f}) "
              f"| {r['cpu_per_1k']:.3f} | {ratio} |")


def print_call_times(rows: list[dict[str, Any]]) -> None:
    """With --call-times: where the API server's time per engine-output message goes."""
    timed = [r for r in rows if "calls" in r]
    if not timed:
        return
    print("\n| endpoint | load | config | msgs / req | outputs / msg | API CPU µs / msg "
          "| process_outputs µs (share) | record µs (share) | decode µs (share) "
          "| backlog msgs | msgs / catch-up | reqs / catch-up |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in timed:
        c = r["calls"]
        parts = " | ".join(f"{c[k + '_us_per_msg']:.1f} ({100 * c[k + '_cpu_share']:.0f} %)"
                           for k in ("process_outputs", "record", "decode"))
        queue = " | ".join(f"{c[k]:.1f}" if k in c else "-"
                           for k in ("backlog_msgs", "msgs_per_catch_up", "reqs_per_catch_up"))
        load = load_label(r)
        print(f"| {r['endpoint']} | {load} | {r['config']} | {c['msgs_per_req']:.0f} "
              f"| {c['outputs_per_msg']:.1f} | {c['cpu_us_per_msg']:.0f} | {parts} | {queue} |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", default=os.environ.get("BENCH_SERVE_QUICK") == "1",
                    help="smoke-test size: one repeat, chat, concurrency 8, stock/on plugin/on rust/on")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--concurrency", default="8,32,64,128")
    ap.add_argument("--endpoints", default="chat,completions")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS))
    ap.add_argument("--off-endpoints", default="chat",
                    help="endpoints the statistics-off configurations run (time budget)")
    ap.add_argument("--rates", default="30",
                    help="open-loop request rates (requests/s, comma-separated; '' for none), "
                         "run on the statistics-on configurations after the closed-loop rows")
    ap.add_argument("--stock-fraction", type=float, default=0.9,
                    help="also an open-loop rate of this fraction of stock/on's highest "
                         "closed-loop requests/s per endpoint (its first repeat): the load at "
                         "stock's saturation, offered to every front end alike; 0 for none")
    ap.add_argument("--paced-seconds", type=float, default=6.0,
                    help="length of an open-loop run: rate x this many requests")
    ap.add_argument("--prompts-factor", type=float, default=4.0,
                    help="requests per run = concurrency x this (closed loop); at 1.5 a run "
                         "was 2-3 s of ramp-up and its req/s bimodal")
    ap.add_argument("--output-len", type=int, default=OUTPUT_LEN,
                    help="output tokens per request (at 1, a request is about one engine message: "
                         "what it costs the API server apart from its messages)")
    ap.add_argument("--min-prompts", type=int, default=256,
                    help="requests per closed-loop run at least (low concurrency)")
    ap.add_argument("--mock-engine", type=pathlib.Path,
                    default=os.environ.get("MOCK_ENGINE", MOCK_DIR / "vllm-mock-engine"))
    ap.add_argument("--vllm-rs", type=pathlib.Path,
                    default=os.environ.get("VLLM_RS", MOCK_DIR / "vllm-rs"))
    ap.add_argument("--model", default=None, help="model folder (default: tools/tiny_model.py)")
    ap.add_argument("--json-out", type=pathlib.Path, default=None, help="also write the JSON rows here")
    ap.add_argument("--call-times", action="store_true",
                    help="time the API server's per-message work (tools/call_times): decode, "
                         "process_outputs, the stat loggers' record; its wrappers cost a little")
    ap.add_argument("--load-timeout", type=float, default=None,
                    help=f"seconds a load run may take before the run fails with both logs' "
                         f"tails (default {LOAD_TIMEOUT_S:.0f}, with --quick {QUICK_LOAD_TIMEOUT_S:.0f})")
    ap.add_argument("--profile", type=float, default=0.0, metavar="SECONDS",
                    help="py-spy record the API server of stock/on and plugin/on for SECONDS each")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeat, args.concurrency, args.endpoints = 1, "8", "chat"
        args.paced_seconds = 2.0
        args.min_prompts = 0
        args.configs = "stock/on,plugin/on,rust/on"
    if args.load_timeout is None:
        args.load_timeout = QUICK_LOAD_TIMEOUT_S if args.quick else LOAD_TIMEOUT_S
    args.concurrency = [int(c) for c in str(args.concurrency).split(",")]
    args.rates = [float(r) for r in str(args.rates).split(",") if r.strip()]
    args.saturation_rates = {}  # endpoint -> the rate at stock's saturation, once measured
    args.endpoints = args.endpoints.split(",")
    args.off_endpoints = args.off_endpoints.split(",")
    args.configs = args.configs.split(",")
    if args.output_len < 1:
        ap.error("--output-len must be at least 1")
    for e in args.endpoints:
        if e not in ENDPOINT_BACKEND:
            ap.error(f"unknown endpoint {e}")
    for c in args.configs:
        if c not in ALL_CONFIGS:
            ap.error(f"unknown configuration {c}")
    args.tools = Tools(pathlib.Path(args.vllm_rs).resolve(), pathlib.Path(args.mock_engine).resolve())
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    t0 = time.monotonic()
    args = parse_args(argv)
    args.t0 = t0
    for binary in (args.tools.mock_engine, args.tools.vllm_rs):
        if binary is None or not os.access(binary, os.X_OK):
            sys.exit(f"{binary} missing: run `make {mock_make_target()}` first")
    if args.model is None:
        from tiny_model import ensure_tiny_model

        args.model = str(ensure_tiny_model())
    log_dir = ROOT / ".cache" / "logs" / f"bench-serve-{int(time.time())}"
    log_dir.mkdir(parents=True, exist_ok=True)
    vllm_version = installed_vllm_version()
    print(f"bench-serve: Python front ends on vLLM {vllm_version} ({sys.executable}); "
          f"configs {','.join(args.configs)}; endpoints {','.join(args.endpoints)}; "
          f"concurrency {args.concurrency}; repeats {args.repeat}; "
          f"{PROMPT_LEN}-token prompts, {args.output_len} output tokens; logs in {log_dir}", flush=True)
    work = log_dir / "results"  # vllm-bench's result files, one per load run
    work.mkdir()
    with serving(args.configs, args.model, args.tools, log_dir, call_times=args.call_times) as fes:
        print(f"  servers up after {time.monotonic() - t0:.0f}s", flush=True)
        warm_up(args.tools, fes, args.model, args.endpoints, work, args.load_timeout)
        if args.profile:
            from profile_serve import profile_frontends

            profile_frontends(args, fes, work)
        rows = summarize(measure(args, fes, args.model, work))
    for row in rows:
        row["vllm"] = vllm_version
        row["output_len"] = args.output_len
        if row["request_rate"] is not None and row["request_rate"] == args.saturation_rates.get(row["endpoint"]):
            row["stock_fraction"] = args.stock_fraction  # the rate at stock's saturation
    print_table(rows)
    print_latency_check(rows)
    print_call_times(rows)
    for row in rows:
        print(json.dumps(row))
    if args.json_out:
        args.json_out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(json.dumps({"elapsed_s": round(time.monotonic() - t0, 1)}))
    return rows


if __name__ == "__main__":
    main()
