"""The exact homogeneous DP: equal to enumeration, equal to the solver on homogeneous chains."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cost_models.training import TrainingConfig
from planner.solver import api
from planner.solver.count_search import search_count
from planner.solver.cpsat.model import solve_cpsat
from planner.solver.objective import Placement, evaluate, price_program, violations
from planner.solver.policy import VerificationPolicy
from planner.solver.search.baselines import baseline_placement, single_stage_placements
from planner.solver.search.chain_dp import Group, homogeneous_dp, partition_sequence
from planner.solver.solution import StagePlacement
from tests.unit.bruteforce import brute_force
from tests.unit.solver_fixtures import homogeneous_cluster, random_chain

torch.set_num_threads(1)


def homogeneous(seed: int, blocks: int, devices: int, *, uniform: bool = False):
    rng = np.random.default_rng(seed)
    cluster = homogeneous_cluster(devices)
    params = float(rng.uniform(0.5, 3.0)) * cluster.devices[0].spec.mem_bytes / 16
    chain = random_chain(rng, blocks, param_scale=params / blocks, out_scale=float(rng.choice([2e6, 2e8])),
                         uniform=uniform)
    config = TrainingConfig(global_batch=int(rng.choice([2, 4, 8])), microbatch_size=1,
                            schedule=str(rng.choice(["1f1b", "gpipe"])))
    problem, _, _ = api.problem_for(chain, cluster, config, VerificationPolicy(), 1, max_replicas=1)
    return chain, cluster, config, problem


def _dp_step(problem, part) -> float:
    cls = next(c.index for c in problem.classes if c.stage_capable)
    ids = problem.classes[cls].device_ids
    M = problem.num_microbatches
    stages = tuple(StagePlacement(index=k, first_block=s, last_block=e, devices=(ids[k],), microbatches=(M,))
                   for k, (s, e) in enumerate(part.ranges))
    return evaluate(problem, Placement(stages=stages, verifiers=(), num_microbatches=M)).step_ms


@pytest.mark.parametrize("seed", range(10))
def test_dp_equals_enumeration_without_replicas(seed):
    chain, cluster, config, problem = homogeneous(seed, blocks=7, devices=4)
    best, _ = brute_force(problem)
    part = homogeneous_dp(problem, 0, 4)
    if part is None:
        assert best == float("inf")
        return
    assert part.step_ms == pytest.approx(best, rel=1e-9)
    assert _dp_step(problem, part) == pytest.approx(best, rel=1e-9)  # the DP's own figures are the objective's


@pytest.mark.parametrize("seed,blocks,devices", [(0, 24, 6), (1, 16, 4), (2, 20, 8)])
def test_cpsat_equals_dp_on_homogeneous_chains(seed, blocks, devices):
    """The CP-SAT model alone (no DP shortcut), one replica per stage, against the exact DP."""
    chain, cluster, config, problem = homogeneous(seed, blocks, devices, uniform=seed == 0)
    part = homogeneous_dp(problem, 0, devices)
    res = solve_cpsat(problem, time_limit_s=20, workers=2)
    assert part is not None and res.status == "OPTIMAL"
    one_stage = [evaluate(problem, p).step_ms for p in single_stage_placements(problem)
                 if not violations(problem, p)]
    got = min([evaluate(problem, res.placement).step_ms] + one_stage)
    assert got == pytest.approx(part.step_ms, rel=1e-4)
    assert got >= part.step_ms * (1 - 1e-9)
    assert res.bound_ms <= part.step_ms * (1 + 1e-9)


def test_solver_uses_the_exact_dp_when_it_covers_the_space():
    chain, cluster, config, problem = homogeneous(3, 200, 8, uniform=True)
    found = search_count(problem, 10, 1, "test", None, api.GAP_TOLERANCE, [])
    part = homogeneous_dp(problem, 0, 8)
    assert found.method == "dp-exact" and found.bound_ms == found.step_ms
    assert found.step_ms == pytest.approx(part.step_ms, rel=1e-12)
    sol = api.solve(chain, cluster, config, VerificationPolicy(), time_limit_s=10, workers=1, max_replicas=1)
    assert sol.predicted_step_ms <= price_program(problem, found.placement).step_ms * (1 + 1e-12)


def test_dp_baseline_is_exact_on_a_homogeneous_cluster():
    chain, cluster, config, problem = homogeneous(6, blocks=7, devices=3)
    best, _ = brute_force(problem)
    placement = baseline_placement("dp", problem)
    assert evaluate(problem, placement).step_ms == pytest.approx(best, rel=1e-9)


def test_partition_sequence_balances_identical_blocks():
    chain, cluster, config, problem = homogeneous(5, blocks=12, devices=4, uniform=True)
    ranges = partition_sequence(problem, tuple(Group(cls=0) for _ in range(3)))
    if ranges is not None:  # may not fit in memory on three devices
        assert [e - s + 1 for s, e in ranges] == [4, 4, 4]
