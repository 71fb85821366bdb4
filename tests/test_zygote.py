"""The test harness's warm interpreter (tools/zygote.py) gives what a fresh one gives:
the doctor's report and the plugin's patches compared with a fresh run, its exit
statuses and time-out, and the runs it must leave to a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import zygote  # tools/, put on sys.path by conftest

PATCHES = """
import json
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm_mmretry import _patching, plugin
print(json.dumps({"state": plugin.active_patches(), "originals": len(_patching._originals)}))
"""


def fresh(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.mark.parametrize("switch", ["1", "0"])
def test_the_plugins_patches_are_those_of_a_fresh_interpreter(switch: str) -> None:
    env = {**os.environ, "VLLM_MMRETRY": switch}
    assert zygote.shared().forkable(["-c", PATCHES], env)
    warm, cold = zygote.shared().run(["-c", PATCHES], env, timeout=300), fresh(["-c", PATCHES], env)
    assert (warm.returncode, warm.stdout) == (cold.returncode, cold.stdout) == (0, warm.stdout)
    assert bool(json.loads(warm.stdout)["state"]) is (switch == "1")


def test_the_doctors_report_is_that_of_a_fresh_interpreter(tiny_model_path: str) -> None:
    args = ["-m", "vllm_mmretry.cli", "doctor", tiny_model_path, "--json"]
    env = {**os.environ, "VLLM_MMRETRY_FAULTS": "p1_miss=every:3"}
    warm, cold = zygote.shared().run(args, env, timeout=300), fresh(args, env)
    assert warm.returncode == cold.returncode == 0, warm.stderr[-3000:]
    assert json.loads(warm.stdout) == json.loads(cold.stdout)


def test_exit_status_output_and_traceback_are_the_childs() -> None:
    z = zygote.shared()
    env = dict(os.environ)
    r = z.run(["-c", "import sys; print(sys.argv); sys.stderr.write('e'); raise SystemExit(3)", "a"],
              env, timeout=60)
    assert (r.returncode, r.stdout, r.stderr) == (3, "['-c', 'a']\n", "e")
    r = z.run(["-c", "1/0"], env, timeout=60)
    assert r.returncode == 1 and r.stderr.endswith("ZeroDivisionError: division by zero\n")
    r = z.run(["-m", "vllm_mmretry.cli", "--version"], env, timeout=60)
    assert r.returncode == 0 and r.stdout == fresh(["-m", "vllm_mmretry.cli", "--version"], env).stdout


def test_a_run_past_its_time_out_is_killed_and_the_zygote_goes_on() -> None:
    z = zygote.shared()
    with pytest.raises(subprocess.TimeoutExpired):
        z.run(["-c", "import time; time.sleep(60)"], dict(os.environ), timeout=1)
    assert z.run(["-c", "print('next')"], dict(os.environ), timeout=60).stdout == "next\n"


@pytest.mark.parametrize(("change", "forks"), [
    ({"VLLM_MMRETRY_FAULTS": "p1_miss=every:3"}, True),   # read lazily, after the fork
    ({"VLLM_PLUGINS": "vllm_mmretry"}, True),
    ({"VLLM_LOGGING_LEVEL": "DEBUG"}, False),              # read by `import vllm`
    ({"PYTHONPATH": "/tmp"}, False),                       # a sitecustomize could be there
    ({"HF_HUB_OFFLINE": "0"}, False),                      # read by libraries at import
])
def test_only_runs_whose_start_up_is_the_zygotes_fork(change: dict[str, str], forks: bool) -> None:
    z = zygote.shared()
    assert z.forkable(["-c", "pass"], {**os.environ, **change}) is forks
    assert not z.forkable(["script.py"], dict(os.environ))


def test_the_reads_of_a_whole_start_up_can_be_recorded() -> None:
    """For an environment whose .pth files import vLLM before the zygote's recorder is
    in: a `python -S` run records site's start-up and the preload."""
    read = zygote._reads_of_a_fresh_start()
    assert {"VLLM_LOGGING_LEVEL", "VLLM_LOGGING_PREFIX"} <= read
    assert "VLLM_MMRETRY" not in read and "*" not in read
