"""The plugin as vLLM loads it: entry point, version gate, VLLM_MMRETRY=0, and the
log lines of a real running server."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import servers  # tools/, put on sys.path by conftest

from vllm_mmretry import vllm_adapter

PY = sys.executable


def _run(code: str, **env: str) -> dict:
    """Run `code` in a fresh interpreter (patches are per process); it prints JSON."""
    out = subprocess.run(
        [PY, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


PROBE = """
    import json, vllm_mmretry.vllm_adapter
    {setup}
    from vllm.plugins import load_general_plugins
    load_general_plugins()  # what vLLM does in every process
    from vllm.v1.engine import async_llm, llm_engine, output_processor
    from vllm_mmretry import _patching, plugin
    print(json.dumps({{
        "state": plugin.active_patches(),
        "originals": len(_patching._originals),
        "async_llm_op": async_llm.OutputProcessor.__module__,
        "llm_engine_op": llm_engine.OutputProcessor.__module__,
    }}))
"""


def test_entry_point_is_registered_for_vllm() -> None:
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert [ep.value for ep in eps if ep.name == "vllm_mmretry"] == ["vllm_mmretry:register"]


def test_supported_vllm_is_patched_through_the_entry_point() -> None:
    r = _run(PROBE.format(setup=""))
    assert r["originals"] > 0 and r["state"], r
    assert r["async_llm_op"].startswith("vllm_mmretry") and r["llm_engine_op"].startswith("vllm_mmretry")


def test_disabled_leaves_vllm_untouched() -> None:
    r = _run(PROBE.format(setup=""), VLLM_MMRETRY="0")
    assert r == {
        "state": [],
        "originals": 0,
        "async_llm_op": "vllm.v1.engine.output_processor",
        "llm_engine_op": "vllm.v1.engine.output_processor",
    }


@pytest.mark.parametrize(
    "version, supported",
    [
        ("0.32.0", True),
        ("0.33.0", True),
        ("0.31.9", False),
        ("0.32.1", False),
        ("0.33.1", False),
        ("0.34.0", False),
        ("", False),
        (None, False),
    ],
)
def test_version_gate_accepts_exactly_0_32_0_and_0_33_0(version: str | None, supported: bool) -> None:
    assert vllm_adapter.is_supported(version) is supported
    assert vllm_adapter.SUPPORTED_VLLM_VERSIONS == {"0.32.0", "0.33.0"}


@pytest.mark.parametrize("version", ["0.31.9", "0.34.0"])
def test_unsupported_vllm_version_leaves_vllm_untouched(version: str) -> None:
    r = _run(PROBE.format(setup=f"import vllm; vllm.__version__ = '{version}'"))
    assert r == {
        "state": [],
        "originals": 0,
        "async_llm_op": "vllm.v1.engine.output_processor",
        "llm_engine_op": "vllm.v1.engine.output_processor",
    }


def test_register_is_idempotent_and_refuses_double_patching() -> None:
    r = _run("""
        import json, vllm_mmretry
        from vllm_mmretry import _patching, output_processor
        first = vllm_mmretry.register()
        second = vllm_mmretry.register()
        try:
            output_processor.install()
            refused = False
        except _patching.PatchError:
            refused = True
        print(json.dumps({"same": first == second, "n": len(first), "refused": refused}))
    """)
    assert r == {"same": True, "n": r["n"], "refused": True} and r["n"] > 0


@pytest.fixture(scope="module")
def plain_server(tiny_model_path):
    with servers.serve(tiny_model_path) as s:
        yield s


@pytest.mark.e2e  # starts a real server
def test_plugin_active_in_api_server_and_engine_core_of_a_running_server(plain_server) -> None:
    import urllib.request

    with urllib.request.urlopen(plain_server.base_url + "/health") as r:
        assert r.status == 200
    log = plain_server.log()
    # Our line can come before vLLM names the process (the API server logs it as
    # MainProcess, right after logging is configured), so match processes by pid.
    role_of = {pid: role for role, pid in re.findall(r"^\((APIServer|EngineCore)[\w-]* pid=(\d+)\)", log, re.M)}
    active = re.findall(
        r"^\([\w-]+ pid=(\d+)\).*vllm-mmretry active for vLLM [\d.]+ \([^)]*\): patched (.+)$", log, re.M
    )
    pids = [pid for pid, _ in active]
    assert len(pids) == len(set(pids)), "one line per process"
    patched = {role_of[pid]: labels for pid, labels in active if pid in role_of}
    assert set(patched) == {"APIServer", "EngineCore"}, log[-3000:]
    # The API server runs our output processor and the serving retry points.
    for label in ("async_llm.OutputProcessor", "OpenAIServingChat.create_chat_completion"):
        assert label in patched["APIServer"] and label in patched["EngineCore"]
