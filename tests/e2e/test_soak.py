"""Soak: multimodal chat requests, 4 at a time, over distinct images, with random
P1 misses (VLLM_MMRETRY_FAULTS=p1_miss=prob:0.1:seed:S).

Every request answers 200, or 503 when the retry budget refused its retry (counted
against the server's own "budget exhausted" reports); never a 500, never a hang
(each request has a deadline); the server is healthy at the end; and the resident
memory of the API server and the engine core stays within noise of its start.

Memory noise, defined: after a warm-up (every image seen, misses and retries taken),
RSS is sampled every `SAMPLE_EVERY` requests. The allowed growth from the first
measured sample to the last is the larger of twice the spread seen while warming up
and `RSS_FLOOR_MIB` (the allocator keeps freed arenas, so RSS moves in steps of a few
MiB even without a leak). The least-squares slope per request is reported as well.

`make soak N=2000` runs a longer one by hand (SOAK_REQUESTS, SOAK_SEED, SOAK_REPORT);
the figures go to the JSON report file."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import pathlib
import time
from collections import Counter
from collections.abc import Callable, Iterator

import httpx
import psutil
import pytest
from e2e_helpers import ENGINE_MISS, RETRY_LINE, chat_body, image_url, servers, start_server

pytestmark = pytest.mark.e2e

REQUESTS = int(os.environ.get("SOAK_REQUESTS", "200"))
SEED = int(os.environ.get("SOAK_SEED", "7"))
REPORT = os.environ.get("SOAK_REPORT", "")
IMAGES = 12
CONCURRENCY = 4
WARMUP = 3 * IMAGES
SAMPLE_EVERY = 20
RSS_FLOOR_MIB = 24.0
REQUEST_DEADLINE_S = 180.0
EXHAUSTED_LINE = "vllm-mmretry: retry budget exhausted"


@pytest.fixture(scope="module")
def server(model: str) -> Iterator[servers.Server]:
    env = {"VLLM_MMRETRY_FAULTS": f"p1_miss=prob:0.1:seed:{SEED}"}
    yield from start_server(model, env=env)


def _processes(server: servers.Server) -> dict[str, psutil.Process]:
    api = psutil.Process(server.pid)
    for child in api.children(recursive=True):
        if "EngineCore" in " ".join(child.cmdline()):
            return {"api_server": api, "engine_core": child}
    raise AssertionError("no EngineCore process under the server")


def _rss_mib(procs: dict[str, psutil.Process]) -> dict[str, float]:
    return {name: p.memory_info().rss / 2**20 for name, p in procs.items()}


def _slope(xs: list[float], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


def _run(http: httpx.Client, bodies: list[dict], count: int, start: int,
         statuses: Counter, on_sample: Callable[[int], None]) -> None:
    def one(i: int) -> int:
        r = http.post("/v1/chat/completions", json=bodies[i % len(bodies)],
                      timeout=REQUEST_DEADLINE_S)
        if r.status_code == 200:
            assert r.json()["choices"][0]["finish_reason"] in ("length", "stop"), r.text
        elif r.status_code == 503:
            assert r.headers.get("x-should-retry") == "true", r.headers
        return r.status_code

    with cf.ThreadPoolExecutor(CONCURRENCY) as pool:
        for batch in range(start, start + count, SAMPLE_EVERY):
            ids = range(batch, min(batch + SAMPLE_EVERY, start + count))
            for status in pool.map(one, ids):
                statuses[status] += 1
            on_sample(ids[-1] + 1)


def test_soak_random_misses(server: servers.Server, model: str) -> None:
    procs = _processes(server)
    bodies = [chat_body(model, image_url((200, 10 * i, 255 - 10 * i))) for i in range(IMAGES)]
    start_log = len(server.log())
    warm: list[dict[str, float]] = []
    samples: list[tuple[int, dict[str, float]]] = []
    warm_statuses: Counter = Counter()
    statuses: Counter = Counter()
    t0 = time.monotonic()
    with httpx.Client(base_url=server.base_url) as http:
        _run(http, bodies, WARMUP, 0, warm_statuses,
             lambda _: warm.append(_rss_mib(procs)))
        warm.append(_rss_mib(procs))
        samples.append((0, warm[-1]))
        _run(http, bodies, REQUESTS, WARMUP, statuses,
             lambda n: samples.append((n - WARMUP, _rss_mib(procs))))
        health = http.get("/health", timeout=30)
    elapsed = time.monotonic() - t0
    time.sleep(1.0)  # let the engine core's last log lines land
    log = server.log()[start_log:]

    all_statuses = statuses + warm_statuses
    report = {
        "requests": REQUESTS, "warmup": WARMUP, "images": IMAGES, "concurrency": CONCURRENCY,
        "seed": SEED, "elapsed_s": round(elapsed, 1),
        "statuses": dict(all_statuses), "engine_misses": log.count(ENGINE_MISS),
        "retries": log.count(RETRY_LINE), "budget_reports": log.count(EXHAUSTED_LINE),
        "rss_mib": {}}
    for name in procs:
        spread = max(s[name] for s in warm) - min(s[name] for s in warm)
        xs = [float(n) for n, _ in samples]
        ys = [s[name] for _, s in samples]
        report["rss_mib"][name] = {
            "start": round(ys[0], 1), "end": round(ys[-1], 1), "max": round(max(ys), 1),
            "warmup_spread": round(spread, 1),
            "allowed_growth": round(max(2 * spread, RSS_FLOOR_MIB), 1),
            "slope_kib_per_request": round(_slope(xs, ys) * 1024, 2)}
    print("\nsoak report:", json.dumps(report, indent=1))
    if REPORT:
        pathlib.Path(REPORT).write_text(json.dumps(report, indent=1))

    assert health.status_code == 200
    assert set(all_statuses) <= {200, 503}, all_statuses
    assert sum(statuses.values()) == REQUESTS
    # Misses happened and were retried (else this soak tested nothing).
    assert report["engine_misses"] > 0 and report["retries"] > 0, report
    if all_statuses[503]:  # only where the budget refused a retry
        assert report["budget_reports"] > 0, report
    for name, rss in report["rss_mib"].items():
        assert rss["end"] - rss["start"] <= rss["allowed_growth"], (name, report)
