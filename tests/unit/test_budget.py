"""The time limit as a budget: past a deadline the baselines' enumerations return the best found so far (not
nothing, and not after the whole enumeration), and only baselines that can still win are compiled.

Deadlines run on injected clocks: nothing here waits or times anything.
"""
from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

from cost_models.training import TrainingConfig
from planner.api import plan_chain
from planner.rivals import RIVAL_MARGIN, compiled_rivals
from planner.solver import api as solver_api
from planner.solver import baseline_plans
from planner.solver.objective import evaluate, price_program, violations
from planner.solver.policy import VerificationPolicy
from planner.solver.problem_build import build_problem, scale_chain
from planner.solver.search import chain_dp
from planner.solver.search.budget import Work, evaluate_units, placement_units
from planner.solver.search.deadline import Deadline
from planner.solver.search.grid import PRICED, best_grid, cheapest, grids
from tests.unit.program_fixtures import POLICY, wide_area_cluster
from tests.unit.solver_fixtures import homogeneous_cluster, random_chain

PASSED = Deadline(0.0, clock=lambda: 1.0)


class TickingClock:
    """Each read is one second later than the last."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(3)
    cluster = wide_area_cluster(rng, 8)
    chain = random_chain(rng, 12, param_scale=2e7, act_scale=5e7, out_scale=1e6)
    config = TrainingConfig(global_batch=16, microbatch_size=1)
    return chain, cluster, config, build_problem(scale_chain(chain, 1), cluster, config, POLICY)


def test_a_deadline_on_an_injected_clock():
    t = [10.0]
    d = Deadline.after(5.0, clock=lambda: t[0])
    assert not d.passed() and d.left_s() == 5.0
    t[0] = 13.0
    assert not d.passed() and d.less(2.0).passed()
    t[0] = 15.0
    assert d.passed() and d.left_s() == 0.0
    assert not Deadline.never().passed()


def test_past_the_deadline_the_grids_stop_at_the_first_valid_one(case):
    problem = case[3]
    every = grids(problem)
    assert len(every) > 1
    assert grids(problem, deadline=PASSED) == every[:1]


def test_a_deadline_midway_keeps_the_grids_found_by_then(case):
    problem = case[3]
    every = grids(problem)
    clock = TickingClock()
    found = grids(problem, deadline=Deadline.after(3.0, clock=clock))
    assert 1 <= len(found) < len(every)
    assert found == every[:len(found)]  # the enumeration's order: the best found so far, not a sample


def test_the_ppdp_baseline_past_its_deadline_is_a_valid_grid(case):
    problem = case[3]
    quick, full = best_grid(problem, PASSED), best_grid(problem)
    assert quick == grids(problem)[0] and not violations(problem, quick)
    assert price_program(problem, full).step_ms <= price_program(problem, quick).step_ms


def test_the_ppdp_baseline_charges_its_ranking_and_pricing_and_keeps_its_pick(case):
    """``best_grid`` charges the closed-form ranking of every grid found and a pricing of each of the ``PRICED``
    likeliest (once free: past the rivals' work), and is not cut short by it: the same grid as unbudgeted."""
    problem = case[3]
    enumerated, picked = Work(1e6), Work(1e6)
    found = grids(problem, deadline=enumerated)
    chosen = best_grid(problem, picked)
    likely = sorted(found, key=lambda p: evaluate(problem, p).step_ms)[:PRICED]
    extra = sum(evaluate_units(p) for p in found) + sum(placement_units(p) for p in likely)
    assert picked.spent == pytest.approx(enumerated.spent + extra) and extra > 0
    assert chosen == best_grid(problem)
    spent_out = Work(0.0)  # a budget spent by the enumeration still prices the likeliest
    assert best_grid(problem, spent_out) == cheapest(problem, grids(problem, deadline=Work(0.0)))[0]


def _homogeneous_problem():
    rng = np.random.default_rng(11)
    cluster = homogeneous_cluster(8)
    chain = random_chain(rng, 40, param_scale=cluster.devices[0].spec.mem_bytes / 16 / 40, out_scale=2e8)
    config = TrainingConfig(global_batch=8, microbatch_size=1)
    return solver_api.problem_for(chain, cluster, config, VerificationPolicy(), 1, max_replicas=1)[0]


def test_the_dp_baseline_past_its_deadline_keeps_its_first_partition(monkeypatch):
    problem = _homogeneous_problem()
    calls = []
    real = chain_dp._best_sum
    monkeypatch.setattr(chain_dp, "_best_sum", lambda *a: calls.append(a[2]) or real(*a))
    exact = chain_dp.homogeneous_dp(problem, 0, 8)
    every = len(calls)
    calls.clear()
    quick = chain_dp.homogeneous_dp(problem, 0, 8, deadline=PASSED)
    assert every > 1 and len(calls) == 1  # the smallest bottleneck's sum, then nothing more
    assert quick is not None and quick.ranges[0][0] == 0 and quick.ranges[-1][1] == problem.num_blocks - 1
    assert all(b + 1 == a for (_, b), (a, _) in zip(quick.ranges, quick.ranges[1:]))
    assert quick.step_ms >= exact.step_ms and quick.bottleneck_ms <= exact.bottleneck_ms


def test_every_baseline_past_the_deadline_still_gives_its_plan(case):
    chain, cluster, config, problem = case
    names = baseline_plans.BASELINE_NAMES
    full = baseline_plans.baselines(names, chain, cluster, config, POLICY)
    quick = baseline_plans.baselines(names, chain, cluster, config, POLICY, deadline=PASSED)
    assert [s.report.method for s in quick] == [s.report.method for s in full] and quick
    for fast, slow in zip(quick, full):
        assert fast.predicted_step_ms >= slow.predicted_step_ms * (1 - 1e-12)
    ppdp = next(s for s in quick if s.report.method == "baseline:ppdp")
    assert ppdp.predicted_step_ms == pytest.approx(price_program(problem, grids(problem)[0]).step_ms)


def _plan(step_ms: float, name: str):
    return SimpleNamespace(predicted=SimpleNamespace(step_ms=step_ms), name=name)


def test_only_baselines_that_can_still_win_are_compiled_cheapest_first():
    solver_plan = _plan(100.0, "solver")
    found = [SimpleNamespace(predicted_step_ms=ms, name=n) for n, ms in
             (("far", 200.0), ("close", RIVAL_MARGIN * 85.0 - 1.0), ("best", 90.0), ("edge", RIVAL_MARGIN * 85.0 + 1.0))]
    simulated = {"best": 85.0, "close": 112.0, "edge": 80.0, "far": 190.0}
    compiled = []

    def compile_one(sol):
        compiled.append(sol.name)
        return _plan(simulated[sol.name], sol.name)

    got = compiled_rivals(solver_plan, found, compile_one)
    # cheapest first; "edge" is priced past the margin of the fastest simulated so far (85 ms), "far" too
    assert compiled == ["close", "best"] and [p.name for p in got] == compiled


def test_a_spent_budget_still_gives_a_plan_chosen_by_simulation(case):
    chain, cluster = case[0], case[1]
    plan = plan_chain(chain, cluster, spec="test:chain", global_batch=16, policy=POLICY, time_limit_s=1.0,
                      started_s=time.perf_counter() - 100.0)
    assert plan.predicted.step_ms > 0
    assert any(n.startswith("chosen by simulation") for n in plan.report.notes)


def test_baselines_priced_past_what_can_win_are_left_out(case):
    chain, cluster, config, _ = case
    full = baseline_plans.baselines(baseline_plans.BASELINE_NAMES, chain, cluster, config, POLICY)
    cap = sorted(s.predicted_step_ms for s in full)[len(full) // 2]
    kept = baseline_plans.baselines(baseline_plans.BASELINE_NAMES, chain, cluster, config, POLICY, within_ms=cap)
    assert [s.report.method for s in kept] == [s.report.method for s in full if s.predicted_step_ms <= cap]
    assert 0 < len(kept) < len(full)


def test_a_count_charges_its_recomputation_mix_before_it(case, monkeypatch):
    """``solve_count`` charges ``recompute.mix`` of its plan (``mix_units``: a pricing, one more per stage where
    stages recompute) to the count's work and so to the solve's, before it runs."""
    from planner.solver import count_solve
    problem, parent, seen = case[3], Work(1e6), []
    real_mix = count_solve.recompute.mix

    def mix(problem, placement):
        seen.append(parent.spent)
        return real_mix(problem, placement)

    monkeypatch.setattr(count_solve, "mix_units", lambda problem, placement: 1e12)
    monkeypatch.setattr(count_solve.recompute, "mix", mix)
    count_solve.solve_count(problem, 0.3, 1, "M=16", None, 1e-4, within=parent)
    assert seen and seen[0] >= 1e12
    placement = best_grid(problem)
    monkeypatch.undo()
    units = placement_units(placement)
    assert count_solve.mix_units(problem, placement) == units
    from planner.solver.problem import recompute_problem
    assert count_solve.mix_units(recompute_problem(problem), placement) == (placement.num_stages + 1) * units
