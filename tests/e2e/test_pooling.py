"""A pooling server (--runner pooling --convert embed) with an induced P1 miss:
/v1/embeddings and Cohere-style /v2/embed give 200 and the same vector as the
request that carried the data (stock vLLM answers 503 here)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
from e2e_helpers import (
    ENGINE_MISS,
    FAULT_DROP,
    RETRY_LINE,
    client,
    image_url,
    mark,
    servers,
    start_server,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(model: str) -> Iterator[servers.Server]:
    yield from start_server(model, "--runner", "pooling", "--convert", "embed",
                            env={"VLLM_MMRETRY_FAULTS": "p1_miss=every:1"})


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) > 0 and all(math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-6)
                                        for x, y in zip(a, b, strict=True))


def _embed_twice(server: servers.Server, path: str, body: dict,
                 vector_of) -> tuple[list[float], list[float], str]:
    with client(server) as http:
        first = http.post(path, json=body)
        assert first.status_code == 200, first.text
        window = mark(server)
        second = http.post(path, json=body)
        assert second.status_code == 200, second.text
    return vector_of(first.json()), vector_of(second.json()), window.wait_for(RETRY_LINE)


def test_openai_embeddings_miss_gives_same_vector(server: servers.Server, model: str) -> None:
    body = {"model": model, "encoding_format": "float", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image_url((41, 41, 0))}},
        {"type": "text", "text": "a picture"}]}]}
    a, b, log = _embed_twice(server, "/v1/embeddings", body, lambda j: j["data"][0]["embedding"])
    assert _close(a, b)
    assert FAULT_DROP in log and ENGINE_MISS in log


def test_cohere_embed_miss_gives_same_vector(server: servers.Server, model: str) -> None:
    body = {"model": model, "images": [image_url((42, 42, 0))], "embedding_types": ["float"]}
    a, b, log = _embed_twice(server, "/v2/embed", body, lambda j: j["embeddings"]["float"][0])
    assert _close(a, b)
    assert FAULT_DROP in log and ENGINE_MISS in log
