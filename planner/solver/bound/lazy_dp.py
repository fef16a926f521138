"""The sequence DP behind a cheaper, looser DP that answers for it whenever its plan is also the full DP's.

A DP with fewer memory layers (the deeper stages lumped, assuming fewer
microbatches in flight) costs less than the full one, a DP's cost growing
with its layers. Its minimum at given prices and caps is at most the full
DP's; when its plan also meets the full DP's memory layers (and exact caps)
it is a plan of the full DP too, and so the full DP's minimum: the same
dual value. Otherwise the full DP runs after it, and while the looser try
misses more than it pays for it is skipped (tried now and then to keep its
hit rate current).

The loose cap test (``SequenceDP.with_loose_cap``) is not a looser DP tried
on every call for its plans: they meet the exact caps too rarely to pay for
the DPs it costs the bound (tuning history: benchmarks/README.md).
"""
from __future__ import annotations

import numpy as np

from planner.solver.bound.sequence_dp import INF, Cut, Relaxed, SequenceDP
from planner.solver.problem import Problem

# The fewer-layer DP's layers, the tries before the looser DP's hit rate counts, the hit rate below which it
# costs more than it saves, and how often it is tried anyway while skipped.
COARSE_LAYERS = 8
LAZY_WARMUP = 16
LAZY_MIN_HIT_RATE = 0.35
LAZY_PROBE_EVERY = 8


class LazyDP:
    """``full``'s answers, from ``loose`` (a relaxation of it sharing its tables) where that gives them.

    ``full`` may itself be a ``LazyDP`` (a chain of looser DPs). ``always``: try ``loose`` on every call,
    whatever its hit rate (its plans are wanted anyway). ``missed``: the looser answers of the last call that
    were not the full DP's; they are still relaxed plans, worth pricing.
    """

    def __init__(self, full: SequenceDP | LazyDP, loose: SequenceDP, *, always: bool = False) -> None:
        self.full, self.loose, self.always = full, loose, always
        self.base: SequenceDP = full.base if isinstance(full, LazyDP) else full
        self.C, self.count = self.base.C, self.base.count
        self.tries = self.hits = self.calls = 0
        self.missed: list[Relaxed] = []

    def _worth_trying(self) -> bool:
        self.calls += 1
        probe = self.calls % LAZY_PROBE_EVERY == 0  # keep measuring the hit rate while skipping
        return self.always or self.tries < LAZY_WARMUP or self.hits >= LAZY_MIN_HIT_RATE * self.tries or probe

    def run(self, cap_ms: float, lam: np.ndarray, ar_cap_ms: float = INF) -> Relaxed | None:
        self.missed = []
        if self._worth_trying():
            self.tries += 1
            got = self.loose.run(cap_ms, lam, ar_cap_ms)
            if got is None:  # the looser relaxation has no plan under the caps: neither has the full one
                return None
            base = self.base
            if base.fits_layers(got) and (not base.exact_cap or base.fits_cap(got, cap_ms)):
                self.hits += 1
                return got
            self.missed.append(got)
        got = self.full.run(cap_ms, lam, ar_cap_ms)
        if isinstance(self.full, LazyDP):
            self.missed += self.full.missed
        return got

    def cut(self, relaxed: Relaxed) -> Cut:
        return self.base.cut(relaxed)

    def restricted(self, allowed: np.ndarray) -> LazyDP:
        """Both DPs restricted alike (``SequenceDP.restricted``)."""
        return LazyDP(self.full.restricted(allowed), self.loose.restricted(allowed), always=self.always)

    def block_floor_ms(self) -> float:
        return self.base.block_floor_ms()

    def max_allreduce_ms(self) -> float:
        return self.base.max_allreduce_ms()


def layered_dp(problem: Problem) -> SequenceDP | LazyDP:
    """The sequence DP for ``problem``, behind the DP on fewer memory layers when that has fewer."""
    full = SequenceDP(problem)
    if full.J <= COARSE_LAYERS:
        return full
    return LazyDP(full, full.with_layers(COARSE_LAYERS))

