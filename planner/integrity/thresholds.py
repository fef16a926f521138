"""Adaptive thresholds: an interquartile-range fence over a rolling window,
and the verifier's configuration (fence floors and ratios, warm-up, bans).

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
    scores are needed before the fence exists (``ready``); until then the
    ``fallback`` fence stands in (if given and ready), else nothing exceeds it. The ``ratio`` term keeps a fence learnt in a calm stretch of
    training from flagging the next, livelier one: honest score levels move by
    tens of percent as training goes on, corruptions move them by multiples.
    ``capped``: the fence is never above the fallback's (a step's average is less noisy
    than any of its samples, so the samples' fence bounds the average's; see
    ``Monitor.step_fences``).
    """

    __slots__ = ("_fence", "_scores", "_sorted", "capped", "fallback", "floor", "k", "min_samples", "ratio",
                 "window")

    def __init__(self, *, window: int, k: float, min_samples: int, floor: float = 0.0,
                 ratio: float = 0.0, fallback: IQRFence | None = None, capped: bool = False) -> None:
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
        self.fallback = fallback
        self.capped = capped and fallback is not None
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
        """``max(Q3 + k * IQR, floor, ratio * median)``, at most the fallback's if ``capped``; before
        ``min_samples`` scores, the fallback's fence (None without one)."""
        if not self.ready:
            return None if self.fallback is None else self.fallback.fence()
        if self._fence is None:
            q1, q3 = self.quartiles()
            self._fence = max(q3 + self.k * (q3 - q1), self.floor, self.ratio * self.quantile(0.5))
        if self.capped:
            assert self.fallback is not None
            cap = self.fallback.fence()
            if cap is not None and cap < self._fence:
                return cap
        return self._fence

    def exceeds(self, score: float) -> bool:
        """True when the fence exists and ``score`` is above it (NaN/inf always exceed)."""
        limit = self.fence()
        if limit is None:
            return False
        return not (score <= limit)


class Cusum:
    """One-sided CUSUM of a positive score against its own honest history: catches a
    sender that keeps a score *persistently* high while staying under its fence.

    Each sample's ``z = (ln score - median) / spread`` is read against a rolling
    window of the logs of accepted, in-control samples (``spread``: their IQR /
    1.349, at least ``min_spread``); ``S = max(0, S + min(z, cap) - k)``. Honest
    scores scatter around the median (z mostly below ``k``, so S stays near 0, and
    ``cap`` keeps one outlier from lifting it far); an attacker holding the score
    at, say, twice its honest level adds ``z - k`` every sample and crosses any
    fence on S within a few steps, however far below the score's own fence it
    stays. Samples with ``z >= k`` never teach the baseline, so a slow creep
    cannot drag it along.
    """

    __slots__ = ("_logs", "_sorted", "cap", "k", "min_samples", "min_spread", "value", "window")

    def __init__(self, *, window: int, k: float, cap: float = 4.0, min_samples: int = 16,
                 min_spread: float = 0.1) -> None:
        if k <= 0 or cap <= k:
            raise InvalidInputError("drift test", expected="0 < k < cap", found=f"k={k}, cap={cap}")
        self.window, self.k, self.cap = window, float(k), float(cap)
        self.min_samples, self.min_spread = min(min_samples, window), float(min_spread)
        self._logs: deque[float] = deque()
        self._sorted: list[float] = []
        self.value = 0.0

    def z(self, score: float) -> float | None:
        """The score's standardised log against the baseline (None: too few samples yet)."""
        if len(self._sorted) < self.min_samples or not score > 0 or not math.isfinite(score):
            return None
        n = len(self._sorted)
        median, q1, q3 = (self._quantile(q, n) for q in (0.5, 0.25, 0.75))
        return (math.log(score) - median) / max((q3 - q1) / 1.349, self.min_spread)

    def _quantile(self, q: float, n: int) -> float:
        pos = (n - 1) * q
        lo = math.floor(pos)
        hi = min(lo + 1, n - 1)
        return self._sorted[lo] + (pos - lo) * (self._sorted[hi] - self._sorted[lo])

    def step(self, score: float) -> float:
        """Add a checked sample to the sum; returns the new value of S."""
        z = self.z(score)
        if z is not None:
            self.value = max(0.0, self.value + min(z, self.cap) - self.k)
        return self.value

    def learn(self, score: float) -> None:
        """Teach the baseline an accepted sample's score, unless it looked out of control."""
        z = self.z(score)
        if not score > 0 or not math.isfinite(score) or (z is not None and z >= self.k):
            return
        value = math.log(score)
        self._logs.append(value)
        bisect.insort(self._sorted, value)
        if len(self._logs) > self.window:
            old = self._logs.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]


class TrendLevel:
    """Holt's damped linear trend of a score that moves steadily with training (a boundary tensor's log size):
    ``predict(step)`` is the level learnt from accepted steps, carried on by their slope to ``step``.

    An EMA of a series that trends lags it by the trend times its memory: a tiny HF Llama's activations grew
    0.02-0.1 e-folds a step for the first 30 steps, an EMA reference trailed them by 0.2-0.6 e-folds, and the
    size fence learnt from those lags stood at 1.7 e-folds when an attack began at step 20 (a sender halving
    its activations, 0.69, or tripling its gradients, 1.1, passed and was learnt). Against the trend the honest
    residuals stay at 0.02-0.4 e-folds (3 seeds x 200 steps), so the fence is the floor. ``damping`` per step
    bounds how far a slope is carried over steps that teach nothing (a flagged sender's)."""

    __slots__ = ("_level", "_slope", "_step", "alpha", "damping", "gamma", "updates")

    def __init__(self, *, alpha: float = 0.6, gamma: float = 0.3, damping: float = 0.9) -> None:
        if not (0.0 < alpha <= 1.0 and 0.0 <= gamma <= 1.0 and 0.0 <= damping <= 1.0):
            raise InvalidInputError("trend smoothing", expected="0 < alpha <= 1, 0 <= gamma <= 1, 0 <= damping <= 1",
                                    found=f"alpha={alpha}, gamma={gamma}, damping={damping}")
        self.alpha, self.gamma, self.damping = float(alpha), float(gamma), float(damping)
        self._level: float | None = None
        self._slope = 0.0
        self._step = 0
        self.updates = 0

    def _carried(self, steps: int) -> float:
        """The slope's sum over ``steps`` damped steps: ``phi + phi^2 + ... + phi^steps``."""
        phi = self.damping
        return float(steps) if phi == 1.0 else phi * (1.0 - phi ** steps) / (1.0 - phi)

    def predict(self, step: int) -> float | None:
        """The level expected at ``step`` (None before two steps were learnt: no slope yet)."""
        if self._level is None or self.updates < 2:
            return None
        return self._level + self._slope * self._carried(max(0, step - self._step))

    def learn(self, step: int, value: float) -> None:
        """Teach an accepted step's value (steps in increasing order; non-finite values are ignored)."""
        if not math.isfinite(value):
            return
        if self._level is None:
            self._level, self._step, self.updates = float(value), int(step), 1
            return
        gap = max(1, int(step) - self._step)
        guess = self._level + self._slope * self._carried(gap)
        level = guess + self.alpha * (value - guess)
        carried = self._slope * self.damping ** gap
        self._slope = carried + self.gamma * ((level - self._level) / gap - carried)
        self._level, self._step = level, int(step)
        self.updates += 1
