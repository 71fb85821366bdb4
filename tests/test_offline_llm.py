"""Offline `vllm.LLM` on the tiny model: with the plugin active it generates the
same text and tokens as stock vLLM (VLLM_MMRETRY=0). One engine start per side,
each in its own subprocess so the test process stays unpatched."""

from __future__ import annotations

import json
import os
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


def _run(model: str, enabled: bool) -> dict:
    env = dict(os.environ, VLLM_MMRETRY="1" if enabled else "0", HF_HUB_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, model], env=env, capture_output=True,
                          text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.slow  # two engine start-ups
def test_offline_llm_same_text_as_stock(tiny_model_path: str) -> None:
    ours = _run(tiny_model_path, True)
    stock = _run(tiny_model_path, False)
    assert stock["op"] == "vllm.v1.engine.output_processor.OutputProcessor"
    assert ours["op"] == "vllm_mmretry.output_processor.OutputProcessor"
    assert ours["outputs"] == stock["outputs"]
    # Something was generated, and the n=3 request has all its completions.
    assert all(c[1] for o in stock["outputs"] for c in o[3][:1])
    assert len(stock["outputs"][2][3]) == 3
    assert ours["counters"]["fast_steps"] > 0
    # All five sequences (1 + 1 + n=3) were detokenized natively.
    assert ours["counters"]["native_detok"] == 5 and ours["counters"]["python_detok"] == {}
