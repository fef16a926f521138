"""The gap tolerance ends a solve once its plan is proven close enough; plans the pricing cap skipped
are not lost."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest

from cost_models.training import TrainingConfig
from planner.errors import InvalidInputError
from planner.solver import api
from planner.solver.bound.lagrange import lagrange_bound
from planner.solver.objective import evaluate, violations
from planner.solver.policy import VerificationPolicy
from planner.solver.search import relaxed_plans
from tests.unit.bruteforce import brute_force
from tests.unit.solver_fixtures import homogeneous_cluster, random_chain
from tests.unit.test_solver_bruteforce import instance


def _config() -> TrainingConfig:
    return TrainingConfig(global_batch=32, microbatch_size=1)


def _replicated_homogeneous():
    rng = np.random.default_rng(3)
    chain = random_chain(rng, 120, param_scale=1e8, act_scale=2e7, flop_scale=2.4e10, out_scale=2e7, uniform=True)
    return chain, homogeneous_cluster(8, host_size=8)


def test_a_loose_tolerance_reports_optimal_within_it_and_skips_cpsat():
    chain, cluster = _replicated_homogeneous()
    sol = api.solve(chain, cluster, _config(), VerificationPolicy(), time_limit_s=20.0, gap_tolerance=0.05)
    # the search stops once its closed form is within the tolerance of its bound ...
    assert any("within the gap tolerance" in note for note in sol.report.notes), sol.report.notes
    # ... and the plan is OPTIMAL only if its programs' cost is within it of that cost's bound
    assert (sol.report.status == "OPTIMAL") == (sol.report.gap <= 0.05)


@pytest.mark.parametrize("bad", [-0.1, 1.0, math.nan])
def test_bad_tolerance_is_refused(bad):
    chain, cluster = _replicated_homogeneous()
    with pytest.raises(InvalidInputError, match="gap tolerance"):
        api.solve(chain, cluster, _config(), VerificationPolicy(), time_limit_s=1.0, gap_tolerance=bad)


def test_plans_skipped_by_the_pricing_cap_are_priced_before_returning(monkeypatch):
    """With the cap at nothing, every relaxed plan is skipped while the bound runs; the last ones are
    still priced, so the bound comes with a valid plan (without them: none)."""
    monkeypatch.setattr(relaxed_plans, "PLAN_SHARE", -1e9)
    priced = 0
    for seed in range(12):
        chain, cluster, config, policy = instance(seed)
        problem, _, _ = api.problem_for(chain, cluster, config, policy, config.microbatch_size)
        best, _ = brute_force(problem)
        if not math.isfinite(best):
            continue
        res = lagrange_bound(problem, incumbent_ms=best * 1.5, time_budget_s=60.0, max_dps=60)
        if res.placement is not None:
            priced += 1
            assert not violations(problem, res.placement, evaluate(problem, res.placement))
            assert res.step_ms >= best * (1 - 1e-9)
    assert priced >= 6


def test_each_counts_note_shows_its_raised_bound_and_the_least_is_the_reported_bound():
    """The per-count notes show each count's bound as raised after the search (``bound.counts``), so their least
    is the bound the report states (before: a count's own bound, below the headline where the raise lifted it)."""
    chain, cluster = _replicated_homogeneous()
    # three counts, the least's own bound 3,544.6 ms raised to 4,025.8 after the search
    sol = api.solve(chain, cluster, _config(), VerificationPolicy(), time_limit_s=4.0, microbatch_sizes=[1, 2, 4])
    bounds = [float(m.group(1)) for note in sol.report.notes if (m := re.match(r"M=\d+.*?, bound ([\d.]+) ms", note))]
    assert len(bounds) == 3, sol.report.notes
    assert min(bounds) == pytest.approx(sol.report.bound_ms, abs=1e-3)
