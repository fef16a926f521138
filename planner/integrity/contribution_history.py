"""A stage's replicas' past for the contribution monitor: its CUSUMs, its tests' robust spreads, what it learns."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from planner.integrity.contribution_tuning import (
    CUSUM_CAP,
    CUSUM_K,
    HISTORY_BETA,
    SPREAD_FLOOR,
    SPREAD_MIN,
    SPREAD_WINDOW,
)

__all__ = ["StageHistory", "cusum_step", "learn", "level_of", "median", "spread_of", "unit"]


@dataclass(slots=True)


class StageHistory:
    """A stage's replicas' past: the EMA of their sent directions' sum, the window of each test's in-control
    offsets (its robust spread), every CUSUM and its onset, and each replica's recent values per test (to
    tell which twin moved)."""

    response: torch.Tensor | None = None   # EMA of the sum of the replicas' sent unit directions (every step)
    response_before: torch.Tensor | None = None   # ``response`` as the agreement's CUSUM last left 0
    steps: int = 0
    offsets: dict[str, list[float]] = field(default_factory=lambda: {t: [] for t in SPREAD_WINDOW})
    sums: dict[tuple[int, str, int], float] = field(default_factory=dict)   # (rank, test, +1/-1) -> CUSUM
    poisoned: set[int] = field(default_factory=set)   # ranks flagged for a non-finite contribution
    onsets: dict[tuple[int, str, int], int] = field(default_factory=dict)   # CUSUM -> the step it last left 0
    series: dict[tuple[str, int], list[tuple[int, float]]] = field(default_factory=dict)   # (test, rank) -> values


def cusum_step(hist: StageHistory, key: tuple[int, str, int], z: float, step: int) -> float:
    """One step of a one-sided CUSUM of the score ``z`` (in robust deviations); its new value."""
    if hist.sums.get(key, 0.0) <= 0.0:
        hist.onsets[key] = step   # where this run of evidence began
    hist.sums[key] = max(0.0, hist.sums.get(key, 0.0) + min(z, CUSUM_CAP) - CUSUM_K)
    return round(hist.sums[key], 6)


def level_of(hist: StageHistory) -> float:
    """The stage's in-control agreement: the median of its window."""
    window = hist.offsets["agree"]
    return median(window) if window else 0.0


def spread_of(hist: StageHistory, test: str) -> float:
    """The robust spread of a test's honest offsets (their median absolute deviation / 0.6745, about their
    median for the agreement, about 0 for the others), at least its floor."""
    window = hist.offsets[test]
    if len(window) < SPREAD_MIN[test]:
        return math.inf
    centre = median(window) if test == "agree" else 0.0
    return max(median([abs(v - centre) for v in window]) / 0.6745, SPREAD_FLOOR[test])


def learn(hist: StageHistory, units: Mapping[int, torch.Tensor],
          offsets: Mapping[str, Mapping[int, float]]) -> None:
    hist.steps += 1
    for test, got in offsets.items():
        window = hist.offsets[test]
        window.extend(got.values())
        del window[:max(0, len(window) - SPREAD_WINDOW[test])]
    # every step, alarm or not: the response test reads how the twins answer the sums the stage took in
    # unnormalised: steps whose twins cancel (a flip) weigh little, as they do in the optimizer's momentum
    total = sum(units.values())
    hist.response = total if hist.response is None else HISTORY_BETA * hist.response + (1 - HISTORY_BETA) * total


def median(values: list[float]) -> float:
    ordered, mid = sorted(values), len(values) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def unit(v: torch.Tensor) -> torch.Tensor:
    n = float(v.norm())
    return v / n if n > 0 else v

