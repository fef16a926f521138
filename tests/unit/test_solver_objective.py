"""The closed-form objective on a problem built directly from tables, checked against hand arithmetic."""
from __future__ import annotations

import numpy as np
import pytest

from cost_models.cluster import Link
from cost_models.devices import CATALOG
from planner.solver.objective import (
    Placement,
    evaluate,
    even_split,
    required_directions,
    violations,
)
from planner.solver.policy import VerificationPolicy
from planner.solver.problem import DeviceClass, Problem
from planner.solver.solution import StagePlacement, VerifierPlacement

GB = 10 ** 9
FAST = Link(bandwidth_gbps=8.0, latency_ms=1.0)   # 1e9 bytes/s: 1 ms per MB + 1 ms
SLOW = Link(bandwidth_gbps=0.8, latency_ms=10.0)  # 1e8 bytes/s: 10 ms per MB + 10 ms


def _cls(i, name, ids, *, trusted, verifier_host=False, mem=80 * GB):
    spec = CATALOG["CPU" if verifier_host else "A100-80GB"]
    return DeviceClass(index=i, name=name, device_ids=ids, spec=spec, trusted=trusted, domain=None,
                       stage_capable=not verifier_host, verifier_host=verifier_host, mem_bytes=mem,
                       verify_ms_per_byte=1e-6, verify_fixed_ms=0.5)  # 1 ms per MB + 0.5 ms


def problem(policy=VerificationPolicy(), M=4, schedule="1f1b", mem=80 * GB):
    """Three blocks; class 0: two trusted devices on one host, class 1: one untrusted, class 2: CPU verifier."""
    classes = (_cls(0, "A", ("a/0", "a/1"), trusted=True, mem=mem), _cls(1, "B", ("b/0",), trusted=False, mem=mem),
               _cls(2, "V", ("v/0",), trusted=True, verifier_host=True))
    links = ((FAST, SLOW, FAST), (SLOW, None, SLOW), (FAST, SLOW, None))
    return Problem(name="hand", block_names=("b0", "b1", "b2"),
                   time_ms=np.array([[10.0, 20.0, 5.0], [30.0, 60.0, 15.0], [10.0, 20.0, 5.0]]),
                   param_count=np.array([100, 200, 100]), act_bytes=np.array([1000, 2000, 1000]),
                   out_bytes=np.array([2e6, 1e6, 0.0]), out_bytes_int=np.array([2_000_000, 1_000_000, 0]),
                   input_bytes=10, tied=(), state_bytes_per_param=16, grad_bytes_per_param=4, classes=classes,
                   links=links, num_microbatches=M, schedule=schedule, policy=policy)


def stage(k, first, last, devices, M=4):
    return StagePlacement(index=k, first_block=first, last_block=last, devices=devices,
                          microbatches=even_split(M, len(devices)))


def test_three_stage_plan_with_a_receiver_check():
    p = problem()
    stages = (stage(0, 0, 0, ("a/0",)), stage(1, 1, 1, ("b/0",)), stage(2, 2, 2, ("a/1",)))
    # boundary 0: the untrusted stage 1 sends gradients -> stage 0 checks them (it receives them anyway)
    # boundary 1: the untrusted stage 1 sends activations -> stage 2 checks them
    verifiers = (VerifierPlacement(boundary=0, device="a/0", directions=("grad",)),
                 VerifierPlacement(boundary=1, device="a/1", directions=("act",)))
    pl = Placement(stages=stages, verifiers=verifiers, num_microbatches=4)
    ev = evaluate(p, pl)
    x0 = 10.0 + 2e6 / 1e8 * 1e3    # boundary 0 (2 MB) over the slow link: 30 ms
    x1 = 10.0 + 1e6 / 1e8 * 1e3    # boundary 1 (1 MB): 20 ms
    t0 = 10.0 + x0 + (0.5 + 2.0)   # compute, activation out, verify 2 MB of gradients
    t1 = 60.0 + x1 + x0            # compute, activation out, gradient back
    t2 = 10.0 + x1 + (0.5 + 1.0)   # compute, gradient back, verify 1 MB of activations
    assert ev.stage_ms == pytest.approx((t0, t1, t2))
    assert ev.step_ms == pytest.approx(t0 + t1 + t2 + 3 * max(t0, t1, t2))
    assert not violations(p, pl, ev)
    mem_a0 = 100 * 16 + 1000 * 3 + (10 + 2 * 2_000_000) + 2 * 2_000_000   # in flight min(4, 3 - 0) = 3
    assert dict(ev.memory_bytes)["a/0"] == mem_a0


def test_remote_cpu_verifier_costs_an_extra_copy_and_bounds_the_bottleneck():
    p = problem()
    stages = (stage(0, 0, 0, ("a/0",)), stage(1, 1, 1, ("b/0",)), stage(2, 2, 2, ("a/1",)))
    verifiers = (VerifierPlacement(boundary=0, device="v/0", directions=("grad",)),
                 VerifierPlacement(boundary=1, device="a/1", directions=("act",)))
    ev = evaluate(p, Placement(stages=stages, verifiers=verifiers, num_microbatches=4))
    copy = 10.0 + 2e6 / 1e8 * 1e3  # stage 1 ships its gradient to the verifier host over a slow link
    assert ev.stage_ms[1] == pytest.approx(60.0 + 20.0 + 30.0 + copy)
    assert ev.stage_ms[0] == pytest.approx(10.0 + 30.0)
    assert dict(ev.verifier_only_ms)["v/0"] == pytest.approx(0.5 + 2.0)


def test_replicas_split_microbatches_and_all_reduce_once():
    p = problem(policy=VerificationPolicy(enabled=False), M=3)
    stages = (stage(0, 0, 2, ("a/0", "a/1"), M=3),)
    ev = evaluate(p, Placement(stages=stages, verifiers=(), num_microbatches=3))
    per_mb = 10 + 30 + 10
    assert ev.stage_ms == pytest.approx((2 * per_mb / 3,))         # the busier replica runs 2 of 3
    ring = 2 * (2 - 1) / 2 * (400 * 4) / 1e9 * 1e3 + 2 * 1.0      # 400 params of fp32 gradients
    assert ev.allreduce_ms == pytest.approx(ring)
    assert ev.step_ms == pytest.approx(3 * 2 * per_mb / 3 + ring)


def test_violations_name_each_broken_rule():
    p = problem(mem=3000)
    stages = (stage(0, 0, 1, ("b/0",)), stage(1, 2, 2, ("a/0",)))
    out = " | ".join(violations(p, Placement(stages=stages, verifiers=(), num_microbatches=4)))
    assert "endpoint on an untrusted device" in out
    assert "boundary 0 is not checked" in out
    assert "over its memory" in out
    assert required_directions(p, stages, 0) == ("act",)
