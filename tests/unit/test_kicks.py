"""Kicks from the best plan's climb (``search.kicks``): seeded, never dearer than the plan kicked, always valid and
priced as returned; on random wide-area pools they find cheaper programs than the climb alone where the climb
stopped at a plan no single move improves."""
from __future__ import annotations

import numpy as np
import pytest

from cost_models.training import TrainingConfig
from planner.solver.objective import price_program, violations
from planner.solver.problem_build import build_problem, scale_chain
from planner.solver.search.kicks import kicked
from planner.solver.search.polish import polish
from tests.unit.program_fixtures import POLICY, random_placement, wide_area_cluster
from tests.unit.solver_fixtures import random_chain


def _case(seed: int):
    rng = np.random.default_rng(seed)
    cluster = wide_area_cluster(rng, int(rng.integers(4, 9)))
    chain = random_chain(rng, int(rng.integers(6, 13)))
    config = TrainingConfig(global_batch=int(rng.choice([8, 16])), microbatch_size=1)
    problem = build_problem(scale_chain(chain, 1), cluster, config, POLICY)
    for _ in range(20):
        if (placement := random_placement(rng, problem, cluster)) is not None:
            return problem, placement
    return problem, None


def test_kicks_are_seeded_never_dearer_valid_and_priced_as_returned():
    improved = 0
    for seed in range(12):
        problem, start = _case(seed)
        if start is None:
            continue
        climbed, climbed_ms = polish(problem, start, time_budget_s=2.0)
        runs = [kicked(problem, climbed, climbed_ms, time_budget_s=2.0, seed=seed) for _ in range(2)]
        (plan, ms), again = runs
        assert again[0] == plan and again[1] == ms, seed  # the same seed kicks the same way
        assert ms <= climbed_ms and not violations(problem, plan), seed
        assert price_program(problem, plan).step_ms == pytest.approx(ms, rel=1e-12), seed
        improved += ms < climbed_ms * (1 - 1e-6)
    assert improved >= 2, improved  # the climb's local optima are not the end on these pools


def test_a_fixed_shape_keeps_its_stages_devices():
    problem, start = next((p, s) for p, s in map(_case, range(40)) if s is not None and s.num_stages >= 3)
    climbed, ms = polish(problem, start, time_budget_s=1.0, cuts_only=True)
    plan, _ = kicked(problem, climbed, ms, time_budget_s=1.0, cuts_only=True)
    assert [st.devices for st in plan.stages] == [st.devices for st in climbed.stages]
