"""Stock and the plugin each in front of a real engine: the tiny model on vLLM's CPU engine,
loaded in alternating repeats by `vllm-rs bench serve` (closed loop, streaming). What the
front end changes when the engine, not the front end, is the bottleneck, beside
`bench_serve.py`'s mock-engine rows where the front end is. vLLM 0.32 (`.venv`) only: the
0.33.0 wheel has no CPU engine.

Each configuration gets its own server (`vllm-mmretry serve`, VLLM_MMRETRY=0 or 1), both
up for the whole run; an idle one costs almost no CPU. --warm-up runs on each come first
and are not counted (a CPU engine's first steps of a new batch size are slow). Prints a
line per run, then per configuration the medians (min-max) of requests/s, TTFT, ITL and
E2E p99 and API CPU per 1,000 tokens, and for the plugin in how many repeats each p99 was
at or below stock's of the same repeat; then one JSON line per configuration.

Usage: .venv/bin/python benches/bench_serve_model.py [--concurrency 64] [--repeat 6]
       [--endpoint chat] [--num-prompts 256] [--warm-up 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import sys
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "benches"))

import bench_serve  # noqa: E402
import servers  # noqa: E402

# The tiny model's CPU engine with room for every request of the load at once.
ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "128",
               "--max-num-batched-tokens", "2048", "--enforce-eager",
               "--kv-cache-memory-bytes", "256M"]
CONFIGS = {"stock/on": "0", "plugin/on": "1"}
KEYS = ("req_s", "ttft_p99", "itl_p99", "e2el_p99", "cpu_per_1k", "split_pct")


# With the real engine a response takes seconds, and the load generator's pooled
# connection can sit idle for uvicorn's 5 s keep-alive: the server closes it as the
# client sends on it ("error sending request", one request lost in a CI run). Both front
# ends get the same longer keep-alive; it changes no request's work.
HTTP_ENV = {"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "120"}


def frontend_of(name: str, server: servers.Server) -> bench_serve.Frontend:
    """bench_serve's view of a server: where it listens, its log, its API process."""
    port = int(server.base_url.rsplit(":", 1)[1])
    return bench_serve.Frontend(name, port, server.log_path, server.proc)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=6)
    ap.add_argument("--warm-up", type=int, default=2)
    ap.add_argument("--endpoint", default="chat", choices=sorted(bench_serve.ENDPOINT_BACKEND))
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--vllm-rs", type=pathlib.Path, default=bench_serve.MOCK_DIR / "vllm-rs")
    args = ap.parse_args(argv)
    tools = bench_serve.Tools(args.vllm_rs.resolve())  # a real engine: no mock engine
    from tiny_model import ensure_tiny_model

    model = str(ensure_tiny_model())
    runs: dict[bench_serve.RowKey, list[dict[str, float]]] = {}
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        fes = {name: frontend_of(name, stack.enter_context(servers.serve(
                   model, *ENGINE_ARGS, env={"VLLM_MMRETRY": flag, **HTTP_ENV}, tiny_defaults=False)))
               for name, flag in CONFIGS.items()}
        bench_serve.check_plugin_state(fes, bench_serve.installed_vllm_version())
        work = pathlib.Path(tmp)
        for rep in range(-args.warm_up, args.repeat):
            for name in bench_serve.rotated(list(fes), rep):
                m = bench_serve.run_load(tools, fes[name], model, args.endpoint, args.concurrency,
                                         args.num_prompts, work, seed=rep + args.warm_up)
                m["repeat"] = rep
                print(f"  repeat {rep} {name:10s} {m['req_s']:6.2f} req/s  TTFT p99 {m['ttft_p99']:7.1f} ms  "
                      f"ITL p99 {m['itl_p99']:5.1f} ms  [{time.monotonic() - t0:.0f}s]", flush=True)
                if rep >= 0:
                    runs.setdefault((name, args.endpoint, args.concurrency, None), []).append(m)
    rows = bench_serve.summarize(runs)
    print_rows(rows, args)
    return rows


def print_rows(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\n{args.endpoint}, concurrency {args.concurrency}, {args.num_prompts} requests per run, "
          f"{args.repeat} repeats; medians (min-max)")
    print("| config | req/s | TTFT p99 ms | ITL p99 ms | E2E p99 ms | API CPU s / 1k tok | split % "
          "| p99s at or below stock's (TTFT, ITL, E2E) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        cells = " | ".join(bench_serve.spread(r, key) for key in KEYS)
        le = ", ".join("{}/{}".format(*r[f"{k}_le_stock"]) for k in ("ttft_p99", "itl_p99", "e2el_p99")
                       ) if "itl_p99_le_stock" in r else "-"
        print(f"| {r['config']} | {cells} | {le} |")
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
