"""Adaptive thresholds: an interquartile-range fence over a rolling window.

Tukey's outer fence ``Q3 + k * IQR`` needs no distributional assumption and a
few outliers cannot drag it (unlike mean + k * std). The window holds only
scores the monitor accepted, so an attacker cannot raise the fence by being
flagged; it rolls, so the fence follows the slow drift of training. A floor
stops a window of near-identical scores (IQR ~ 0) from flagging noise.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from planner.errors import InvalidInputError


class IQRFence:
    """Rolling window of honest scores and the fence derived from it.

    ``min_samples`` scores are needed before the fence exists (``ready``);
    until then nothing exceeds it.
    """

    __slots__ = ("window", "k", "min_samples", "floor", "_scores")

    def __init__(self, *, window: int, k: float, min_samples: int, floor: float = 0.0) -> None:
        if window < 4:
            raise InvalidInputError("verifier window", expected=">= 4 scores", found=str(window),
                                    fix="use a window of 64-128 scores")
        if not 1 <= min_samples <= window:
            raise InvalidInputError("fence min_samples", expected=f"between 1 and the window ({window})",
                                    found=str(min_samples))
        if k <= 0:
            raise InvalidInputError("iqr_k", expected="> 0 (e.g. 3.0)", found=str(k))
        if floor < 0:
            raise InvalidInputError("fence floor", expected=">= 0", found=str(floor))
        self.window = window
        self.k = float(k)
        self.min_samples = min_samples
        self.floor = float(floor)
        self._scores: deque[float] = deque(maxlen=window)

    def __len__(self) -> int:
        return len(self._scores)

    @property
    def ready(self) -> bool:
        return len(self._scores) >= self.min_samples

    def update(self, score: float) -> None:
        """Add an accepted score (the oldest one drops out of a full window)."""
        if not np.isfinite(score):
            raise InvalidInputError("fence score", expected="a finite number", found=str(score))
        self._scores.append(float(score))

    def quartiles(self) -> tuple[float, float]:
        """(Q1, Q3) of the window, linear interpolation (numpy's default)."""
        q1, q3 = np.percentile(np.fromiter(self._scores, dtype=np.float64), [25.0, 75.0])
        return float(q1), float(q3)

    def fence(self) -> float | None:
        """``max(Q3 + k * IQR, floor)``, or None before ``min_samples`` scores."""
        if not self.ready:
            return None
        q1, q3 = self.quartiles()
        return max(q3 + self.k * (q3 - q1), self.floor)

    def exceeds(self, score: float) -> bool:
        """True when the fence exists and ``score`` is above it (NaN/inf always exceed)."""
        limit = self.fence()
        if limit is None:
            return False
        return not (score <= limit)
