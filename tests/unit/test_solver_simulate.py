"""The solver's closed-form iteration time against the simulator on the compiled plan.

On balanced stages with negligible transfers the closed form
``sum t_k + (M - 1) max t_k`` is what a 1F1B/GPipe timeline takes, so the two
agree closely; with slow links and verifiers the objective counts every
transfer as exposed while the simulator overlaps them, so it is an upper
estimate there. Peak memory per rank never exceeds the solver's figure.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from cost_models.memory import trace_dtype
from cost_models.training import TrainingConfig
from planner.compile import compile_plan
from planner.plan_values import ModelRef
from planner.simulate import predict, simulate
from planner.solver import api
from planner.solver.policy import VerificationPolicy
from tests.unit.solver_fixtures import homogeneous_cluster, random_chain, random_cluster

torch.set_num_threads(1)


def _compiled(chain, cluster, config, policy, sol):
    mb = config.global_batch // sol.num_microbatches
    cfg = dataclasses.replace(config, microbatch_size=mb)
    ref = ModelRef(spec="tests:chain", name=chain.model_name, fingerprint=chain.fingerprint,
                   batch=chain.microbatch_size, dtype=trace_dtype(chain))
    return predict(compile_plan(sol, api.scale_chain(chain, mb), cluster, cfg, policy, ref))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_balanced_pipeline_matches_the_simulator(schedule):
    cluster = homogeneous_cluster(4)
    chain = random_chain(np.random.default_rng(0), 16, param_scale=0.9e9, act_scale=1e7, out_scale=1e5,
                         uniform=True)  # 16 x 14.4 GB of Adam state: four stages are needed
    config = TrainingConfig(global_batch=8, microbatch_size=1, schedule=schedule)
    policy = VerificationPolicy()
    sol = api.solve(chain, cluster, config, policy, time_limit_s=10, workers=1, max_replicas=1)
    assert len(sol.stages) == 4
    sim = simulate(_compiled(chain, cluster, config, policy, sol))
    assert sim.pipeline_ms == pytest.approx(sol.predicted_step_ms, rel=0.01)


def test_objective_is_an_upper_estimate_with_slow_links_and_verifiers():
    rng = np.random.default_rng(5)
    cluster = random_cluster(rng, 4, verifier_host=True)
    chain = random_chain(rng, 8, param_scale=3e8, act_scale=2e8, out_scale=5e7)
    config = TrainingConfig(global_batch=4, microbatch_size=1)
    policy = VerificationPolicy(trusted_endpoints=False)
    sol = api.solve(chain, cluster, config, policy, time_limit_s=10, workers=1)
    plan = _compiled(chain, cluster, config, policy, sol)
    sim = simulate(plan)
    assert sim.pipeline_ms <= sol.predicted_step_ms * 1.001
    assert sim.pipeline_ms >= 0.5 * sol.predicted_step_ms
    solver_mem = dict(sol.memory_bytes)
    for info in plan.ranks:
        assert sim.peak_mem_bytes[info.rank] <= solver_mem[info.device]
