"""How the micro-benchmarks pair stock with ours: turns, and the ratio summary.

Each benchmark times stock and ours in alternating blocks or steps, so a pair ran
within milliseconds on the same machine state; the ratio of each pair, not of the two
medians, is what drifts least on this VM."""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def taking_turns(sides: Sequence[T], turn: int) -> list[T]:
    """The sides in the order they run in this turn: who goes first alternates, so
    neither always runs with the caches the other just filled."""
    return list(sides) if turn % 2 == 0 else list(sides)[::-1]


def paired_ratios(stock: Sequence[float], ours: Sequence[float]) -> dict[str, Any]:
    """Median of the per-pair ratios stock/ours and their 10th-90th percentile range."""
    ratios = sorted(s / o for s, o in zip(stock, ours, strict=True))
    tenth = len(ratios) // 10
    return {
        "ratio": round(statistics.median(ratios), 2),
        "ratio_p10_p90": [round(ratios[tenth], 2), round(ratios[-1 - tenth], 2)],
    }
