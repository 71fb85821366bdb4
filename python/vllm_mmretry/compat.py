"""Old name of the vLLM adapter, kept for callers of `compat.X`: version lookup
and logging helpers from `vllm_adapter`, everything else from the adapter of the
installed vLLM. Knows nothing about vLLM itself."""

from __future__ import annotations

from typing import Any

from vllm_mmretry.vllm_adapter import (  # noqa: F401 - re-exported
    SUPPORTED_VLLM_VERSIONS,
    VLLM_DISTRIBUTIONS,
    adapter,
    installed_vllm_version,
    is_supported,
    when_vllm_logging_ready,
)


def __getattr__(name: str) -> Any:
    return getattr(adapter(), name)
