"""Compressed twins of the runtime's equivalence test: boundaries under the plan's ``out_codec`` (gloo on CPU,
one process per rank, one thread each).

``none`` stays exact. A lossy codec perturbs every boundary tensor by at most ``REL_ERROR`` x its block's absmax
(``cost_models.codecs``), activations forward and gradients back, so the run drifts from the exact one by a
bounded amount (the bound is in ``LOSS_RTOL``); the bytes the ranks count on the wire are the plan's.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from cost_models.codecs import wire_bytes
from planner.runtime.launcher.launch import launch
from planner.runtime.options import RunOptions
from planner.runtime.rank.metrics import read_metrics
from planner.verifier_config import VerifierConfig
from tests.dist.plans import make_plan, reference_run

torch.set_num_threads(1)

STEPS = 5
# Relative drift of each step's loss from the exact run. The step-0 loss sees only the forward's rounding, a
# relative error of at most REL_ERROR per value (int8 0.4% of the block's absmax, fp8 e4m3 2^-4 of the value);
# later steps add the gradients' rounding (e5m2: 2^-3) through the weights. Measured over these 5 Adam steps:
# at most 0.25% (int8), 0.6% (fp8). The bounds leave 4x / 3x of margin and still catch a wrong scale or a
# block shifted (O(1) moves of the loss); the inequality below catches a codec that is not applied.
LOSS_RTOL = {"int8": 1e-2, "fp8": 2e-2}


def _compressed(plan, codec: str):
    stages = tuple(dataclasses.replace(st, out_codec=codec) if st.index < plan.num_stages - 1 else st
                   for st in plan.stages)
    return dataclasses.replace(plan, stages=stages)


@pytest.mark.parametrize("codec", ["none", "int8", "fp8"])
def test_compressed_boundaries_train_close_to_the_exact_run(codec, tmp_path):
    plan = _compressed(make_plan("mlp-tiny", microbatch=2, num_microbatches=3, stages=[(0, 3), (4, 5)],
                                 schedule="gpipe", optimizer="adam"), codec)
    path = plan.save(tmp_path / "plan.json")
    result = launch(RunOptions(plan=str(path), steps=STEPS, timeout_s=60, metrics=str(tmp_path / "m.jsonl")))
    exact, _, _ = reference_run(plan, steps=STEPS)
    got, want = torch.tensor(result["losses"]), torch.tensor(exact)
    if codec == "none":
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(got, want, rtol=LOSS_RTOL[codec], atol=0.0)
        assert not torch.equal(got, want)  # the boundary was in fact encoded

    boundary = plan.stages[0].out_bytes  # one fp32 tensor per microbatch, its gradient the same size
    per_step = plan.num_microbatches * wire_bytes(codec, boundary, 4)
    rows = read_metrics(tmp_path / "m.jsonl")
    for step in range(STEPS):
        mine = [r for r in rows if r.step == step]
        assert sum(r.sent_act_bytes for r in mine) == per_step
        assert sum(r.sent_grad_bytes for r in mine) == per_step


@pytest.mark.slow
def test_verified_int8_boundaries_run_clean(tmp_path):
    """The verifier of every boundary (both ways) checks the decoded tensors: a clean run is not flagged.
    (Measured: 20 steps of fp8, int8 and int4 each, no flag; a bias attack on int8 banned 4 steps after it began.)"""
    plan = make_plan("gpt-tiny", microbatch=4, num_microbatches=4, stages=[(0, 1), (2, 2), (3, 3), (4, 5)],
                     optimizer="adam", verifiers=[(b, 4, ("act", "grad")) for b in range(3)],
                     verifier_host=True, verifier_config=VerifierConfig(warmup=5))
    result = launch(RunOptions(plan=str(_compressed(plan, "int8").save(tmp_path / "plan.json")), steps=20,
                               timeout_s=120))
    assert result["banned"] == []
    events = next(r for r in result["ranks"] if r["rank"] == 4)["verification"]["events"]
    assert [e for e in events if e["type"] == "flag"] == []
