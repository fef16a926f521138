"""Verdicts that lag: a stage's copies to its verifier queue on a link slower than the stage makes them, and the
consumer, which passes each result on only after its input's verdict, stalls in its warm-up. Priced as it runs
(``program_resources._verdict_stall``); the case is a plan a wider hill-climb found on one of the one-cost tests'
random clusters (benchmarks/README.md, 2026-12-04), priced 5.6% under its simulation before the stall was."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from cost_models.memory import trace_dtype
from cost_models.precision import resolve_dtype
from cost_models.training import TrainingConfig
from planner.compile import compile_plan
from planner.plan_values import ModelRef
from planner.simulate import simulate
from planner.solver.objective import Placement, price_program, violations
from planner.solver.problem_build import build_problem, scale_chain
from planner.solver.solution import (
    Solution,
    SolveReport,
    StagePlacement,
    VerifierPlacement,
)
from tests.unit.program_fixtures import POLICY, wide_area_cluster
from tests.unit.solver_fixtures import random_chain

torch.set_num_threads(1)

# (first block, last block, devices): three stages of two replicas each; the verifier on a CPU host of its own.
LAYOUT = ((0, 4, ("h2/0", "h2/1")), (5, 8, ("h4/0", "h4/1")), (9, 9, ("h4/2", "h3/0")))


def _case():
    rng = np.random.default_rng(15)  # the draw of tests/unit/test_one_cost.py's seed 15
    cluster = wide_area_cluster(rng, int(rng.integers(4, 14)))
    chain = random_chain(rng, int(rng.integers(6, 20)), param_scale=float(rng.choice([2e7, 1e8])),
                         act_scale=5e7, out_scale=float(rng.choice([1e6, 1e7])))
    dtype = resolve_dtype("auto", cluster)  # the cluster's half precision, as ``plan`` takes it
    config = TrainingConfig(global_batch=int(rng.choice([8, 16, 32])), microbatch_size=1, dtype=dtype,
                            mixed_precision=dtype != "float32")
    return cluster, chain, config


def test_a_consumer_waiting_on_lagging_verdicts_is_priced_as_it_runs():
    cluster, chain, config = _case()
    problem = build_problem(scale_chain(chain, 1), cluster, config, POLICY)
    M = config.global_batch
    stages = tuple(StagePlacement(index=k, first_block=a, last_block=b, devices=devs, microbatches=(M // 2, M // 2))
                   for k, (a, b, devs) in enumerate(LAYOUT))
    verifiers = tuple(VerifierPlacement(boundary=k, device="verifier/0", directions=("act", "grad")) for k in (0, 1))
    placement = Placement(stages=stages, verifiers=verifiers, num_microbatches=M)
    assert not violations(problem, placement)
    priced = price_program(problem, placement)
    limited = tuple(dataclasses.replace(st, in_flight=n) for st, n in zip(stages, priced.in_flight))
    report = SolveReport(method="test", status="FEASIBLE", objective_ms=priced.step_ms, bound_ms=None, gap=None,
                         solve_s=0.0)
    sol = Solution(stages=limited, verifiers=verifiers, num_microbatches=M, schedule="1f1b",
                   predicted_step_ms=priced.step_ms, memory_bytes=(), report=report)
    ref = ModelRef(spec="tests:chain", name=chain.model_name, fingerprint=chain.fingerprint,
                   batch=chain.microbatch_size, dtype=trace_dtype(chain))
    simulated = simulate(compile_plan(sol, scale_chain(chain, 1), cluster, config, POLICY, ref)).step_ms
    assert abs(priced.step_ms - simulated) <= 0.02 * simulated, (priced.step_ms, simulated)
