"""The fixed-sequence partition DPs (``seqpart_kernel``) against enumeration of every partition."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from planner.solver.search.seq_partition import min_step
from planner.solver.search.seq_partition_kernel import min_bottleneck, min_sum


def _random_tables(rng: np.random.Generator, S: int, L: int) -> tuple:
    """Kernel arguments for ``S`` stages over ``L`` blocks: tight memory, some stages replicated."""
    cp = np.stack([np.concatenate([[0.0], np.cumsum(rng.uniform(1, 10, L))]) for _ in range(S)])
    mp = np.stack([np.concatenate([[0.0], np.cumsum(rng.uniform(1, 4, L))]) for _ in range(S)])
    params = np.where(rng.random(L) < 0.3, 0.0, rng.uniform(1, 5, L))  # some blocks hold no parameters
    replicated = rng.random(S) < 0.5
    return (rng.choice([0.25, 0.5, 1.0], S), cp, rng.uniform(0, 5, (S, L)), rng.uniform(0, 5, (S, L)), mp,
            rng.uniform(0, 2, L), rng.uniform(0, 2, (S, L)), rng.uniform(6, 3 * L, S),
            np.where(replicated, rng.uniform(0, 3, S), 0.0), np.where(replicated, rng.uniform(0.5, 4, S), 0.0),
            np.concatenate([[0.0], np.cumsum(params)]))


def _stages(args: tuple, ranges) -> list[tuple[float, bool, float]]:
    """(tau, fits in memory, all-reduce ms) of each stage of a partition, straight from the definitions."""
    H, CP, FWD, BWD, MP, INB, OUTB, CAP, AR0, AR1, PP = args
    out = []
    for k, (s, e) in enumerate(ranges):
        tau = H[k] * (CP[k, e + 1] - CP[k, s] + FWD[k, e] + BWD[k, s])
        fits = MP[k, e + 1] - MP[k, s] + INB[s] + OUTB[k, e] <= CAP[k]
        params = PP[e + 1] - PP[s]
        out.append((tau, fits, AR0[k] + AR1[k] * params if params > 0 and (AR0[k] or AR1[k]) else 0.0))
    return out


def _partitions(S: int, L: int):
    for cuts in itertools.combinations(range(1, L), S - 1):
        bounds = (0, *cuts, L)
        yield tuple((bounds[k], bounds[k + 1] - 1) for k in range(S))


@pytest.mark.parametrize("seed", range(40))
def test_kernels_equal_enumeration(seed):
    rng = np.random.default_rng(seed)
    S, L = int(rng.integers(1, 5)), int(rng.integers(4, 9))
    if S > L:
        S = L
    args = _random_tables(rng, S, L)
    ar_cap = float(rng.choice([math.inf, rng.uniform(2, 15)]))
    parts = [(p, _stages(args, p)) for p in _partitions(S, L)]
    ok = [(p, st) for p, st in parts if all(f and a <= ar_cap for _, f, a in st)]
    want_peak = min((max(t for t, _, _ in st) for _, st in ok), default=math.inf)
    assert min_bottleneck(*args, ar_cap) == pytest.approx(want_peak)
    if not ok:
        return
    t_cap = want_peak * float(rng.uniform(1.0, 1.5))
    sums = [sum(t for t, _, _ in st) for _, st in ok if max(t for t, _, _ in st) <= t_cap]
    choice = np.zeros((S, L), np.int64)
    assert min_sum(*args, t_cap, ar_cap, choice) == pytest.approx(min(sums))


def test_partition_moves_parameters_off_a_stage_with_a_slow_all_reduce():
    """Two equal-speed stages, the second replicated over a slow ring: balancing compute alone splits the
    chain in half; counting the all-reduce gives the second stage as few parameters as fit."""
    L, M = 8, 8
    cp = np.tile(np.arange(L + 1, dtype=float) * 10.0, (2, 1))
    args = (np.array([1.0, 0.5]), cp, np.zeros((2, L)), np.zeros((2, L)), np.zeros((2, L + 1)), np.zeros(L),
            np.zeros((2, L)), np.full(2, 1.0), np.array([0.0, 5.0]), np.array([0.0, 100.0]),
            np.arange(L + 1, dtype=float))
    step, ranges, ar = min_step(args, M)
    want = min((sum(t for t, _, _ in st) + (M - 1) * max(t for t, _, _ in st) + max(a for _, _, a in st), p)
               for p in _partitions(2, L) for st in [_stages(args, p)])
    assert step == pytest.approx(want[0])
    assert ranges == want[1] == ((0, 6), (7, 7))
    assert ar == pytest.approx(105.0)
