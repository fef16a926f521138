"""A replicated stage's gradient all-reduce under PowerSGD (``StageInfo.allreduce_codec``; gloo on CPU, one
process per rank): the replicas apply the same sum, bit for bit, and the run stays near the exact one.

PowerSGD sums a rank-4 approximation of the replicas' gradients and keeps the rest for the next step (error
feedback), so the run drifts from the exact one (the bound is ``LOSS_RTOL``) but never splits its replicas.
"""
from __future__ import annotations

import dataclasses

import torch

from planner.runtime.launcher.launch import launch
from planner.runtime.options import RunOptions
from tests.dist.plans import load_dumps, make_plan, reference_run

torch.set_num_threads(1)

STEPS = 5
# Relative drift of each step's loss from the exact run. Step 0's loss is exact (no update yet); later ones see
# Adam steps taken on the low-rank sum of the replicated stage's gradients. Measured over these 5 steps: at most
# 0.05%; the bound leaves 10x of margin and still catches a sum that lost its scale or its error feedback.
LOSS_RTOL = 5e-3


def _powersgd(plan, stage: int):
    stages = tuple(dataclasses.replace(st, allreduce_codec="powersgd") if st.index == stage else st
                   for st in plan.stages)
    return dataclasses.replace(plan, stages=stages)


def test_powersgd_replicas_agree_and_train_close_to_the_exact_run(tmp_path):
    plan = _powersgd(make_plan("gpt-tiny", microbatch=2, num_microbatches=4, seq=16, stages=[(0, 2), (3, 5)],
                               replicas={0: (2, 2)}, schedule="1f1b", optimizer="adam"), 0)
    assert [st.allreduce_codec for st in plan.stages] == ["powersgd", "none"]
    path = plan.save(tmp_path / "plan.json")
    result = launch(RunOptions(plan=str(path), steps=STEPS, timeout_s=60, dump=str(tmp_path / "dump")))
    exact, _, _ = reference_run(plan, steps=STEPS)
    got, want = torch.tensor(result["losses"]), torch.tensor(exact)
    torch.testing.assert_close(got, want, rtol=LOSS_RTOL, atol=0.0)
    assert not torch.equal(got[1:], want[1:])   # the all-reduce was in fact compressed

    # the replicas' weights after the last step: equal bit for bit (every replica applies P Q^T of the same sums)
    dumps = [d for d in load_dumps(tmp_path / "dump", plan.num_ranks) if d["stage"] == 0]
    assert len(dumps) == 2
    for name, p in dumps[0]["params"].items():
        torch.testing.assert_close(dumps[1]["params"][name], p, rtol=0.0, atol=0.0, msg=lambda m, n=name: f"{n}: {m}")
