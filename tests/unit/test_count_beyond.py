"""Counts no plan of which can beat a plan already found are not searched (``count_solve.beyond``): their bounds,
the fluid LP then the fill bound tested at the incumbent's cost, hold for every plan of the count, and for its
recomputing twin's mixes where asked; their share of the work goes to the bounds after the search."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest

from cost_models.training import TrainingConfig
from planner.solver import api
from planner.solver.count_solve import beyond
from planner.solver.policy import VerificationPolicy
from planner.solver.problem import recompute_problem
from planner.solver.problem_build import build_problem, scale_chain
from planner.solver.search.budget import Work
from tests.unit.bruteforce import brute_force
from tests.unit.solver_fixtures import homogeneous_cluster, random_chain
from tests.unit.test_solver_bruteforce import instance


@pytest.mark.parametrize("seed", range(24))
def test_a_count_is_dismissed_only_where_no_plan_of_it_beats_the_incumbent(seed):
    chain, cluster, config, policy = instance(seed)
    problem = build_problem(scale_chain(chain, config.microbatch_size), cluster, config, policy)
    best, _ = brute_force(problem, program=True)
    twin_best, _ = brute_force(recompute_problem(problem), program=True)
    assert beyond(problem, math.inf, Work(10.0)) is None  # nothing found yet: every count is searched
    rng = np.random.default_rng(seed)
    finite = best if math.isfinite(best) else 1e4
    for incumbent in (0.5 * finite, finite, 1.5 * finite, float(rng.uniform(0.2, 2.0)) * finite):
        for mixes in (False, True):
            out = beyond(problem, incumbent, Work(10.0), mixes=mixes)
            if out is None:
                continue
            assert out.placement is None and out.valid_bound_ms >= incumbent * (1 - 1e-9)
            assert best >= incumbent * (1 - 1e-9), (seed, incumbent, out.bound_by)  # no plan of it was cheaper
            assert out.valid_bound_ms <= best * (1 + 1e-9), seed  # a valid bound
            if mixes:  # its recomputing twin's plans too
                assert twin_best >= incumbent * (1 - 1e-9), (seed, incumbent, out.bound_by)


def test_a_solve_does_not_search_the_counts_its_bounds_dismiss_and_plans_the_same_twice():
    rng = np.random.default_rng(3)
    chain = random_chain(rng, 40, param_scale=1e8, act_scale=2e7, flop_scale=2.4e10, out_scale=2e7, uniform=True)
    cluster = homogeneous_cluster(8, host_size=8)
    config = TrainingConfig(global_batch=32, microbatch_size=1)
    plans = [api.solve(chain, cluster, config, VerificationPolicy(), time_limit_s=3.0, microbatch_sizes=[1, 2, 4, 32])
             for _ in range(2)]
    notes = plans[0].report.notes
    skipped = [float(m.group(1)) for note in notes if (m := re.match(r"M=\d+: not searched, bound ([\d.]+) ms", note))]
    assert skipped, notes  # one sample a microbatch (M = 32) wins by far: M = 1 cannot
    assert all(b >= plans[0].report.objective_ms * (1 - 1e-6) for b in skipped), notes
    assert plans[0].stages == plans[1].stages and plans[0].report.bound_ms == plans[1].report.bound_ms
