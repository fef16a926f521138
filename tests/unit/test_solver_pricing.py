"""Pricing the sequence DP's relaxed plans: the shared transfer tables, and the bound's plans, priced on its own
thread and (two workers) improved by the local search in its last share of work, repeatable."""
from __future__ import annotations

import math

import pytest

from cost_models import comm
from planner.solver import api
from planner.solver.bound.lagrange import lagrange_bound
from planner.solver.objective import evaluate, violations
from tests.unit.bruteforce import brute_force
from tests.unit.test_solver_bruteforce import instance


def test_boundary_transfer_tables_equal_the_per_message_prices():
    chain, cluster, config, policy = instance(3)
    problem, _, _ = api.problem_for(chain, cluster, config, policy, config.microbatch_size)
    links = {lk for row in problem.links for lk in row if lk is not None}
    assert links
    for lk in links:
        table = problem.boundary_transfer_ms(lk)
        assert table is problem.boundary_transfer_ms(lk) and not table.flags.writeable
        assert table.tolist() == [comm.transfer_ms(problem.boundary_bytes(e), lk)
                                  for e in range(problem.num_blocks - 1)]


@pytest.mark.parametrize("seed", range(6))
def test_bound_with_two_workers_never_exceeds_the_enumerated_optimum(seed):
    chain, cluster, config, policy = instance(seed)
    problem, _, _ = api.problem_for(chain, cluster, config, policy, config.microbatch_size)
    best, _ = brute_force(problem)
    if not math.isfinite(best):
        return
    res = lagrange_bound(problem, incumbent_ms=best * 1.5, time_budget_s=0.5, workers=2)
    assert res.bound_ms <= best * (1 + 1e-9)
    assert res.placement is not None  # the priced plans reach the result
    ev = evaluate(problem, res.placement)
    assert not violations(problem, res.placement, ev) and ev.step_ms == pytest.approx(res.step_ms)
    assert best * (1 - 1e-9) <= res.step_ms < best * 1.5


def test_the_bound_and_its_plan_are_repeatable():
    chain, cluster, config, policy = instance(2)
    problem, _, _ = api.problem_for(chain, cluster, config, policy, config.microbatch_size)
    best, _ = brute_force(problem)
    runs = [lagrange_bound(problem, incumbent_ms=best * 1.5, time_budget_s=0.5, workers=2) for _ in range(2)]
    assert runs[0] == runs[1]
