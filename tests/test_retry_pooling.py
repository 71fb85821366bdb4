"""The serving-layer retry on the ordinary pooling path (/v1/embeddings, Cohere
/v2/embed), against vLLM's real app and an embedding engine on the tiny LLaVA
(`--runner pooling --convert embed`). A P1 miss is injected at the engine-output
boundary; vLLM's own output processor turns it into `PoolingRequestOutput.error`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from retry_support import Fault, InProcessServer, image_messages, in_process_server, png_data_url, retry_log_lines

EMBED, COHERE = "/v1/embeddings", "/v2/embed"


@pytest.fixture(scope="module")
def server() -> Iterator[InProcessServer]:
    with in_process_server("--runner", "pooling", "--convert", "embed") as s:
        yield s


@pytest.fixture(autouse=True)
def fresh(server: InProcessServer) -> Iterator[None]:
    server.faults.clear()
    yield
    server.faults.clear()


def body(path: str, seed: int = 0) -> dict[str, Any]:
    if path == EMBED:
        return {"messages": image_messages("an image", seed), "encoding_format": "float"}
    return {"images": [png_data_url(seed)],
            "embedding_types": ["float"]}


def vectors(path: str, resp: Any) -> list[list[float]]:
    assert resp.status_code == 200, resp.text
    data = resp.json()
    if path == EMBED:
        return [d["embedding"] for d in data["data"]]
    return data["embeddings"]["float"]


def post(server: InProcessServer, path: str, rid: str, seed: int = 0) -> Any:
    # Pooling requests take their id from X-Request-Id.
    return server.run(server.client.post(
        path, json={"model": server.model, **body(path, seed)},
        headers={"X-Request-Id": rid}))


def test_plugin_installed_the_pooling_retry() -> None:
    from vllm_mmretry import plugin

    assert "PoolingBaseServing.__call__" in plugin.active_patches()


@pytest.mark.parametrize("path", [EMBED, COHERE])
def test_first_miss_recovers_identically(server: InProcessServer, path: str) -> None:
    reference = vectors(path, post(server, path, "pref"))
    assert len(reference) == 1 and len(reference[0]) == 64
    server.faults.clear()
    fault = server.faults.add(Fault("pmiss"))
    with retry_log_lines() as log:
        got = vectors(path, post(server, path, "pmiss"))
    assert len(log) == 1 and "vllm-mmretry: retrying request embd-pmiss" in log[0]
    assert path in log[0] and "multimodal_cache_miss" in log[0]
    assert got == reference
    assert len(fault.hits) == 1
    assert len(server.faults.submitted) == 2
    assert server.faults.submitted[0] == server.faults.submitted[1]
    assert server.faults.renders == [False, True]  # the retry skipped the P0 mm cache


@pytest.mark.parametrize("path", [EMBED, COHERE])
def test_second_failure_is_503_with_retry_headers(server: InProcessServer, path: str) -> None:
    server.faults.add(Fault("ptwice", times=2))
    with retry_log_lines() as log:
        resp = post(server, path, "ptwice")
    assert len(log) == 2 and "vllm-mmretry: retrying" in log[0]
    assert "failed again" in log[1] and "embd-ptwice" in log[1]
    assert resp.status_code == 503, resp.text
    assert resp.headers["retry-after"] == "1" and resp.headers["x-should-retry"] == "true"
    assert resp.json()["error"]["type"] == "ServiceUnavailableError"
    assert len(server.faults.submitted) == 2


@pytest.mark.parametrize("path", [EMBED, COHERE])
def test_a_spent_budget_is_503_with_retry_headers_at_once(
        server: InProcessServer, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_mmretry import budget

    spent = budget.RetryBudget(budget.BudgetConfig(ratio=0.0, min_retries=0, window_s=10.0))
    monkeypatch.setattr(budget, "_budget", spent)
    server.faults.add(Fault("pspent", times=1))
    resp = post(server, path, "pspent")
    assert resp.status_code == 503, resp.text
    assert resp.headers["retry-after"] == "1" and resp.headers["x-should-retry"] == "true"
    assert len(server.faults.submitted) == 1 and spent.exhausted == {path: 1}


def test_batch_retries_with_all_prompts_and_keeps_order(server: InProcessServer) -> None:
    texts = {"input": ["first text", "second text", "third text"]}

    def run(rid: str) -> Any:
        return server.run(server.client.post(
            EMBED, json={"model": server.model, **texts}, headers={"X-Request-Id": rid}))

    reference = vectors(EMBED, run("bref"))
    server.faults.clear()
    server.faults.add(Fault("bmiss-1"))
    assert vectors(EMBED, run("bmiss")) == reference
    # One failed prompt: the whole batch is rendered and submitted again, once.
    assert len(server.faults.submitted) == 6 and server.faults.renders[-3:] == [True] * 3


def test_run_batch_embeddings_keep_their_own_503(server: InProcessServer) -> None:
    from vllm.entrypoints.launchers.run_batch import BatchProgressTracker, BatchRequestInput, run_request

    fault = server.faults.add(Fault("embd-"))  # run_batch gives a random id: fail any
    item = BatchRequestInput(custom_id="e1", method="POST", url="/v1/embeddings",
                             body={"model": server.model, **body(EMBED)})
    out = server.run(run_request(server.app.state.serving_embedding, item,
                                 BatchProgressTracker()))
    assert fault.hits and len(server.faults.submitted) == 1  # no retry outside HTTP
    assert out.response.status_code == 503


def _image_content(seed: int) -> dict[str, Any]:
    return {"content": [{"type": "image_url", "image_url": {"url": png_data_url(seed)}}]}


OTHER_POOLING = {
    "/v1/score": lambda s: {"queries": "an image", "documents": _image_content(s)},
    "/v1/rerank": lambda s: {"query": "an image", "documents": _image_content(s)},
    "/pooling": lambda s: {"messages": image_messages("an image", s)},
}


@pytest.mark.parametrize("path", sorted(OTHER_POOLING))
def test_score_rerank_and_pooling_keep_vllms_error_handling(server: InProcessServer, path: str) -> None:
    """They share PoolingBaseServing's entry with embeddings but are not retried: one
    submission, no retry logged, vLLM's own error answer."""
    ok = server.run(server.client.post(path, json={"model": server.model, **OTHER_POOLING[path](7)}))
    assert ok.status_code == 200, ok.text
    server.faults.clear()
    fault = server.faults.add(Fault("", times=10))  # every request of the call misses
    with retry_log_lines() as log:
        resp = server.run(server.client.post(path, json={"model": server.model,
                                                         **OTHER_POOLING[path](8)}))
    assert fault.hits, "the fault did not reach the engine output"
    assert log == []
    submitted = server.faults.submitted
    assert len(set(submitted)) == len(submitted), submitted  # a retry resubmits an id
    assert resp.status_code >= 500, resp.text
    # vLLM's own answer: the retry headers are only on this package's 503s.
    assert "retry-after" not in resp.headers and "x-should-retry" not in resp.headers, resp.headers
