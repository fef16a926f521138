"""Replicas check each other in the running pipeline (issue 37): an untrusted replica that poisons its gradient
contribution to its stage's all-reduce (``dir=params``) is flagged by the lead verifier from the sketches the
replicas send it, blamed and banned alone; its twin is not. The poison is an infinite scale, which the
contribution monitor flags at once whatever it has learnt: this tests the mechanism (sketch, exchange, flag,
blame, ban), not the detector's tuning (tests/unit/test_replica_contributions.py)."""
from __future__ import annotations

import math

import pytest

from planner.runtime.launcher.launch import RunBanned, launch
from planner.runtime.options import RunOptions
from planner.verifier_config import VerifierConfig
from tests.dist.plans import make_plan

ATTACK_START, STEPS = 2, 8
BAN_STEP = ATTACK_START + 1  # ban_false_steps=100: the second blamed step bans


def test_a_poisoned_contribution_is_flagged_and_its_sender_banned_alone(tmp_path):
    plan = make_plan("mlp-tiny", microbatch=2, num_microbatches=4, stages=[(0, 1), (2, 3), (4, 5)],
                     replicas={1: (2, 2)}, untrusted=(1, 2), verifier_host=True,
                     verifiers=[(0, 4, ("act", "grad")), (1, 4, ("act", "grad"))],
                     verifier_config=VerifierConfig(warmup=2, ban_false_steps=100))
    assert plan.stage_ranks(1) == (1, 2) and plan.ranks[4].stage is None
    path = plan.save(tmp_path / "plan.json")
    attack = f"rank=1,kind=scale,factor=inf,start={ATTACK_START},dir=params"
    with pytest.raises(RunBanned) as stopped:
        launch(RunOptions(plan=str(path), steps=STEPS, timeout_s=60, attacks=(attack,)))
    (notice,) = stopped.value.notices
    assert (notice.rank, notice.first_flagged_step, notice.ban_step) == (1, ATTACK_START, BAN_STEP)
    verifier = next(r for r in stopped.value.result["ranks"] if r["rank"] == 4)["verification"]
    flags = [e for e in verifier["events"] if e["type"] == "flag" and "stage" in e]
    assert flags and {(e["sender"], e["stage"]) for e in flags} == {(1, 1)}   # not its twin, whose weights the sum
    # poisoned from the attack's first step on: only a robust sum (``robust_reduce``) keeps that out
    assert all(e["reasons"] == ["contrib_nonfinite"] and e["step"] >= ATTACK_START for e in flags)


@pytest.mark.slow
def test_the_robust_sum_keeps_a_poisoned_contribution_out_of_the_update(tmp_path):
    plan = make_plan("mlp-tiny", microbatch=2, num_microbatches=4, stages=[(0, 1), (2, 3), (4, 5)],
                     replicas={1: (2, 2)}, untrusted=(1, 2), verifier_host=True,
                     verifiers=[(0, 4, ("act", "grad")), (1, 4, ("act", "grad"))])
    path = plan.save(tmp_path / "plan.json")
    attack = f"rank=1,kind=scale,factor=1e6,start={ATTACK_START},dir=params"
    losses = {robust: launch(RunOptions(plan=str(path), steps=6, timeout_s=60, attacks=(attack,),
                                        robust_reduce=robust))["losses"] for robust in (False, True)}
    # mlp-tiny from 2.8 nats: a plain all-reduce takes the poison (4.3-5.3 nats after it), the robust sum does not
    assert all(loss is not None and math.isfinite(loss) and loss < 3.5 for loss in losses[True]), losses
    assert max(loss if loss is not None and math.isfinite(loss) else math.inf for loss in losses[False]) > 4.0, losses
