"""Mixed precision: a pipelined bf16 / fp16 run against the unpipelined model under the same autocast.

Boundary tensors travel in the compute dtype (the receivers' buffers are sized for it, so a rank that sent
float32 would fail the transfer); fp32 master weights take the optimizer step; fp16 scales its loss. The
pipeline rounds its cut activations to the compute dtype where the unsplit model may keep float32, so the
comparison allows bf16's rounding (relative 2^-8 per element) and checks whole tensors by norm.
"""
from __future__ import annotations

import pytest
import torch

from models.registry import build_model
from planner.runtime.launcher.launch import launch
from planner.runtime.options import RunOptions
from tests.dist.plans import load_dumps, make_plan, reference_run

torch.set_num_threads(1)

CASES = {
    # name: (spec, microbatch, M, stages, replicas, optimizer, dtype, steps)
    "gpt-2ranks-bf16-adam": ("gpt-tiny", 2, 4, [(0, 1), (2, 5)], None, "adam", "bfloat16", 3),
    "llama-3ranks-replicated-fp16-sgd": ("llama-tiny", 1, 4, [(0, 2), (3, 5)], {1: (2, 2)}, "sgd", "float16", 2),
}


def test_fp16_with_a_verifier_rank_runs_and_scores_unscaled_gradients(tmp_path):
    """A verifier-only rank joins every step's overflow vote (else the stage ranks would wait on it) and
    scores gradients without the loss scale; the run still equals the mixed-precision reference."""
    plan = make_plan("gpt-tiny", microbatch=2, num_microbatches=2, seq=16, stages=[(0, 2), (3, 5)],
                     optimizer="sgd", dtype="float16", verifiers=[(0, 2, ("act", "grad"))], verifier_host=True)
    assert plan.num_ranks == 3 and plan.ranks[2].stage is None
    path = plan.save(tmp_path / "plan.json")
    result = launch(RunOptions(plan=str(path), steps=3, timeout_s=60))
    losses, _, _ = reference_run(plan, steps=3)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(losses), rtol=2e-2, atol=1e-3)
    assert result["flags"] == 0


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


@pytest.mark.parametrize("case", list(CASES))
def test_mixed_precision_pipeline_matches_mixed_precision_reference(case, tmp_path):
    spec, mbs, m, stages, replicas, optimizer, dtype, steps = CASES[case]
    plan = make_plan(spec, microbatch=mbs, num_microbatches=m, seq=16, stages=stages, replicas=replicas,
                     optimizer=optimizer, dtype=dtype)
    assert plan.config.dtype == dtype and plan.config.mixed_precision
    path = plan.save(tmp_path / "plan.json")
    result = launch(RunOptions(plan=str(path), steps=steps, timeout_s=60, dump=str(tmp_path / "dump")))
    losses, grads, params = reference_run(plan, steps=steps)
    fp32_plan = make_plan(spec, microbatch=mbs, num_microbatches=m, seq=16, stages=stages, replicas=replicas,
                          optimizer=optimizer)
    fp32_losses, _, _ = reference_run(fp32_plan, steps=steps)

    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(losses), rtol=2e-2, atol=1e-3)
    # it did compute in low precision: not the float32 run's losses
    assert max(abs(a - b) for a, b in zip(result["losses"], fp32_losses)) > 1e-5
    initial = dict(build_model(spec, batch=mbs, seq=16, device="cpu", seed=0).module.named_parameters())
    moved, moved_ref = [], []
    for d in load_dumps(tmp_path / "dump", plan.num_ranks):
        for name, g in d["grads"].items():  # fp32 master gradients, unscaled
            assert g.dtype == torch.float32
            assert _rel(g, grads[name]) < 0.05, (name, _rel(g, grads[name]))
        for name, p in d["params"].items():
            assert p.dtype == torch.float32  # master weights stay float32
            moved.append((p - initial[name].detach()).reshape(-1))
            moved_ref.append((params[name] - initial[name].detach()).reshape(-1))
    # the optimizer moved the weights as the reference did (Adam moves each element by ~lr: compare the whole)
    assert _rel(torch.cat(moved), torch.cat(moved_ref)) < 0.1
