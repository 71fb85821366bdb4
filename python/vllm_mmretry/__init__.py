"""vllm-mmretry: multimodal processor-cache miss recovery and a native output loop
for vLLM's V1 front end.

`register()` is the `vllm.general_plugins` entry point; vLLM calls it in every process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_mmretry._core import __version__ as _core_version
from vllm_mmretry.plugin import register

__version__ = "0.1.0"
if _core_version != __version__:  # a stale build of the extension would mislead
    raise ImportError(
        f"vllm_mmretry._core {_core_version} does not match the Python package "
        f"{__version__}; rebuild with `maturin develop --release`"
    )

if TYPE_CHECKING:
    from vllm_mmretry.output_processor import OutputProcessor

__all__ = ["OutputProcessor", "register", "__version__"]


def __getattr__(name: str) -> Any:
    # Imported lazily: importing vLLM's engine modules is slow and not needed
    # to register the plugin.
    if name == "OutputProcessor":
        from vllm_mmretry.output_processor import OutputProcessor

        return OutputProcessor
    raise AttributeError(f"module 'vllm_mmretry' has no attribute {name!r}")
