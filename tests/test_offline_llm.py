"""Offline `vllm.LLM` on the tiny model: with the plugin active it generates the
same text and tokens as stock vLLM (VLLM_MMRETRY=0). One engine start per side,
each in its own subprocess so the test process stays unpatched."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=512, enforce_eager=True,
              kv_cache_memory_bytes=64 * 1024 * 1024, seed=0)
    prompts = ["The quick brown fox", "Hello, my name is", "A list of colors:"]
    params = [SamplingParams(temperature=0, max_tokens=24),
              SamplingParams(temperature=0, max_tokens=24, stop=[" the", "\\n"]),
              SamplingParams(temperature=0.8, seed=7, n=3, max_tokens=12)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    op = llm.llm_engine.output_processor
    result = {
        "op": type(op).__module__ + "." + type(op).__name__,
        "counters": op.counters() if hasattr(op, "counters") else None,
        "outputs": [
            [i, o.finished, getattr(o, "error", None),
             [(c.index, c.text, list(c.token_ids), c.finish_reason, c.stop_reason) for c in o.outputs]]
            for i, o in enumerate(outs)
        ],
    }
    print("RESULT " + json.dumps(result, default=repr))
    """
)


def _start(model: str, enabled: bool, out: pathlib.Path) -> subprocess.Popen[bytes]:
    """The script in a subprocess; its output goes to a file, so that a side that
    logs a lot never waits on a pipe while the test reads the other side."""
    env = dict(os.environ, VLLM_MMRETRY="1" if enabled else "0", HF_HUB_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", VLLM_CPU_KVCACHE_SPACE="1")
    with open(out, "wb") as f:
        return subprocess.Popen([sys.executable, "-c", SCRIPT, model], env=env,
                                stdout=f, stderr=subprocess.STDOUT)


def _result(proc: subprocess.Popen[bytes], out: pathlib.Path) -> dict:
    proc.wait(timeout=600)
    text = out.read_text(errors="replace")
    lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, text[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.slow  # two engine start-ups
def test_offline_llm_same_text_as_stock(tiny_model_path: str, tmp_path: pathlib.Path) -> None:
    # Both sides start at once: most of a start-up is single-threaded, and the outputs
    # are deterministic (greedy, or seeded), so sharing the two cores changes nothing.
    outs = [tmp_path / "ours.log", tmp_path / "stock.log"]
    procs = [_start(tiny_model_path, enabled, out)
             for enabled, out in zip((True, False), outs, strict=True)]
    try:
        ours, stock = [_result(p, out) for p, out in zip(procs, outs, strict=True)]
    finally:
        for p in procs:
            p.kill()
    assert stock["op"] == "vllm.v1.engine.output_processor.OutputProcessor"
    assert ours["op"] == "vllm_mmretry.output_processor.OutputProcessor"
    assert ours["outputs"] == stock["outputs"]
    # Something was generated, and the n=3 request has all its completions.
    assert all(c[1] for o in stock["outputs"] for c in o[3][:1])
    assert len(stock["outputs"][2][3]) == 3
    assert ours["counters"]["fast_steps"] > 0
    # All five sequences (1 + 1 + n=3) were detokenized natively.
    assert ours["counters"]["native_detok"] == 5 and ours["counters"]["python_detok"] == {}
