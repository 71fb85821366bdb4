"""A custom engine with vllm-mmretry installed by hand, then uninstalled.

`vllm serve` and `vllm.LLM` load the plugin through its entry point on their own.
A program that builds its engine itself, or that keeps vLLM's plugins off
(VLLM_PLUGINS), installs it with `vllm_mmretry.install()` and can take it out again
with `vllm_mmretry.uninstall()`. Run it on the tiny test model:

    .venv/bin/python examples/custom_engine.py "$(.venv/bin/python tools/tiny_model.py)"

It prints one JSON line per phase: which OutputProcessor the engine got, the text,
and the native loop's counters."""

from __future__ import annotations

import json
import os
import sys

# This example installs the plugin itself instead of through the entry point.
os.environ["VLLM_PLUGINS"] = ""
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

import vllm_mmretry


def generate(model: str) -> dict[str, object]:
    """Build an offline engine, generate greedily, report what ran."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", max_model_len=512, enforce_eager=True,
              kv_cache_memory_bytes=64 * 1024 * 1024, seed=0)
    params = SamplingParams(temperature=0, max_tokens=16)
    out = llm.generate(["The quick brown fox"], params, use_tqdm=False)[0]
    op = llm.llm_engine.output_processor
    report = {
        "output_processor": f"{type(op).__module__}.{type(op).__name__}",
        "is_ours": isinstance(op, vllm_mmretry.OutputProcessor),
        "text": out.outputs[0].text,
        "token_ids": list(out.outputs[0].token_ids),
        "error": getattr(out, "error", None),
        "counters": op.counters() if isinstance(op, vllm_mmretry.OutputProcessor) else None,
    }
    del llm
    return report


def main(model: str) -> None:
    patched = vllm_mmretry.install()
    print(json.dumps({"phase": "installed", "patched": patched}))
    print(json.dumps({"phase": "with_plugin", **generate(model)}, default=repr))

    restored = vllm_mmretry.uninstall()
    print(json.dumps({"phase": "uninstalled", "restored": restored}))
    print(json.dumps({"phase": "stock", **generate(model)}, default=repr))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} MODEL_FOLDER")
    main(sys.argv[1])
