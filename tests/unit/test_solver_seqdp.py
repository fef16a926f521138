"""The sequence DP's exact stage cap: no relaxed plan breaks the cap, no real plan is priced above its cost
at its own caps, and the loose-cap DP (and the lazy pair) relate to the exact one as they claim."""
from __future__ import annotations

import math

import numpy as np
import pytest

from planner.solver import api
from planner.solver.bound.lazy_dp import LazyDP
from planner.solver.bound.sequence_dp import Relaxed, SequenceDP
from tests.unit.bruteforce import brute_force
from tests.unit.test_solver_bruteforce import TWIST_SEEDS, instance

SEEDS = [(s, False) for s in range(28)] + [(s, True) for s in TWIST_SEEDS]


def _problem(seed: int, twists: bool):
    chain, cluster, config, policy = instance(seed, twists=twists)
    return api.problem_for(chain, cluster, config, policy, config.microbatch_size)[0]


def _as_relaxed(problem, dp: SequenceDP, placement) -> Relaxed:
    """A real plan as the DP's stage sequence: replicas mapped to the fewest with the same busiest share."""
    M = problem.num_microbatches
    stages, used = [], np.zeros(dp.C)
    for st in placement.stages:
        cls, r = problem.class_of(st.devices[0]), len(st.devices)
        r = min(x for x in problem.replica_choices(cls) if math.ceil(M / x) == math.ceil(M / r))
        stages.append((st.first_block, st.last_block, cls, r))
        used[dp.SC.index(cls)] += r
    return Relaxed(value_ms=0.0, stages=tuple(stages), used=used)


def optimum_cut(seed: int, twists: bool):
    """(problem, optimum ms, DP, the enumerated optimum as the DP's cut), or None where no plan exists."""
    problem = _problem(seed, twists)
    best, optimal = brute_force(problem)
    if optimal is None:
        return None
    dp = SequenceDP(problem)
    return problem, best, dp, dp.cut(_as_relaxed(problem, dp, optimal))


@pytest.mark.parametrize("seed,twists", SEEDS)
def test_the_dp_never_prices_a_real_plan_above_its_cost_at_its_own_caps(seed, twists):
    """Weak duality per plan: at the optimum's own (bottleneck, all-reduce) caps and any prices, the DP's value
    is at most that plan's stage times plus its priced device use. A DP that refused a stage the plan has
    (a cap or memory test too strict) would price the caps above it here."""
    found = optimum_cut(seed, twists)
    if found is None:
        return
    _, best, dp, cut = found
    rng = np.random.default_rng(seed)
    for lam in [np.zeros(dp.C)] + [rng.uniform(0.0, 2.0 * best / max(dp.count.sum(), 1), dp.C) for _ in range(4)]:
        got = dp.run(cut.peak_ms * (1 + 1e-12), lam, cut.ar_ms * (1 + 1e-12))
        assert got is not None
        assert got.value_ms <= cut.tau_ms + float(lam @ (cut.used - dp.count)) + 1e-9 * max(1.0, best)


def test_relaxed_plans_meet_the_cap_exactly_where_the_loose_test_does_not():
    """Every stage of the exact DP's plan is within the cap; the loose test (smallest send) lets stages over
    it into some of these DPs, and never prices a cap above the exact DP."""
    over = compared = 0
    for seed, twists in SEEDS:
        problem = _problem(seed, twists)
        if problem.num_blocks < 3:
            continue
        exact = SequenceDP(problem)
        loose = exact.with_loose_cap()
        free = exact.run(math.inf, np.zeros(exact.C))
        if free is None:
            continue
        top = exact.cut(free).peak_ms
        for f in (0.5, 0.7, 0.85, 1.0):
            a, b = exact.run(f * top, np.zeros(exact.C)), loose.run(f * top, np.zeros(exact.C))
            if b is None:
                assert a is None
                continue
            compared += 1
            if a is not None:
                assert exact.cut(a).peak_ms <= f * top * (1 + 1e-12)
                assert exact.fits_cap(a, f * top)
                assert b.value_ms <= a.value_ms + 1e-9 * max(1.0, abs(a.value_ms))
            over += exact.cut(b).peak_ms > f * top * (1 + 1e-9)
    assert compared >= 40
    assert over >= 3, "the loose test should have let a stage over its cap in (else this test shows nothing)"


def test_the_lazy_pair_gives_the_exact_dps_values():
    """The loose-cap try is taken only when its plan meets the exact caps, so the lazy DP's values are the
    exact DP's at every cap and price; on these instances both paths are taken."""
    hits = tries = compared = 0
    rng = np.random.default_rng(1)
    for seed, twists in SEEDS[:20]:
        problem = _problem(seed, twists)
        full = SequenceDP(problem)
        lazy = LazyDP(full, full.with_loose_cap())
        free = full.run(math.inf, np.zeros(full.C))
        if free is None:
            continue
        top = full.cut(free).peak_ms
        for _ in range(6):
            cap, lam = rng.uniform(0.4, 1.1) * top, rng.uniform(0.0, 50.0, size=full.C)
            want, got = full.run(cap, lam), lazy.run(cap, lam)
            assert (want is None) == (got is None)
            if want is not None:
                assert got.value_ms == pytest.approx(want.value_ms, rel=1e-9, abs=1e-9)
                compared += 1
        hits, tries = hits + lazy.hits, tries + lazy.tries
    assert compared >= 40
    assert 0 < hits < tries, (hits, tries)
