"""The reported bound is a true lower bound: on random clusters (untrusted volunteers, a CPU verifier host, slow
links between regions) it is positive and no more than the returned plan's priced step, and its simulated step
within the price's contract with the simulator (``PRICE_TOLERANCE``): the bound is proven on the priced programs,
so a plan the simulator runs faster than priced (e.g. a boundary's replicas split over verifiers, seed 2: priced
1,417.8 ms, simulated 1,404.9, bound 1,413.1) may simulate under it."""
from __future__ import annotations

import numpy as np
import pytest

from planner.api import plan_chain
from planner.simulate import simulate
from tests.unit.solver_fixtures import random_chain, random_cluster

PRICE_TOLERANCE = 0.05   # priced vs simulated (the random-cluster property tests)


@pytest.mark.parametrize("seed", range(4))
def test_the_bound_is_below_the_plan_priced_and_simulated(seed):
    rng = np.random.default_rng(300 + seed)
    cluster = random_cluster(rng, int(rng.integers(3, 7)), verifier_host=bool(seed % 2))
    chain = random_chain(rng, int(rng.integers(6, 12)), param_scale=5e7, act_scale=5e7,
                         out_scale=float(rng.choice([1e6, 1e7])))
    plan = plan_chain(chain, cluster, spec="tests:chain", global_batch=16, time_limit_s=1, workers=1)
    bound = plan.report.bound_ms
    assert bound is not None and 0 < bound <= plan.report.objective_ms * (1 + 1e-9)
    assert bound <= simulate(plan).step_ms * (1 + PRICE_TOLERANCE)
