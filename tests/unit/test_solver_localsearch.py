"""The local search over stage sequences: its neighbours respect the cluster, its plans are valid and
never worse than where it started, and it finds the move that puts idle devices to work."""
from __future__ import annotations

import math

import numpy as np

from planner.solver import api, count_search
from planner.solver.objective import evaluate, violations
from planner.solver.search import local
from planner.solver.search.chain_dp import Group
from planner.solver.search.local import groups_of, improve, neighbours
from planner.solver.search.seq_partition import (
    copy_table,
    partition_min_step,
    screen_step,
    sequence_placement,
)
from tests.unit.bruteforce import brute_force
from tests.unit.test_solver_bruteforce import instance


def _problem(seed: int):
    chain, cluster, config, policy = instance(seed)
    return api.problem_for(chain, cluster, config, policy, config.microbatch_size)[0]


def test_neighbours_respect_device_counts_and_trusted_endpoints():
    checked = 0
    for seed in range(28):
        problem = _problem(seed)
        _, optimal = brute_force(problem)
        if optimal is None:
            continue
        pol = problem.policy
        for cand in neighbours(problem, groups_of(problem, optimal)):
            used: dict[int, int] = {}
            for g in cand:
                used[g.cls] = used.get(g.cls, 0) + g.replicas
                assert problem.classes[g.cls].stage_capable
                assert g.replicas in problem.replica_choices(g.cls)
            assert all(n <= problem.classes[c].count for c, n in used.items())
            assert 1 <= len(cand) <= problem.num_blocks
            if pol.enabled and pol.trusted_endpoints:
                assert problem.classes[cand[0].cls].trusted and problem.classes[cand[-1].cls].trusted
            checked += 1
    assert checked >= 50


def test_improved_plans_are_valid_better_and_never_below_the_optimum():
    """From a worse plan (the optimum's groups partitioned for the bottleneck alone, or one stage fewer), the
    search returns valid plans priced as it says, below the start and at or above the enumerated optimum."""
    improved = 0
    for seed in range(28):
        problem = _problem(seed)
        best, optimal = brute_force(problem)
        if optimal is None or optimal.num_stages < 2:
            continue
        groups = groups_of(problem, optimal)
        starts = [sequence_placement(problem, groups), sequence_placement(problem, groups[1:])]
        for start in [s for s in starts if s is not None]:
            got = improve(problem, start[0], start[1], time_budget_s=30.0)
            if got is None:
                continue
            plan, step = got
            ev = evaluate(problem, plan)
            assert not violations(problem, plan, ev)
            assert math.isclose(ev.step_ms, step, rel_tol=1e-9)
            assert step < start[1]
            assert step >= best * (1 - 1e-9)
            improved += 1
    assert improved >= 3


def test_screen_matches_the_exact_partition_without_all_reduce_caps():
    """The screen (no all-reduce caps, two bottleneck caps) finds a partition whenever the exact one does, and
    on most of these instances the same iteration time."""
    same = compared = 0
    for seed in range(28):
        problem = _problem(seed)
        _, optimal = brute_force(problem)
        if optimal is None:
            continue
        groups = groups_of(problem, optimal)
        exact = partition_min_step(problem, groups)
        screen = screen_step(problem, groups, copy_table(problem))
        if exact is None:
            assert math.isinf(screen)
            continue
        got = sequence_placement(problem, groups, exact=True)
        assert got is not None and math.isfinite(screen)
        compared += 1
        same += math.isclose(screen, got[1], rel_tol=1e-6)
    assert compared >= 15 and same >= compared // 2, (same, compared)


def test_idle_devices_are_put_to_work(monkeypatch):
    """A pipeline that leaves a class's devices idle on a compute-bound chain: one move (more replicas, or a
    stage inserted on them) makes it faster."""
    from tests.unit.test_solver_lagrange import _deep_problem

    monkeypatch.setattr(local, "KICK_LIMIT", 0)  # the first local optimum is enough here

    problem = _deep_problem(act_factor=0.1)
    stage = [c for c in problem.classes if c.stage_capable]
    trusted = [c for c in stage if c.trusted]
    groups = (Group(cls=trusted[0].index), Group(cls=trusted[-1].index))
    start = sequence_placement(problem, groups, exact=True)
    assert start is not None
    got = improve(problem, start[0], start[1], time_budget_s=30.0)
    assert got is not None and got[1] < 0.9 * start[1]
    assert not violations(problem, got[0])


def test_a_coarsened_problem_keeps_the_chains_totals_and_the_cuts_between_merged_blocks():
    from planner.solver.search.local import coarsened
    from tests.unit.test_solver_lagrange import _deep_problem

    problem = _deep_problem()
    coarse = coarsened(problem, 3)
    assert coarse.num_blocks == math.ceil(problem.num_blocks / 3)
    assert np.allclose(coarse.time_ms.sum(axis=0), problem.time_ms.sum(axis=0))
    assert coarse.param_count.sum() == problem.param_count.sum()
    assert coarse.act_bytes.sum() == problem.act_bytes.sum()
    assert coarse.out_bytes[0] == problem.out_bytes[2] and coarse.out_bytes[-1] == problem.out_bytes[-1]


def test_the_search_on_a_long_chain_screens_on_merged_blocks_and_returns_a_plan_of_the_chain(monkeypatch):
    """With the screen on merged blocks (forced on a short chain), moves are still priced on the chain itself."""
    from tests.unit.test_solver_lagrange import _deep_problem

    monkeypatch.setattr(local, "SCREEN_BLOCKS", 10)
    monkeypatch.setattr(local, "KICK_LIMIT", 0)
    problem = _deep_problem(act_factor=0.1)
    trusted = [c for c in problem.classes if c.stage_capable and c.trusted]
    start = sequence_placement(problem, (Group(cls=trusted[0].index), Group(cls=trusted[-1].index)), exact=True)
    got = improve(problem, start[0], start[1], time_budget_s=30.0)
    assert got is not None and got[1] < start[1]
    ev = evaluate(problem, got[0])
    assert not violations(problem, got[0], ev) and math.isclose(ev.step_ms, got[1], rel_tol=1e-9)
    assert got[0].stages[-1].last_block == problem.num_blocks - 1


def test_where_cpsat_cannot_help_the_local_search_takes_its_time_and_the_plan_is_checked(monkeypatch):
    from benchmarks.solver import _config
    from planner.check import check_solution
    from planner.solver.policy import VerificationPolicy
    from tests.unit.solver_fixtures import random_chain, tiered_cluster

    monkeypatch.setattr(count_search, "CPSAT_HOPELESS", 0)
    rng = np.random.default_rng(5)
    cluster = tiered_cluster(16)
    mem = max(d.spec.mem_bytes for d in cluster.stage_devices)
    chain = random_chain(rng, 40, param_scale=1.5 * mem / 16 / 40, act_scale=2e8 * 48 / 40,
                         flop_scale=5e11 * 48 / 40, out_scale=2e7)
    config, policy = _config(), VerificationPolicy()
    sol = api.solve(chain, cluster, config, policy, time_limit_s=4.0, workers=2)
    assert any("model too large to improve the plan" in note for note in sol.report.notes), sol.report.notes
    assert sol.report.bound_ms <= sol.predicted_step_ms
    assert check_solution(sol, chain, cluster, config, policy).ok
