"""Adaptive thresholds: an interquartile-range fence over a rolling window.

Tukey's outer fence ``Q3 + k * IQR`` needs no distributional assumption and a
few outliers cannot drag it (unlike mean + k * std). The window holds only
scores the monitor accepted, so an attacker cannot raise the fence by being
flagged; it rolls, so the fence follows the slow drift of training. A floor
stops a window of near-identical scores (IQR ~ 0) from flagging noise.
"""
from __future__ import annotations

import bisect
import math
from collections import deque

from planner.errors import InvalidInputError


class IQRFence:
    """Rolling window of honest scores and the fence derived from it.

    ``fence = max(Q3 + k * IQR, floor, ratio * median)``. ``min_samples``
    scores are needed before the fence exists (``ready``); until then nothing
    exceeds it. The ``ratio`` term keeps a fence learnt in a calm stretch of
    training from flagging the next, livelier one: honest score levels move by
    tens of percent as training goes on, corruptions move them by multiples.
    """

    __slots__ = ("window", "k", "min_samples", "floor", "ratio", "_scores", "_sorted", "_fence")

    def __init__(self, *, window: int, k: float, min_samples: int, floor: float = 0.0,
                 ratio: float = 0.0) -> None:
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
        if ratio < 0:
            raise InvalidInputError("fence ratio", expected=">= 0", found=str(ratio))
        self.ratio = float(ratio)
        self.window = window
        self.k = float(k)
        self.min_samples = min_samples
        self.floor = float(floor)
        self._scores: deque[float] = deque()
        self._sorted: list[float] = []      # the same scores, kept sorted for the quartiles
        self._fence: float | None = None    # cached until the window changes

    def __len__(self) -> int:
        return len(self._scores)

    @property
    def ready(self) -> bool:
        return len(self._scores) >= self.min_samples

    def update(self, score: float) -> None:
        """Add an accepted score (the oldest one drops out of a full window)."""
        if not math.isfinite(score):
            raise InvalidInputError("fence score", expected="a finite number", found=str(score))
        score = float(score)
        self._scores.append(score)
        bisect.insort(self._sorted, score)
        if len(self._scores) > self.window:
            old = self._scores.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._fence = None

    def quantile(self, q: float) -> float:
        """The ``q`` quantile of the window, linear interpolation (numpy's default method)."""
        if not self._sorted:
            raise InvalidInputError("fence quantile", expected="at least one score", found="an empty window")
        pos = (len(self._sorted) - 1) * q
        lo = math.floor(pos)
        hi = min(lo + 1, len(self._sorted) - 1)
        return self._sorted[lo] + (pos - lo) * (self._sorted[hi] - self._sorted[lo])

    def quartiles(self) -> tuple[float, float]:
        """(Q1, Q3) of the window."""
        return self.quantile(0.25), self.quantile(0.75)

    def fence(self) -> float | None:
        """``max(Q3 + k * IQR, floor, ratio * median)``, or None before ``min_samples`` scores."""
        if not self.ready:
            return None
        if self._fence is None:
            q1, q3 = self.quartiles()
            self._fence = max(q3 + self.k * (q3 - q1), self.floor, self.ratio * self.quantile(0.5))
        return self._fence

    def exceeds(self, score: float) -> bool:
        """True when the fence exists and ``score`` is above it (NaN/inf always exceed)."""
        limit = self.fence()
        if limit is None:
            return False
        return not (score <= limit)
