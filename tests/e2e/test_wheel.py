"""The release wheel, installed the way a user installs it.

`maturin build --release` makes exactly one abi3 wheel, versioned from Cargo.toml.
It goes into a fresh copy of the project's virtual environment (vLLM already in it)
from which the editable vllm-mmretry was removed; run from a temporary folder with
no source tree on sys.path, that environment's `vllm-mmretry serve` loads the
plugin through its entry point and answers a chat request about an image."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator

import httpx
import pytest
from e2e_helpers import chat_body, image_url, servers

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = pathlib.Path(__file__).resolve().parents[2]
VENV = pathlib.Path(sys.prefix)


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return {**env, "HF_HUB_OFFLINE": "1", **extra}


def _run(cmd: list[str], cwd: pathlib.Path, timeout: float = 1800, **env: str) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=_clean_env(**env))
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("wheels")
    # The interpreter the venvs' editable build used, which the Makefile exports as
    # PYO3_PYTHON (its BUILD_PY, the venv's base interpreter): with the same one cargo
    # reuses that build instead of rebuilding pyo3 and the crate.
    build_py = os.environ.get("PYO3_PYTHON") or os.path.realpath(sys.executable)
    _run([str(VENV / "bin" / "maturin"), "build", "--release", "-i", build_py,
          "--out", str(out)], ROOT)
    wheels = list(out.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def wheel_venv(wheel: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[pathlib.Path]:
    venv = tmp_path_factory.mktemp("venv") / "venv"
    subprocess.run(["cp", "-a", str(VENV), str(venv)], check=True, timeout=1800)
    py = str(venv / "bin" / "python")
    try:
        cwd = venv.parent
        _run([py, "-m", "pip", "uninstall", "-q", "-y", "vllm-mmretry"], cwd)
        _run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], cwd)
        yield venv
    finally:
        shutil.rmtree(venv, ignore_errors=True)


def test_one_abi3_wheel_with_the_cargo_version(wheel: pathlib.Path) -> None:
    version = tomllib.loads((ROOT / "Cargo.toml").read_text())["package"]["version"]
    assert re.fullmatch(rf"vllm_mmretry-{re.escape(version)}-cp311-abi3-\w+\.whl", wheel.name), (
        wheel.name)


def test_installed_wheel_is_not_the_source_tree(wheel_venv: pathlib.Path) -> None:
    out = _run([str(wheel_venv / "bin" / "python"), "-c", (
        "import json, sys, importlib.metadata as m, vllm_mmretry, vllm_mmretry._core as c; "
        "print(json.dumps({'file': vllm_mmretry.__file__, 'core': c.__file__, "
        "'version': vllm_mmretry.__version__, 'dist': m.version('vllm-mmretry'), "
        "'eps': [e.value for e in m.entry_points(group='vllm.general_plugins') "
        "if e.name == 'vllm_mmretry'], "
        "'path': sys.path}))")], wheel_venv.parent)
    r = json.loads(out)
    site = str(wheel_venv / "lib")
    assert r["file"].startswith(site) and r["core"].startswith(site), r
    assert r["version"] == r["dist"]
    assert r["eps"] == ["vllm_mmretry:register"]
    assert not any(p.startswith(str(ROOT)) for p in r["path"]), r["path"]


def test_wheel_serves_the_tiny_model_through_the_entry_point(
        wheel_venv: pathlib.Path, model: str) -> None:
    port = servers.free_port()
    log_path = wheel_venv.parent / "serve.log"
    cmd = [str(wheel_venv / "bin" / "vllm-mmretry"), "serve", model, "--host", "127.0.0.1",
           "--port", str(port), *servers.TINY_SERVE_ARGS]
    env = servers.server_env()
    env.pop("PYTHONPATH", None)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=wheel_venv.parent, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    server = servers.Server(f"http://127.0.0.1:{port}", log_path, proc.pid, proc)
    try:
        servers._wait_healthy(server, 600)
        with httpx.Client(base_url=server.base_url, timeout=300) as http:
            r = http.post("/v1/chat/completions",
                          json=chat_body(model, image_url((40, 41, 42))))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        log = server.log()
        assert re.search(r"vllm-mmretry active for vLLM 0\.32\.0 \(APIServer", log) or \
            re.search(r"vllm-mmretry active for vLLM 0\.32\.0", log), log[-3000:]
        assert "async_llm.OutputProcessor" in log
    finally:
        servers.stop(server)
