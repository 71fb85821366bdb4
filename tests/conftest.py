"""Shared fixtures for the test suite."""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT / "tools") not in sys.path:
    sys.path.insert(0, str(ROOT / "tools"))

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
