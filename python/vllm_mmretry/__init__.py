"""vllm-mmretry: multimodal processor-cache miss recovery and a native output loop
for vLLM's V1 front end.

- `register()` is the `vllm.general_plugins` entry point; vLLM calls it in every
  process it starts (`vllm serve`, `LLM(...)`, ...). Nothing else is needed there.
- `install()` / `uninstall()` are for custom engines and tests: `install()` patches
  this process's vLLM exactly as the entry point does (idempotent; honours
  VLLM_MMRETRY=0; patches nothing on an unsupported vLLM) and returns the labels of
  what it patched; `uninstall()` puts every patched attribute back and returns the
  labels it restored. Engines built while installed keep their OutputProcessor.
- `OutputProcessor` is the drop-in for `vllm.v1.engine.output_processor.OutputProcessor`
  (same constructor and methods) for engines that build their own.

The version comes from the compiled core, which maturin builds from Cargo.toml:
the one place the version is written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_mmretry._core import __version__
from vllm_mmretry.plugin import register

if TYPE_CHECKING:
    from vllm_mmretry.output_processor import OutputProcessor

__all__ = ["OutputProcessor", "__version__", "install", "register", "uninstall"]


def install() -> list[str]:
    """Patch vLLM in this process as the plugin entry point does; return the labels."""
    return register()


def uninstall() -> list[str]:
    """Undo everything `install()` / `register()` patched; return the labels restored."""
    from vllm_mmretry.plugin import uninstall as _uninstall

    return _uninstall()


def __getattr__(name: str) -> Any:
    # Imported lazily: importing vLLM's engine modules is slow and not needed
    # to register the plugin.
    if name == "OutputProcessor":
        from vllm_mmretry.output_processor import OutputProcessor

        return OutputProcessor
    raise AttributeError(f"module 'vllm_mmretry' has no attribute {name!r}")
