"""The `vllm.general_plugins` entry point. vLLM calls `register()` in every process
it starts (API server, engine core, workers); it must be idempotent there."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

from vllm_mmretry import _patching, vllm_adapter
from vllm_mmretry.switches import PACKAGE_ENVS, switch_on

logger = logging.getLogger("vllm_mmretry")

ENV_SWITCH = "VLLM_MMRETRY"

# Set once per process: None = not yet run, else the labels patched (maybe empty).
_state: list[str] | None = None
# The package's variables this process declared to vLLM (declare_environment).
_declared: list[str] = []


def _installers() -> list[tuple[str, Callable[[], list[str]]]]:
    # Imported here: each pulls in vLLM modules, which only a supported vLLM has.
    from vllm_mmretry import catchup, faults, output_processor, receive, retry

    return [
        ("output processor", output_processor.install),
        ("output handler", catchup.install),
        ("engine-output receive", receive.install),
        ("serving retry", retry.install),
        ("fault switch", faults.install),
    ]


def _process_name() -> str:
    try:
        import setproctitle

        title = setproctitle.getproctitle()
    except ImportError:
        title = ""
    first = title.split()[0] if title.split() else ""
    if not first or "python" in first or first.startswith("/"):
        import multiprocessing

        first = multiprocessing.current_process().name
    return f"{first} pid={os.getpid()}"


def _vllm_logger() -> logging.Logger:
    # vLLM configures its own `vllm` logger tree; our lines go through it so they
    # appear in `vllm serve` output with vLLM's format and level.
    return vllm_adapter.vllm_logger("vllm.vllm_mmretry")


def _emit(log_fn: Callable[..., None], msg: str, *args: object) -> None:
    try:
        vllm_adapter.when_vllm_logging_ready(lambda: log_fn(msg, *args))
    except ImportError:  # no vLLM at all
        log_fn(msg, *args)


def register() -> list[str]:
    """Patch vLLM for this process. Returns the labels of what was patched."""
    global _state
    if _state is not None:
        return _state
    log = _vllm_logger()
    proc = _process_name()
    declare_environment()
    if not switch_on(ENV_SWITCH):
        # The test-only fault switch still applies, so tests can show what stock
        # vLLM does with the same induced fault.
        _state = _install_fault_switch_alone(log, proc)
        _emit(log.info, "vllm-mmretry disabled by %s=0 (%s); vLLM left unpatched%s",
              ENV_SWITCH, proc, f" except {', '.join(_state)}" if _state else "")
        return _state
    version = vllm_adapter.installed_vllm_version()
    if not vllm_adapter.is_supported(version):
        _emit(
            log.warning,
            "vllm-mmretry supports vLLM %s, found %s (%s); vLLM left unpatched",
            ", ".join(sorted(vllm_adapter.SUPPORTED_VLLM_VERSIONS)),
            version,
            proc,
        )
        _state = []
        return _state
    try:
        patched = _install_checked()
    except _patching.PatchError as exc:
        _emit(log.warning, "vllm-mmretry: %s (%s); vLLM left unpatched", exc, proc)
        _state = []
        return _state
    _state = patched
    _emit(
        log.info,
        "vllm-mmretry active for vLLM %s (%s): patched %s",
        version,
        proc,
        ", ".join(patched) or "nothing",
    )
    return patched


def _install_fault_switch_alone(log: logging.Logger, proc: str) -> list[str]:
    """With the plugin off: the fault switch only, on a supported vLLM, checked like
    every patch (a differing signature leaves vLLM unpatched with a WARNING)."""
    from vllm_mmretry import faults

    if not vllm_adapter.is_supported(vllm_adapter.installed_vllm_version()):
        return []
    if faults.parse(os.environ.get(faults.ENV, "")) is None:
        return []  # the usual case: nothing of vLLM's is imported for the off switch
    try:
        return _install_checked([("fault switch", faults.install)])
    except _patching.PatchError as exc:
        _emit(log.warning, "vllm-mmretry: %s (%s); the test fault switch is not installed",
              exc, proc)
        return []


def _install_checked(
        installers: list[tuple[str, Callable[[], list[str]]]] | None = None) -> list[str]:
    """Every installer (all of them unless named), or none: a vLLM function whose
    signature is not the adapter's record, a missing seam or any other failure to patch
    undoes what was patched and raises PatchError. A bad setting of this package (the
    retry budget, the metrics interval, the fault switch) is raised as it is: `vllm
    serve` stops and says which."""
    from vllm_mmretry import budget, faults, metrics
    from vllm_mmretry.budget import BudgetConfigError
    from vllm_mmretry.faults import FaultConfigError
    from vllm_mmretry.metrics import MetricsConfigError

    patched: list[str] = []
    what = "adapter"
    try:
        if installers is None:  # the whole plugin: its settings and the functions it calls
            budget.config_from_env()  # a bad setting stops vllm serve, whatever else differs
            metrics.interval_from_env()
        faults.parse(os.environ.get(faults.ENV, ""))
        found = vllm_adapter.adapter()
        if installers is None:
            problems = [*_patching.signature_problems(found.called_functions(), found.SIGNATURES),
                        *_patching.field_problems(found.read_fields())]
            if problems:
                raise _patching.PatchError("; ".join(problems))
        with _patching.expecting(found.SIGNATURES):
            for step, install in _installers() if installers is None else installers:
                what = step  # named in the error if this one fails
                patched.extend(install())
    except (BudgetConfigError, FaultConfigError, MetricsConfigError):
        _undo_partial()
        raise
    except Exception as exc:
        _undo_partial()
        if isinstance(exc, _patching.PatchError):
            raise
        raise _patching.PatchError(
            f"installing the {what} failed: {type(exc).__name__}: {exc}") from exc
    return patched


def _undo_partial() -> None:
    _patching.restore_all()
    _remove_request_output_error()


def declare_environment() -> None:
    """Declare the package's variables that are set to a supported vLLM, on or off
    (vLLM loads the plugin before it checks the environment). Only set ones: a
    declared name enters vLLM's compile-cache key. Cosmetic, so it never stops vLLM."""
    if not vllm_adapter.is_supported(vllm_adapter.installed_vllm_version()):
        return
    set_here = [name for name in PACKAGE_ENVS if name in os.environ]
    try:
        _declared.extend(vllm_adapter.declare_environment(set_here))
    except Exception as exc:  # noqa: BLE001 - vLLM's warning about them is what is lost
        _emit(_vllm_logger().warning, "vllm-mmretry: cannot declare its variables to vLLM "
              "(%s: %s); vLLM will call them unknown", type(exc).__name__, exc)


def active_patches() -> list[str]:
    """What `register()` patched in this process ([] if disabled or not run)."""
    return list(_state or [])


def uninstall() -> list[str]:
    """Undo every patch `register()` made in this process (newest first), and the
    `RequestOutput.error` class default it added; `register()` may run again."""
    global _state
    restored = _patching.restore_all()
    # Only loaded once an engine's metrics were sped up.
    prom = sys.modules.get("vllm_mmretry.prom")
    if prom is not None:
        restored.extend(prom.restore())
    restored.extend(_remove_request_output_error())
    vllm_adapter.drop_pending_lines()  # this process's lines are about what was undone
    if _declared:
        vllm_adapter.undeclare_environment(_declared)
    _declared.clear()
    _state = None
    return restored


def _remove_request_output_error() -> list[str]:
    # Only an adapter already built: building one here could raise the very import
    # error being undone.
    found = vllm_adapter.loaded()
    return found.remove_request_output_error() if found is not None else []


def _reset_for_tests() -> None:
    """Undo all patches so a test can compare with stock vLLM in-process."""
    uninstall()
