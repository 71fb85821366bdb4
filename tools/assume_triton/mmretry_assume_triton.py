"""Test set-up for vLLM 0.34 on an x86 CPU machine without triton-cpu (this one):
make `vllm.triton_utils.HAS_TRITON` true, so that 0.34's CPU platform check
(`CpuPlatform.check_and_update_config`: "vLLM on x86 CPUs requires Triton") lets the
headless front end start. The front end runs no kernels; vLLM's mock engine is the
engine.

`make setup-034` installs this module and a `.pth` file that imports it into
.venv-034 only (a `.pth` file composes with the tests' own `sitecustomize`). Nothing
in the package or its launcher does this: on a real deployment the check is vLLM's.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

TARGET = "vllm.triton_utils"


class _AssumeTriton(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of `vllm.triton_utils` so that the
    module's flag is set right after it has run."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_assume(module: Any) -> None:
            exec_module(module)
            module.HAS_TRITON = True

        spec.loader.exec_module = exec_and_assume  # type: ignore[method-assign]
        return spec


if not any(isinstance(f, _AssumeTriton) for f in sys.meta_path):
    sys.meta_path.insert(0, _AssumeTriton())
