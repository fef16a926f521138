"""A replica throttled by its in-flight limit is priced as its compiled programs run: its microbatches' round
trips also wait behind other microbatches' passes downstream (``planner.solver.in_flight``)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cost_models.cluster_file import parse_cluster
from cost_models.memory import trace_dtype
from cost_models.training import TrainingConfig
from planner.compile import compile_plan
from planner.plan import ModelRef
from planner.simulate import simulate
from planner.solver.objective import Placement, even_split, price_program, violations
from planner.solver.policy import VerificationPolicy
from planner.solver.problem_build import build_problem, scale_chain
from planner.solver.solution import Solution, SolveReport, StagePlacement
from tests.unit.solver_fixtures import random_chain

OFF = VerificationPolicy(enabled=False)
# (first block, last block, replicas): two single-replica stages feeding two slower replicated ones (the tail
# of llama-7b fp32 on consumer-40, scaled down).
LAYOUT = ((0, 1, 1), (2, 3, 1), (4, 6, 2), (7, 9, 2))


def _priced_and_simulated(num_microbatches: int, act_bytes: float, limits=None):
    """(priced program, simulated step ms) of ``LAYOUT`` on one host of six RTX 3090s, identical blocks
    (``limits``: in-flight limits the placement carries, per stage)."""
    cluster = parse_cluster({"name": "lab", "links": {"intra_host": {"bandwidth_gbps": 64.0, "latency_ms": 0.01}},
                             "hosts": [{"name": "h", "region": "r", "trust": "op", "trusted": True,
                                        "devices": [{"type": "RTX3090", "count": 6}]}]})
    chain = scale_chain(random_chain(np.random.default_rng(0), 10, uniform=True, param_scale=1e7,
                                     act_scale=act_bytes, out_scale=1e7), 1)
    config = TrainingConfig(global_batch=num_microbatches, microbatch_size=1, schedule="1f1b")
    problem = build_problem(chain, cluster, config, OFF)
    gpus = iter(d.id for d in cluster.hosts[0].devices)
    stages = tuple(StagePlacement(index=k, first_block=a, last_block=b, devices=tuple(next(gpus) for _ in range(r)),
                                  microbatches=even_split(num_microbatches, r)) for k, (a, b, r) in enumerate(LAYOUT))
    placement = Placement(stages=stages, verifiers=(), num_microbatches=num_microbatches)
    assert not violations(problem, placement)
    if limits is not None:
        placement = dataclasses.replace(placement, stages=tuple(
            dataclasses.replace(st, in_flight=n) for st, n in zip(stages, limits)))
    priced = price_program(problem, placement)
    report = SolveReport(method="hand", status="FEASIBLE", objective_ms=priced.step_ms, bound_ms=None, gap=None,
                         solve_s=0.0)
    sol = Solution(stages=tuple(dataclasses.replace(st, in_flight=n) for st, n in zip(stages, priced.in_flight)),
                   verifiers=(), num_microbatches=num_microbatches, schedule="1f1b",
                   predicted_step_ms=priced.step_ms, memory_bytes=(), report=report)
    ref = ModelRef(spec="tests:chain", name=chain.model_name, fingerprint=chain.fingerprint, batch=1,
                   dtype=trace_dtype(chain))
    return priced, simulate(compile_plan(sol, chain, cluster, config, OFF, ref)).step_ms


@pytest.mark.parametrize("num_microbatches", [32, 64])
def test_a_throttled_stage_feeding_busy_stages_is_priced_as_it_runs(num_microbatches):
    """Memory holds 4 microbatches on stage 0 where its round trip wants 10: stage 0 paces the step, and its
    round trips wait behind the backwards coming back through stage 1 (as fast as stage 0, so as busy) and
    stage 2, and the forwards going down. Priced without those waits: 6.7% (32) and 9.0% (64) under the
    simulated step."""
    priced, simulated_ms = _priced_and_simulated(num_microbatches, 2.3e9)
    assert priced.in_flight[0] == (4,) and priced.bottleneck == "stage 0 on h/0"
    assert abs(priced.step_ms - simulated_ms) <= 0.05 * simulated_ms, (priced.step_ms, simulated_ms)


def test_a_throttled_stage_locked_in_step_with_an_equal_stage_is_priced_as_it_runs():
    """Window 5 (act 2.0e9): stage 1, as fast as stage 0, is busy 83% of the throttled period, so the collisions
    there lock in step and each meets a whole pass (``in_flight``: lock step). Priced with half a pass at random
    phases: 5.2% under the simulated step at 64 microbatches; with the lock 3.9% under."""
    priced, simulated_ms = _priced_and_simulated(64, 2.0e9)
    assert priced.in_flight[0] == (5,) and priced.bottleneck == "stage 0 on h/0"
    assert abs(priced.step_ms - simulated_ms) <= 0.05 * simulated_ms, (priced.step_ms, simulated_ms)


def test_the_limits_a_placement_carries_cap_its_windows_as_memory_does():
    """With room for 6 in flight on stage 0, a placement carrying window 5 (what 2.0e9 bytes of activations
    leave) is priced as the placement whose memory holds 5: limits are caps, and the pricing is idempotent."""
    memory_bound, _ = _priced_and_simulated(64, 2.0e9)
    roomy, _ = _priced_and_simulated(64, 1.7e9)
    assert roomy.in_flight[0] == (6,) and memory_bound.in_flight[0] == (5,)
    capped, _ = _priced_and_simulated(64, 1.7e9, limits=memory_bound.in_flight)
    assert capped.in_flight == memory_bound.in_flight and capped.step_ms == memory_bound.step_ms
    again, _ = _priced_and_simulated(64, 1.7e9, limits=roomy.in_flight)
    assert again.in_flight == roomy.in_flight and again.step_ms == roomy.step_ms
