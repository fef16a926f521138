"""Verification in the running pipeline: a rank that corrupts what it sends is flagged by the
verifier rank, its microbatches are dropped downstream, only it is blamed, and it gets banned,
which stops the run on every rank at the end of the ban step (``RunBanned``: which rank, its
first flagged step, the ban step; re-planning around it is tests/dist/test_ban_replan.py).

The corruption is an infinite scale: the monitors flag any non-finite tensor whatever their
statistics have learnt, so this tests the runtime's mechanism (copies, verdicts, drops, taint,
blame, bans) independently of the detectors' tuning, which tests/dist/test_verify*.py cover.
If the consumer used a tensor before its verdict, the loss would turn inf/nan."""
from __future__ import annotations

import json
import math

import pytest

from planner.runtime.launcher.launch import RunBanned, launch
from planner.runtime.options import RunOptions
from planner.verifier_config import VerifierConfig
from tests.dist.plans import make_plan

M, ATTACK_START, STEPS = 4, 2, 8
BAN_STEP = ATTACK_START + 1  # ban_false_steps=100: the second blamed step bans


def test_corrupting_rank_is_caught_dropped_and_banned_and_the_run_stops(tmp_path):
    plan = make_plan("mlp-tiny", microbatch=2, num_microbatches=M, stages=[(0, 1), (2, 3), (4, 5)],
                     verifiers=[(0, 3, ("act", "grad")), (1, 3, ("act", "grad"))], verifier_host=True,
                     verifier_config=VerifierConfig(warmup=2, ban_false_steps=100))  # ban after 2 blamed steps
    assert plan.ranks[3].stage is None and plan.ranks[3].verifies == (0, 1)
    path = plan.save(tmp_path / "plan.json")
    attack = f"rank=1,kind=scale,factor=inf,start={ATTACK_START},dir=act"
    with pytest.raises(RunBanned) as stopped:
        launch(RunOptions(plan=str(path), steps=STEPS, timeout_s=60, attacks=(attack,),
                          report=str(tmp_path / "report.json")))

    (notice,) = stopped.value.notices
    assert (notice.rank, notice.first_flagged_step, notice.ban_step) == (1, ATTACK_START, BAN_STEP)
    assert stopped.value.hosts == {1: "h1"}
    message = str(stopped.value)
    assert f"rank 1 (host h1) banned at step {BAN_STEP}, first flagged at step {ATTACK_START}" in message
    assert "--replan-on-failure 1" in message and "stagewise replan" in message and "--exclude h1" in message
    assert "stagewise run NEW.json (from the start" in message   # no checkpoints to resume from
    result = stopped.value.result
    assert result["banned"] == [1] and result["steps"] == BAN_STEP + 1   # nothing ran after the ban step
    attacked = next(r for r in result["ranks"] if r["rank"] == 1)["attacked"]
    assert {step for step, *_ in attacked} == set(range(ATTACK_START, BAN_STEP + 1))
    # every corrupted microbatch is dropped before it is used: the last stage keeps none of them
    assert all(d == M for d in result["dropped"][ATTACK_START:])
    assert all(loss is None for loss in result["losses"][ATTACK_START:])
    assert all(loss is not None for loss in result["losses"][:ATTACK_START])
    assert result["untrained_steps"] == list(range(ATTACK_START, BAN_STEP + 1))
    verifier = next(r for r in result["ranks"] if r["rank"] == 3)["verification"]
    flags = [e for e in verifier["events"] if e["type"] == "flag"]
    assert flags and all(e["sender"] == 1 for e in flags if e["step"] >= ATTACK_START)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["failed"] and report["stopped_by_bans"] == [notice.to_dict()]


def test_without_verification_the_corruption_goes_through(tmp_path):
    """--no-verify: no copies, no verdicts; the same attack then reaches the loss (inf/nan)."""
    plan = make_plan("mlp-tiny", microbatch=2, num_microbatches=2, stages=[(0, 2), (3, 5)],
                     verifiers=[(0, 2, ("act",))], verifier_host=True)
    path = plan.save(tmp_path / "plan.json")
    result = launch(RunOptions(plan=str(path), steps=2, timeout_s=60, verify=False,
                               attacks=("rank=0,kind=scale,factor=inf,start=1,dir=act",)))
    assert result["flags"] == 0 and result["dropped"] == [0, 0]
    first, second = result["losses"]
    assert first is not None and math.isfinite(first)
    assert second is None or not math.isfinite(second)
