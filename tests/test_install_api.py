"""The public API for custom engines: `install()` patches what the entry point
patches, `uninstall()` restores every one of those attributes (and the
`RequestOutput.error` default), and `install()` works again afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = textwrap.dedent("""
    import json
    import vllm_mmretry
    from vllm_mmretry import _patching
    from vllm.outputs import RequestOutput
    from vllm.v1.engine import async_llm, llm_engine, output_processor
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.multimodal.cache.lru import LruKeyReplicatedReceiverCache

    def snapshot():
        return {
            "async_llm_op": async_llm.OutputProcessor,
            "llm_engine_op": llm_engine.OutputProcessor,
            "ro_init": RequestOutput.__init__, "ro_add": RequestOutput.add,
            "generate": AsyncLLM.generate, "chat": OpenAIServingChat.create_chat_completion,
            "receiver": LruKeyReplicatedReceiverCache.get_and_update_item,
            "ro_error": "error" in RequestOutput.__dict__,
        }

    stock = snapshot()
    patched = vllm_mmretry.install()
    during = snapshot()
    again = vllm_mmretry.install()
    restored = vllm_mmretry.uninstall()
    after = snapshot()
    reinstalled = vllm_mmretry.install()
    print(json.dumps({
        "patched": patched, "again_same": again == patched, "restored": restored,
        "changed_during": sorted(k for k in stock if stock[k] != during[k]),
        "changed_after": sorted(k for k in stock if stock[k] != after[k]),
        "originals_left": len(_patching._originals) - len(reinstalled),
        "reinstalled_same": sorted(reinstalled) == sorted(patched),
        "op_is_ours": during["async_llm_op"] is vllm_mmretry.OutputProcessor,
    }))
""")


def _probe(**env: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("faults", ["", "p1_miss=every:1"])
def test_uninstall_restores_everything_install_patched(faults: str) -> None:
    r = _probe(VLLM_MMRETRY_FAULTS=faults, VLLM_PLUGINS="")
    assert r["op_is_ours"] and r["again_same"] and r["reinstalled_same"]
    expected = {"async_llm_op", "llm_engine_op", "ro_init", "ro_add", "generate", "chat",
                "ro_error"} | ({"receiver"} if faults else set())
    assert set(r["changed_during"]) == expected
    assert r["changed_after"] == []
    # Every patched label comes back (the fault switch's carry a " [test fault ...]"
    # note), plus the RequestOutput.error class default.
    patched = [label.split(" [")[0] for label in r["patched"]]
    assert sorted(r["restored"]) == sorted([*patched, "RequestOutput.error"])
    assert r["originals_left"] == 0


def test_public_names() -> None:
    import vllm_mmretry

    assert {"install", "uninstall", "register", "OutputProcessor",
            "__version__"} <= set(vllm_mmretry.__all__)
    from vllm_mmretry.output_processor import OutputProcessor

    assert vllm_mmretry.OutputProcessor is OutputProcessor
    assert vllm_mmretry.install.__doc__ and vllm_mmretry.uninstall.__doc__


@pytest.mark.slow  # two offline engine start-ups
def test_custom_engine_example_runs(tiny_model_path: str) -> None:
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "custom_engine.py"),
                           tiny_model_path], capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    phases = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            phases[record["phase"]] = record
    assert set(phases) == {"installed", "with_plugin", "uninstalled", "stock"}
    ours, stock = phases["with_plugin"], phases["stock"]
    assert ours["is_ours"]
    assert ours["output_processor"] == "vllm_mmretry.output_processor.OutputProcessor"
    assert not stock["is_ours"] and stock["output_processor"] == (
        "vllm.v1.engine.output_processor.OutputProcessor")
    assert ours["counters"]["fast_steps"] > 0 and ours["counters"]["native_detok"] == 1
    assert ours["text"] and ours["text"] == stock["text"]
    assert ours["token_ids"] == stock["token_ids"]
    assert sorted(phases["uninstalled"]["restored"]) == sorted(
        [*phases["installed"]["patched"], "RequestOutput.error"])
