"""Cuts-only hill-climbing (``polish(cuts_only=True)``: fixed shapes, the grids a free search meets) sweeps its
moves: a move that improves the plan is kept before the next is tried, so improvements at independent cuts add up
in one pass of the moves, where the best move of each pass took a pass each (DT-FM spot's 8 x 8 grid: its two
improving moves at 26 pricings a pass, past the 1.5 s a free plan's shaped solve had). Each pass ends where no move
improves the plan: given the time, a local optimum of the moves.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cost_models.training import TrainingConfig
from planner.solver.objective import Placement, even_split, price_program, violations
from planner.solver.policy import VerificationPolicy
from planner.solver.problem_build import build_problem, scale_chain
from planner.solver.search.budget import UNITS_PER_S, program_units
from planner.solver.search.grid import grids
from planner.solver.search.polish import _cut_keys, _cut_move, polish
from planner.solver.solution import StagePlacement
from tests.unit.solver_fixtures import homogeneous_cluster, random_chain, random_cluster

OFF = VerificationPolicy(enabled=False)


def _split(problem, sizes: list[int]) -> Placement:
    """One device a stage, stage ``k`` over ``sizes[k]`` blocks."""
    M, devices, first, stages = problem.num_microbatches, problem.device_ids, 0, []
    for k, n in enumerate(sizes):
        stages.append(StagePlacement(index=k, first_block=first, last_block=first + n - 1, devices=(devices[k],),
                                     microbatches=even_split(M, 1)))
        first += n
    return Placement(stages=tuple(stages), verifiers=(), num_microbatches=M)


def test_one_pass_of_the_moves_makes_several():
    chain = random_chain(np.random.default_rng(0), 12, uniform=True)
    problem = build_problem(scale_chain(chain, 1), homogeneous_cluster(4),
                            TrainingConfig(global_batch=8, microbatch_size=1), OFF)
    start = _split(problem, [4, 2, 4, 2])
    start_ms = price_program(problem, start).step_ms
    one_pass = (1 + len(_cut_keys(4))) * program_units(problem.num_microbatches, 4) / UNITS_PER_S
    plan, ms = polish(problem, start, time_budget_s=one_pass, cuts_only=True)
    # [4, 2, 4, 2] -> [3, 3, 4, 2] -> [3, 4, 3, 2] -> [3, 4, 2, 3] -> [2, 4, 3, 3]: each kept as it improved; the
    # best move of the pass (cut 2 down: [4, 2, 3, 3]) would have been the pass's only one
    cuts = [st.last_block for st in plan.stages[:-1]]
    assert sum(a != b for a, b in zip(cuts, [st.last_block for st in start.stages[:-1]])) >= 2
    assert ms < start_ms and ms == pytest.approx(price_program(problem, plan).step_ms)
    # given the time, it climbs on to the even split
    plan, ms = polish(problem, start, time_budget_s=60.0, cuts_only=True)
    assert [st.last_block - st.first_block + 1 for st in plan.stages] == [3, 3, 3, 3]


@pytest.mark.parametrize("seed", range(8))
def test_cuts_only_climbs_to_a_local_optimum_of_its_moves(seed):
    rng = np.random.default_rng(400 + seed)
    chain = random_chain(rng, int(rng.integers(6, 14)))
    cluster = random_cluster(rng, int(rng.integers(4, 9)), untrusted=False)
    problem = build_problem(scale_chain(chain, 1), cluster, TrainingConfig(global_batch=16, microbatch_size=1), OFF)
    start = next((p for p in grids(problem) if p.num_stages >= 2), None)
    if start is None:
        pytest.skip("no grid of two stages or more fits this draw")
    start_ms = price_program(problem, start).step_ms
    plan, ms = polish(problem, start, time_budget_s=60.0, cuts_only=True)
    assert ms <= start_ms and ms == pytest.approx(price_program(problem, plan).step_ms)
    assert not violations(problem, plan)
    # its stages keep their devices and microbatches; the blocks stay in order, each in one stage
    assert [dataclasses.replace(st, first_block=0, last_block=0) for st in plan.stages] == \
        [dataclasses.replace(st, first_block=0, last_block=0) for st in start.stages]
    assert plan.stages[0].first_block == 0 and plan.stages[-1].last_block == problem.num_blocks - 1
    assert all(a.last_block + 1 == b.first_block for a, b in zip(plan.stages, plan.stages[1:]))
    for key in _cut_keys(plan.num_stages):  # no move improves it
        moved = _cut_move(plan, key)
        if moved is not None and not violations(problem, moved):
            assert price_program(problem, moved).step_ms >= ms * (1 - 1e-9), key
