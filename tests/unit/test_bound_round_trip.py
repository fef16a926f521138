"""The fill bound's round-trip term (``bound.fill._per``: a replica's last backward ends no sooner than ``m f +
D + b`` nor ``f + D + m b`` after its first input, ``D`` the round trip after its stage) stays below every
enumerated plan of random small wide-area pools and lifts the bound there; without a round trip (one stage, or
``D = 0``) it changes nothing."""
from __future__ import annotations

import numpy as np
import pytest

from cost_models.training import TrainingConfig
from planner.solver.bound import fill, fill_rows
from planner.solver.bound.fill import fill_bound_ms
from planner.solver.policy import VerificationPolicy
from planner.solver.problem import recompute_problem
from planner.solver.problem_build import build_problem, scale_chain
from tests.unit.program_fixtures import wide_area_cluster
from tests.unit.solver_fixtures import random_chain
from tests.unit.test_bound_fill_route import _pool, _prices

HAIR = 1 + 1e-9


def _wide(rng: np.random.Generator):
    """3-5 devices of a random wide-area pool, a random chain of 3-6 blocks, 2-8 microbatches, no verification
    (or trusted ends and verifiers), 1F1B or GPipe."""
    cluster = wide_area_cluster(rng, int(rng.integers(3, 6)))
    chain = random_chain(rng, int(rng.integers(3, 7)), param_scale=float(rng.choice([2e7, 1e8])),
                         act_scale=float(rng.choice([5e7, 2e8])), out_scale=float(rng.choice([1e6, 1e7])))
    config = TrainingConfig(global_batch=int(rng.choice([2, 4, 8])), microbatch_size=1,
                            schedule="gpipe" if rng.random() < 0.3 else "1f1b")
    return build_problem(scale_chain(chain, 1), cluster, config, VerificationPolicy(enabled=False)), cluster


def _without(problem, monkeypatch) -> float:
    with monkeypatch.context() as m:
        m.setattr(fill_rows, "ROUND_TRIP", False)
        return fill_bound_ms(problem)


def test_below_every_enumerated_plan_of_wide_area_pools_and_lifts_the_bound(monkeypatch):
    checked = lifted = 0
    for seed in range(14):
        problem, cluster = _wide(np.random.default_rng(8100 + seed))
        for p in (problem, recompute_problem(problem)) if seed % 4 == 0 else (problem,):
            prices = _prices(p, cluster, max_stages=4)
            if not prices:
                continue
            bound, before = fill_bound_ms(p), _without(p, monkeypatch)
            # the terms only add (up to the bisection's width: each test stops within REL_TOL)
            assert before * (1 - 2 * fill.REL_TOL) <= bound <= min(prices) * HAIR, (seed, before, bound, min(prices))
            checked += 1
            lifted += bound > before * (1 + 1e-6)
    assert checked >= 10 and lifted >= 3, (checked, lifted)


@pytest.mark.parametrize("kind", ["swarm2", "hosts"])
def test_below_every_enumerated_plan_of_swarms_and_one_gpu_hosts(kind, monkeypatch):
    checked = 0
    for seed in range(8):
        problem, cluster = _pool(np.random.default_rng(8300 + seed + (50 if kind == "hosts" else 0)), kind)
        prices = _prices(problem, cluster)
        if not prices:
            continue
        bound = fill_bound_ms(problem)
        assert _without(problem, monkeypatch) * (1 - 2 * fill.REL_TOL) <= bound <= min(prices) * HAIR, seed
        checked += 1
    assert checked >= 5


def test_no_round_trip_no_change():
    """One device, so one stage and no round trip: each replica's count is what ``m t`` fits, as before."""
    rows = fill_rows._per(np.array([10.0, 10.0]), np.array([True, True]), np.array([True, True]),
                          np.array([95.0, 5.0]), 64, np.array([4.0, 4.0]), np.array([6.0, 6.0]), np.zeros(2))
    assert rows.tolist() == [9.0, 0.0]
    # a round trip of 50 ms: 9 forwards, the trip and a backward are 92 ms (fits 95); 1 forward, the trip and
    # then 9 backwards 108 (does not): 7 backwards (4 + 50 + 42 = 96 > 95 too) -> 6
    rows = fill_rows._per(np.array([10.0]), np.array([True]), np.array([True]), np.array([95.0]), 64,
                          np.array([4.0]), np.array([6.0]), np.array([50.0]))
    assert rows.tolist() == [6.0]
