"""Print the `SIGNATURES` table of the running vLLM's adapter: the signature of every
vLLM function the plugin's patches replace and of every one the adapter calls
(`_patching.signature_of`). Paste it into the adapter when a new vLLM is adopted,
after reading what changed; `plugin.register` compares it at start-up.

    .venv/bin/python tools/seam_signatures.py
"""

from __future__ import annotations

import os

# Every switch that adds patches on, so that the table covers them all.
os.environ.update(VLLM_MMRETRY_FAULTS="p1_miss=every:1", VLLM_MMRETRY_NATIVE_DECODE="1",
                  VLLM_MMRETRY_NATIVE_RECEIVE="1")

from vllm_mmretry import _patching, plugin  # after the switches
from vllm_mmretry.vllm_adapter import adapter


def main() -> None:
    found = {}
    for _, install in plugin._installers():
        install()  # unchecked, to see every target
    for (owner, name), original in _patching._originals.items():
        found[_patching.label(owner, name)] = _patching.signature_of(original)
    plugin.uninstall()
    for label, fn in adapter().called_functions().items():
        found[label] = _patching.signature_of(fn)
    print("    SIGNATURES: ClassVar[dict[str, str]] = {")
    for label, sig in found.items():
        print(f"        {label!r}:")
        print("\n".join(f"            {piece!r}" for piece in _pieces(str(sig))) + ",")
    print("    }")


def _pieces(text: str, width: int = 84) -> list[str]:
    """`text` cut after ", " into pieces of at most about `width` characters."""
    pieces, line = [], ""
    for part in text.split(", "):
        candidate = f"{line}, {part}" if line else part
        if line and len(candidate) > width:
            pieces.append(line + ", ")
            line = part
        else:
            line = candidate
    return [*pieces, line]


if __name__ == "__main__":
    main()
