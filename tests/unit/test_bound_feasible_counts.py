"""The reported bound is the least over the microbatch counts that can hold a plan: a count whose blocks the
fluid LP proves cannot fit the devices' memory (each block alone fits, so the precheck passes) bounds
nothing, instead of pulling the bound to 0 and the gap to 100%."""
from __future__ import annotations

import math

import numpy as np

from cost_models.training import TrainingConfig
from planner.solver.api import solve
from planner.solver.objective import simple_lower_bound_ms
from planner.solver.policy import VerificationPolicy
from planner.solver.problem_build import build_problem, scale_chain
from tests.unit.solver_fixtures import homogeneous_cluster, random_chain


def _case():
    # 8 blocks of ~8 GB of activations at 16 samples a microbatch on four 16 GB T4s: each fits alone, not all
    chain = random_chain(np.random.default_rng(0), 8, param_scale=2e7, act_scale=5e8, out_scale=1e6)
    return chain, homogeneous_cluster(4, gpu="T4", host_size=4), TrainingConfig(global_batch=16, microbatch_size=1)


def test_a_count_that_cannot_hold_the_model_has_an_infinite_fluid_bound():
    chain, cluster, config = _case()
    policy = VerificationPolicy(enabled=False)
    whole = build_problem(scale_chain(chain, 16), cluster, TrainingConfig(global_batch=16, microbatch_size=16), policy)
    assert simple_lower_bound_ms(whole) == math.inf
    assert 0 < simple_lower_bound_ms(build_problem(scale_chain(chain, 1), cluster, config, policy)) < math.inf


def test_the_reported_bound_ignores_counts_without_a_plan():
    chain, cluster, config = _case()
    sol = solve(chain, cluster, config, VerificationPolicy(enabled=False), time_limit_s=4, workers=1,
                microbatch_sizes=(1, 16), recompute_mode="never")
    assert sol.num_microbatches == 16
    assert 0 < sol.report.bound_ms <= sol.report.objective_ms
    assert sol.report.gap < 0.05
