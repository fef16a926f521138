"""Seeded property tests: on tiny instances the solver's objective equals exhaustive enumeration,
is never worse than a baseline, and every plan it returns passes the independent checker."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from cost_models.training import TrainingConfig
from planner.check import check_solution
from planner.errors import InfeasiblePlanError
from planner.solver import api
from planner.solver.baselines import BASELINES
from planner.solver.policy import VerificationPolicy
from tests.unit.bruteforce import brute_force
from tests.unit.solver_fixtures import random_chain, random_cluster

torch.set_num_threads(1)

REL_TOL = 1e-4  # CP-SAT works on costs floored at cpsat.COST_RESOLUTION of the chain's time


def instance(seed: int):
    """<= 6 blocks (8 with <= 3 devices), <= 4 devices, memory from roomy to tight, random policy."""
    rng = np.random.default_rng(seed)
    D = int(rng.integers(2, 5))
    L = int(rng.integers(2, 9 if D <= 3 else 7))
    cluster = random_cluster(rng, D, untrusted=bool(rng.random() < 0.8), verifier_host=bool(rng.random() < 0.5))
    biggest = max(d.spec.mem_bytes for d in cluster.stage_devices)
    params = float(rng.uniform(0.3, 1.6)) * biggest / 16
    chain = random_chain(rng, L, param_scale=params / L, act_scale=float(rng.choice([2e8, 1e9])),
                         out_scale=float(rng.choice([2e6, 2e7, 2e8])))
    config = TrainingConfig(global_batch=int(rng.choice([1, 2, 4, 8])), microbatch_size=1,
                            schedule=str(rng.choice(["1f1b", "gpipe"])))
    policy = VerificationPolicy(enabled=bool(rng.random() < 0.9), trusted_endpoints=bool(rng.random() < 0.6),
                                check_gradients=bool(rng.random() < 0.7),
                                verifier_placement=str(rng.choice(["any", "any", "stage", "cpu"])),
                                max_boundaries_per_verifier=[None, None, 1, 2][int(rng.integers(4))])
    return chain, cluster, config, policy


def _solve(chain, cluster, config, policy):
    try:
        return api.solve(chain, cluster, config, policy, time_limit_s=20, workers=1)
    except InfeasiblePlanError:
        return None


@pytest.mark.parametrize("seed", range(28))
def test_solver_matches_brute_force_and_checker(seed):
    chain, cluster, config, policy = instance(seed)
    problem, _, _ = api.problem_for(chain, cluster, config, policy, config.microbatch_size)
    best, _ = brute_force(problem)
    sol = _solve(chain, cluster, config, policy)
    if math.isinf(best):
        assert sol is None, "the solver found a plan the enumeration says cannot exist"
        return
    assert sol is not None, f"no plan, but enumeration found {best:.3f} ms"
    assert sol.predicted_step_ms >= best * (1 - 1e-9)
    assert sol.predicted_step_ms <= best * (1 + REL_TOL)
    assert sol.report.status == "OPTIMAL"
    assert sol.report.bound_ms <= best * (1 + 1e-9)
    report = check_solution(sol, chain, cluster, config, policy)
    assert report.ok, report.problems
    for name in BASELINES:
        try:
            b = api.baseline(name, chain, cluster, config, policy)
        except InfeasiblePlanError:
            continue
        assert sol.predicted_step_ms <= b.predicted_step_ms * (1 + REL_TOL), name


def test_instances_cover_pipelines_replicas_and_verifiers():
    """The seeds above exercise what they claim to: multi-stage plans, replication and remote verifiers."""
    stages, replicated, verified = 0, 0, 0
    for seed in range(28):
        chain, cluster, config, policy = instance(seed)
        problem, _, _ = api.problem_for(chain, cluster, config, policy, 1)
        best, placement = brute_force(problem)
        if placement is None:
            continue
        stages += placement.num_stages > 1
        replicated += any(len(s.devices) > 1 for s in placement.stages)
        verified += bool(placement.verifiers)
    assert stages >= 5 and replicated >= 3 and verified >= 3, (stages, replicated, verified)


def test_microbatch_choice_is_the_best_candidate():
    chain, cluster, config, policy = instance(3)
    config = dataclasses.replace(config, global_batch=8)
    sol = api.solve(chain, cluster, config, policy, time_limit_s=20, workers=1, microbatch_sizes=(1, 2, 4, 8))
    each = []
    for mb in (1, 2, 4, 8):
        problem, _, _ = api.problem_for(chain, cluster, config, policy, mb)
        each.append(brute_force(problem)[0])
    assert sol.predicted_step_ms <= min(each) * (1 + REL_TOL)
    assert sol.predicted_step_ms >= min(each) * (1 - 1e-9)
