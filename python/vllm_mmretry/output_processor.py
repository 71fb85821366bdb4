"""(in progress)"""

from __future__ import annotations


def install() -> list[str]:
    return []
