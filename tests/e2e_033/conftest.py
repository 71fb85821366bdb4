"""Fixtures for the vLLM 0.33 and 0.34 HTTP tests: the headless front end (through our
launcher, the plugin loaded by vLLM's entry point) with vLLM's mock engine behind it
(tools/mock_serve.py; `make mock-engine` builds the engine with our fault mode)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from e033_helpers import TARGETS, installed_vllm_version, mock_serve, serve, tiny_model


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    version = installed_vllm_version()
    if version in TARGETS:
        return
    skip = pytest.mark.skip(reason=f"tests/e2e_033 run against vLLM {' and '.join(TARGETS)} "
                                   "(.venv-033, .venv-034: `make test-033`, `make test-034`); "
                                   f"this environment has vLLM {version}")
    for item in items:
        if "e2e_033" in item.nodeid.split("/"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model() -> str:
    return str(tiny_model.ensure_tiny_model())


@pytest.fixture(scope="session")
def stock_miss_served(model: str) -> Iterator[mock_serve.MockServed]:
    """Stock 0.33 (the plugin off) with the mock engine forgetting every item it saw:
    started once for both modules (each test uses images of its own colour). The fault
    switch also loads in the front end, where it only logs: the API server has no P1
    receiver cache."""
    yield from serve(model, env={"VLLM_MMRETRY": "0", "VLLM_MMRETRY_FAULTS": "p1_miss=every:1"})

