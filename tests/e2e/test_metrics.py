"""vllm-mmretry's Prometheus metrics on a real server's `/metrics`, read over HTTP.

- a recovered miss (VLLM_MMRETRY_FAULTS=p1_miss=every:1): misses +1, retries
  {outcome=recovered} +1;
- a second failure (…,retry_miss=1): misses +2 (the request and its retry),
  retries {outcome=failed_again} +1, HTTP 503;
- a fallback (a logprobs request): native_fallback {reason=logprobs} +1;
- `--api-server-count 2` (vLLM's multiprocess registry): the fallbacks of requests
  served by both API server processes add up, whichever process answers the scrape;
  vLLM's own counters, updated natively in both processes, add up too, and the
  native updates' self-check leaves no metric of its own in the shared files.

Fallback counts are published off the step path, at most a second late (and at
scrape time with one API server), so the tests poll."""

from __future__ import annotations

import json
import pathlib
import time
from collections.abc import Callable

import httpx
import pytest
from e2e_helpers import (
    RETRY_LINE,
    chat_body,
    client,
    image_url,
    mark,
    metric_families,
    servers,
)

pytestmark = pytest.mark.e2e

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
MISSES = ("vllm_mmretry_cache_miss_errors_total", frozenset())
CHAT = "/v1/chat/completions"


def scrape(server: servers.Server) -> Samples:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in metric_families(server) for s in family.samples}


def retries(outcome: str, endpoint: str = CHAT) -> tuple[str, frozenset[tuple[str, str]]]:
    return ("vllm_mmretry_retries_total",
            frozenset({("endpoint", endpoint), ("outcome", outcome)}))


def fallbacks(reason: str) -> tuple[str, frozenset[tuple[str, str]]]:
    return ("vllm_mmretry_native_fallback_total", frozenset({("reason", reason)}))


def wait_until(server: servers.Server, ok: Callable[[Samples], bool],
               timeout: float = 20.0) -> Samples:
    deadline = time.monotonic() + timeout
    while not ok(samples := scrape(server)):
        if time.monotonic() > deadline:
            ours = {k: v for k, v in samples.items() if k[0].startswith("vllm_mmretry")}
            raise AssertionError(f"metrics did not reach the expected values: {ours}")
        time.sleep(0.3)
    return samples


def info_labels(samples: Samples) -> list[dict[str, str]]:
    return [dict(labels) for (name, labels), v in samples.items()
            if name == "vllm_mmretry_info" and v == 1]


def chat(server: servers.Server, body: dict) -> httpx.Response:
    with client(server) as http:  # a new connection per request
        return http.post(CHAT, json=body)


# ---------------------------------------------------------------- one API server


@pytest.fixture(scope="module")
def recovering(plugin_miss_server: servers.Server) -> servers.Server:
    return plugin_miss_server


def test_info_metric_says_native_loop_and_detokenizer_are_on(recovering: servers.Server) -> None:
    from vllm_mmretry import __version__

    labels = info_labels(wait_until(recovering, lambda s: bool(info_labels(s))))
    assert labels == [{"version": __version__, "vllm_version": "0.32.0",
                       "native_loop": "1", "native_detok": "1"}], labels


def test_recovered_miss_moves_misses_and_recovered(recovering: servers.Server,
                                                   model: str) -> None:
    before = scrape(recovering)
    body = chat_body(model, image_url((31, 0, 0)))
    assert chat(recovering, body).status_code == 200  # carries the data
    window = mark(recovering)
    assert chat(recovering, body).status_code == 200  # miss -> retried -> 200
    window.wait_for(RETRY_LINE)
    after = wait_until(recovering, lambda s: s.get(retries("recovered"), 0)
                       == before.get(retries("recovered"), 0) + 1)
    assert after[MISSES] == before.get(MISSES, 0) + 1
    assert after.get(retries("failed_again"), 0) == before.get(retries("failed_again"), 0)


def test_logprobs_request_counts_a_native_fallback(recovering: servers.Server,
                                                   model: str) -> None:
    before = scrape(recovering).get(fallbacks("logprobs"), 0)
    body = {"model": model, "max_tokens": 4, "temperature": 0, "logprobs": True,
            "top_logprobs": 1, "messages": [{"role": "user", "content": "hello"}]}
    r = chat(recovering, body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"] is not None
    plain = chat(recovering, {**body, "logprobs": False, "top_logprobs": None})
    assert plain.status_code == 200
    wait_until(recovering, lambda s: s.get(fallbacks("logprobs"), 0) == before + 1)
    time.sleep(1.5)  # a second publication later, still exactly one
    assert scrape(recovering).get(fallbacks("logprobs"), 0) == before + 1


# ---------------------------------------------------- the retry fails as well


@pytest.fixture(scope="module")
def failing(plugin_retry_miss_server: servers.Server) -> servers.Server:
    return plugin_retry_miss_server


def test_second_failure_moves_misses_and_failed_again(failing: servers.Server,
                                                      model: str) -> None:
    before = scrape(failing)
    body = chat_body(model, image_url((0, 31, 0)))
    assert chat(failing, body).status_code == 200
    assert chat(failing, body).status_code == 503  # miss, retry misses too
    after = wait_until(failing, lambda s: s.get(retries("failed_again"), 0)
                       == before.get(retries("failed_again"), 0) + 1)
    assert after[MISSES] == before.get(MISSES, 0) + 2  # the request and its retry
    assert after.get(retries("recovered"), 0) == before.get(retries("recovered"), 0)


# ------------------------------------------------------------ two API servers


def per_process_fallbacks(multiproc_dir: pathlib.Path, reason: str) -> dict[str, float]:
    """{pid: count} from the counter files each API server process writes."""
    from prometheus_client.mmap_dict import MmapedDict

    counts: dict[str, float] = {}
    for path in multiproc_dir.glob("counter_*.db"):
        pid = path.stem.split("_")[-1]
        for key, value, _ts, _pos in MmapedDict.read_all_values_from_file(str(path)):
            _family, name, labels, _help = json.loads(key)
            if name == "vllm_mmretry_native_fallback_total" and labels == {"reason": reason}:
                counts[pid] = counts.get(pid, 0.0) + value
    return counts


def test_counts_add_up_across_api_server_processes(
        two_api_servers: servers.Server, multiproc_dir: pathlib.Path, model: str) -> None:
    before = scrape(two_api_servers).get(fallbacks("logprobs"), 0)
    before_per_pid = per_process_fallbacks(multiproc_dir, "logprobs")
    body = {"model": model, "max_tokens": 2, "temperature": 0, "logprobs": True,
            "top_logprobs": 1, "messages": [{"role": "user", "content": "hi"}]}
    # Fresh connections go to whichever process accepts first, and that runs in
    # streaks (one CI run sent 12 in a row to one process): rounds of 12 until
    # both processes have counted some.
    sent = 0
    for _ in range(10):
        for _ in range(12):
            assert chat(two_api_servers, body).status_code == 200
        sent += 12
        samples = wait_until(two_api_servers,
                             lambda s, want=before + sent: s.get(fallbacks("logprobs"), 0) == want)
        per_pid = per_process_fallbacks(multiproc_dir, "logprobs")
        added = {pid: c - before_per_pid.get(pid, 0.0) for pid, c in per_pid.items()}
        both_counted = len([c for c in added.values() if c > 0]) == 2
        if both_counted:
            break
    # Both API server processes counted some of them...
    assert both_counted, (added, before_per_pid)
    assert sum(added.values()) == sent, added
    # ...and every scrape, whichever process answers it, reports the sum.
    for _ in range(6):
        assert scrape(two_api_servers).get(fallbacks("logprobs"), 0) == before + sent
    assert len(info_labels(samples)) == 1, info_labels(samples)


def vllm_total(samples: Samples, name: str) -> float:
    return sum(v for (n, _labels), v in samples.items() if n == name)


def test_vllm_counts_add_up_with_native_updates_in_both_processes(
        two_api_servers: servers.Server, model: str) -> None:
    """In multiprocess mode each API server process gives vLLM's stat loggers the
    native updates (through the values' own methods); the self-check leaves nothing
    in the shared files; vLLM's own counters add up over both processes."""
    log = two_api_servers.log()
    assert log.count("native prometheus updates for") == 2, log[-3000:]
    assert "prometheus metrics left to prometheus_client" not in log
    before = scrape(two_api_servers)
    body = {"model": model, "max_tokens": 5, "temperature": 0,
            "messages": [{"role": "user", "content": "count"}]}
    generated = 0
    n = 10
    for _ in range(n):  # fresh connections, answered by either process
        r = chat(two_api_servers, body)
        assert r.status_code == 200
        generated += r.json()["usage"]["completion_tokens"]
    tokens = "vllm:generation_tokens_total"
    done = "vllm:request_success_total"
    samples = wait_until(two_api_servers, lambda s: (
        vllm_total(s, tokens) == vllm_total(before, tokens) + generated
        and vllm_total(s, done) == vllm_total(before, done) + n))
    assert not [name for name, _ in samples if "mmretry_check" in name]
