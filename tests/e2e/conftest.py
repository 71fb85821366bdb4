"""Fixtures for the end-to-end tests (helpers live in e2e_helpers.py).

A server configuration that several modules test is started once per session here:
a start costs about a minute of the 2-core machine. Tests on a shared server stay
independent by construction: each uses images of its own colour (so no test sees
another's cache entries), reads the log through `mark()` windows and compares
metrics before and after its own requests."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
from e2e_helpers import servers, start_server, tiny_model

MISS = {"VLLM_MMRETRY_FAULTS": "p1_miss=every:1"}
MISS_AND_RETRY_MISS = {"VLLM_MMRETRY_FAULTS": "p1_miss=every:1,retry_miss=1"}
STOCK = {"VLLM_MMRETRY": "0"}


@pytest.fixture(scope="session")
def model() -> str:
    return str(tiny_model.ensure_tiny_model())


@pytest.fixture(scope="session")
def plugin_miss_server(model: str) -> Iterator[servers.Server]:
    """Plugin on, every engine cache hit turned into a miss: recoveries."""
    yield from start_server(model, env=MISS)


@pytest.fixture(scope="session")
def plugin_retry_miss_server(model: str) -> Iterator[servers.Server]:
    """Plugin on, and the retry's re-send misses once more: second failures."""
    yield from start_server(model, env=MISS_AND_RETRY_MISS)


@pytest.fixture(scope="session")
def stock_miss_server(model: str) -> Iterator[servers.Server]:
    """Plugin off (VLLM_MMRETRY=0), the same induced misses: stock vLLM's answers."""
    yield from start_server(model, env={**STOCK, **MISS})


@pytest.fixture(scope="session")
def multiproc_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """vLLM makes a temporary PROMETHEUS_MULTIPROC_DIR itself; the tests name one so
    they can look at the per-process files behind the summed answer."""
    return tmp_path_factory.mktemp("prometheus_multiproc")


@pytest.fixture(scope="session")
def two_api_servers(model: str, multiproc_dir: pathlib.Path) -> Iterator[servers.Server]:
    """`--api-server-count 2` with the fault switch on; `--enable-log-requests` so the
    "Added request" lines carry the answering API server's tag."""
    yield from start_server(model, "--api-server-count", "2", "--enable-log-requests",
                            env={**MISS, "PROMETHEUS_MULTIPROC_DIR": str(multiproc_dir)})
