"""py-spy profile of the API server under bench-serve's load, stock and plugin.

For stock/on and plugin/on (statistics on, vllm serve's default) in front of vLLM's mock
engine: start a long streaming-chat load (vllm-rs bench serve, 32-token prompts, 256
output tokens, concurrency 64), let it ramp up, record the API server process with
`py-spy record --nonblocking` (all threads that are running, the event loop and the
renderer's tokenizer threads alike, each sample labelled with its thread), stop the
load, then print:
  - the CPU each of the API server's threads used over the recording (/proc), and the
    whole machine's (two cores here): which thread is the limit;
  - the top frames by own time (the leaf of each sample) and by total time (anywhere in
    the stack), each as a share of all samples;
  - the samples grouped into areas (innermost match wins): engine-output receive and
    decode, request statistics, the output loop, prompt rendering/tokenization, HTTP;
  - the same areas and own-time frames for the event-loop (main) thread alone.
Raw collapsed stacks are kept under .cache/profile/ (flamegraph.pl reads them).

Usage: python tools/profile_serve.py [--seconds 20] [--concurrency 64] [--endpoint chat]
       (or: make bench-serve PROFILE=1, which profiles before measuring)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benches"))
sys.path.insert(0, str(ROOT / "tools"))

PROFILED = ("stock/on", "plugin/on")
# Innermost match wins; patterns are matched against "function (file)".
AREAS: list[tuple[str, re.Pattern[str]]] = [
    ("request statistics", re.compile(
        r"vllm/v1/metrics/|update_from_output|update_from_finished|_update_stats_from|"
        r"make_stats|record_stats|prometheus_client/")),
    ("engine-output receive + decode", re.compile(
        r"zmq/|serial_utils|msgspec|process_outputs_socket|get_output_async|"
        r"_AsyncSocket|_handle_recv|_deserialize")),
    ("output loop (process_outputs, collectors)", re.compile(
        r"output_processor|vllm_mmretry/|RequestOutputCollector|detokenizer|"
        r"outputs\.py|output_handler")),
    ("prompt rendering + tokenization", re.compile(
        r"renderer|tokenizers?/|transformers/|chat_utils|jinja2|_tokenize|"
        r"input_processor|inputs/preprocess|processor\.py")),
    ("HTTP + serving (starlette, uvicorn, SSE)", re.compile(
        r"starlette/|uvicorn/|fastapi/|h11/|httptools|anyio/|serving_|"
        r"entrypoints/openai|pydantic")),
    ("asyncio event loop", re.compile(r"asyncio/|uvloop")),
]
ENTRY_SHARE = 0.8
FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^:()]*)(?::\d+)?\)$")
# py-spy --threads puts the thread first in each stack: "thread (0x7f..): MainThread".
THREAD = re.compile(r"^thread \((?P<tid>[^)]*)\)(?:: (?P<name>.*))?$")
MAIN_THREAD = "MainThread"


def py_spy() -> str:
    exe = shutil.which("py-spy", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if not exe:
        sys.exit("py-spy not found: it is in requirements/dev.txt (make setup installs it)")
    return exe


def short_file(path: str) -> str:
    """Path from the package root (site-packages/vllm/x.py -> vllm/x.py)."""
    for marker in ("site-packages/", "lib/python3.11/", "/python/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def parse_collapsed(text: str, thread: str | None = None) -> list[tuple[list[str], int]]:
    """py-spy's raw (collapsed) format: 'root;...;leaf COUNT', frames 'func (file:line)'.
    Frames are normalized to 'func (file)' so lines of one function add up. With
    `thread`, only that thread's samples (by name; needs `--threads`); the thread
    label itself is dropped either way."""
    stacks = []
    for line in text.splitlines():
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        names = stack.split(";")
        label = THREAD.match(names[0])
        if label:
            names = names[1:]
        if not names or (thread is not None and (label is None or label["name"] != thread)):
            continue  # another thread's, or a thread with no Python frame
        frames = []
        for fr in names:
            m = FRAME.match(fr)
            frames.append(f"{m['func']} ({short_file(m['file'])})" if m else fr)
        stacks.append((frames, int(count)))
    return stacks


def summarize_profile(stacks: list[tuple[list[str], int]], top: int = 15) -> dict[str, Any]:
    total = sum(c for _, c in stacks) or 1
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    areas: collections.Counter[str] = collections.Counter()
    for frames, count in stacks:
        own[frames[-1]] += count
        for fr in set(frames):
            incl[fr] += count
        areas[area_of(frames)] += count

    def shares(counter: collections.Counter[str], n: int) -> list[list[Any]]:
        return [[name, round(100.0 * c / total, 1)] for name, c in counter.most_common(n)]

    # The entry chain (runpy, the CLI, asyncio.run) is in nearly every sample: leave it out.
    incl = collections.Counter({k: c for k, c in incl.items() if c < ENTRY_SHARE * total})
    return {"samples": total, "own": shares(own, top), "total": shares(incl, top),
            "areas": shares(areas, len(AREAS) + 1)}


def area_of(frames: list[str]) -> str:
    for fr in reversed(frames):  # innermost first
        for name, pat in AREAS:
            if pat.search(fr):
                return name
    return "other"


# Requests/s no profiled front end reaches here (the plugin serves up to about 600, vLLM's
# Rust front end about 1,000): a load sized by it outlasts the ramp and the recording at
# any concurrency. At 500 the plugin's load could end inside the recording, which then
# counted an idle event loop (its main thread at 74 % of a core, completions at 128).
MAX_RATE = 1500


def start_load(tools: Any, fe: Any, model: str, endpoint: str, concurrency: int,
               seconds: float, work: pathlib.Path, ramp: float) -> subprocess.Popen:
    """A closed-loop load long enough to outlast the ramp and the recording (stopped
    afterwards). Sized by time, not by concurrency: 8 concurrent requests finish
    nearly as many requests per second as 128 do."""
    from bench_serve import bench_cmd, server_env

    n = max(concurrency, int(MAX_RATE * (ramp + seconds)))
    cmd = bench_cmd(tools, fe, model, endpoint, concurrency, n, work / "profile-load.json", 0)
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=server_env(), start_new_session=True)


def record(pid: int, seconds: float, out: pathlib.Path) -> None:
    subprocess.run([py_spy(), "record", "--pid", str(pid), "--duration", str(int(seconds)),
                    "--rate", "100", "--nonblocking", "--threads", "--format", "raw",
                    "--output", str(out)],
                   check=True, capture_output=True, timeout=seconds + 120)


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of `pid`, by "name tid"; the main
    thread (tid = pid) is named MainThread, as py-spy names it."""
    from bench_serve import stat_cpu_seconds

    out = {}
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            cpu = stat_cpu_seconds(task / "stat")
            name = MAIN_THREAD if task.name == str(pid) else (task / "comm").read_text().strip()
        except OSError:  # the thread ended
            continue
        out[f"{name} {task.name}"] = cpu
    return out


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all cores since boot, from /proc/stat."""
    values = [int(v) for v in pathlib.Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


def recorded_with_cpu(pid: int, seconds: float, out: pathlib.Path) -> dict[str, Any]:
    """`record`, and the CPU each thread and the machine used meanwhile, in % of one core."""
    before, (busy0, total0), t0 = thread_cpu(pid), machine_busy(), time.monotonic()
    record(pid, seconds, out)
    after, (busy1, total1), wall = thread_cpu(pid), machine_busy(), time.monotonic() - t0
    used = {k: round(100 * (v - before.get(k, 0.0)) / wall, 1) for k, v in after.items()}
    cores = os.cpu_count() or 1
    return {"threads_cpu_pct": dict(sorted(used.items(), key=lambda kv: -kv[1])[:5]),
            "machine_busy_pct": round(100 * cores * (busy1 - busy0) / max(1, total1 - total0), 1),
            "cores": cores}


def profile_frontends(args: Any, fes: dict[str, Any], work: pathlib.Path, endpoint: str = "chat",
                      concurrency: int = 64, ramp: float = 4.0) -> dict[str, dict[str, Any]]:
    """Profile each of stock/on and plugin/on in turn; print and return the summaries."""
    from bench_serve import stop_proc

    out_dir = ROOT / ".cache" / "profile"
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in PROFILED:
        if name not in fes:
            continue
        load = start_load(args.tools, fes[name], args.model, endpoint, concurrency, args.profile, work,
                          ramp)
        try:
            time.sleep(ramp)
            raw = out_dir / f"{name.replace('/', '-')}-{endpoint}-c{concurrency}.txt"
            cpu = recorded_with_cpu(fes[name].api_pid, args.profile, raw)
            if load.poll() is not None:  # its end would be counted as the front end's idle time
                raise RuntimeError(f"{name}: the load ended inside the recording (exit code "
                                   f"{load.returncode}); raise MAX_RATE, now {MAX_RATE}/s")
        finally:
            stop_proc(load)
        text = raw.read_text()
        results[name] = summarize_profile(parse_collapsed(text))
        results[name]["main_thread"] = summarize_profile(parse_collapsed(text, MAIN_THREAD))
        results[name].update(cpu, raw=str(raw.relative_to(ROOT)))
    print_profiles(results, endpoint, concurrency)
    return results


def print_profiles(results: dict[str, dict[str, Any]], endpoint: str, concurrency: int) -> None:
    for name, res in results.items():
        print(f"\npy-spy: API server, {name}, streaming {endpoint}, concurrency {concurrency}, "
              f"{res['samples']} samples ({res['raw']})")
        print(f"  CPU over the recording, % of one core: machine {res['machine_busy_pct']} "
              f"of {100 * res['cores']}; API server threads "
              + ", ".join(f"{k} {v}" for k, v in res["threads_cpu_pct"].items()))
        main = res["main_thread"]
        for title, part, key in (("areas (innermost match)", res, "areas"), ("own time", res, "own"),
                                 ("total time", res, "total"),
                                 (f"main thread ({main['samples']} samples), areas", main, "areas"),
                                 ("main thread, own time", main, "own")):
            print(f"  {title}:")
            for frame, share in part[key]:
                print(f"    {share:5.1f}%  {frame}")
        print(json.dumps({"profile": name, "areas": res["areas"], "own": res["own"][:10],
                          "main_thread_areas": main["areas"], "main_thread_own": main["own"][:10],
                          "threads_cpu_pct": res["threads_cpu_pct"],
                          "machine_busy_pct": res["machine_busy_pct"]}))


def main() -> None:
    import bench_serve

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--endpoint", default="chat", choices=sorted(bench_serve.ENDPOINT_BACKEND))
    opts, rest = ap.parse_known_args()
    args = bench_serve.parse_args([*rest, "--configs", ",".join(PROFILED)])
    args.profile = opts.seconds
    if args.model is None:
        from tiny_model import ensure_tiny_model

        args.model = str(ensure_tiny_model())
    log_dir = ROOT / ".cache" / "logs" / f"profile-serve-{int(time.time())}"
    log_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, \
            bench_serve.serving(list(PROFILED), args.model, args.tools, log_dir) as fes:
        work = pathlib.Path(tmp)
        bench_serve.warm_up(args.tools, fes, args.model, [opts.endpoint], work)
        profile_frontends(args, fes, work, opts.endpoint, opts.concurrency)


if __name__ == "__main__":
    main()
