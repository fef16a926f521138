"""Contribution audits in the running pipeline (issue 37, ``planner.runtime.rank.audit_contrib``): where the
auditor (here the lead verifier) recomputed every microbatch a replica ran in a step, it compares the sketch of
their summed parameter gradients with the contribution sketch the replica reported. A replica that scales its
gradient contribution before the all-reduce (``dir=params``) is banned by the first attacked step's audit,
before the contribution monitor's warm-up even ends, its twin never; a clean run passes every one of them."""
from __future__ import annotations

import dataclasses

import pytest

from planner.integrity.contributions import WARMUP_STEPS
from planner.runtime.launcher.launch import RunBanned, launch
from planner.runtime.options import RunOptions
from planner.verifier_config import VerifierConfig
from tests.dist.plans import make_plan

STEPS, ATTACK_START = 4, 2
ATTACKER, TWIN, VERIFIER = 1, 2, 0
PER_REPLICA = 4   # microbatches a step on each replica


def _plan(tmp_path, dtype: str = "float32"):
    # test_runtime_audits' plan: mlp-tiny in 3 stages, the middle one on two untrusted replicas (ranks 1, 2), rank 0
    # (trusted, the lead and only verifier) verifying both of its boundaries both ways: the auditor holds every
    # input and gradient of the stage. The monitors' warm-up outlasts the run: what bans here is the audit.
    plan = make_plan("mlp-tiny", microbatch=2, num_microbatches=8, stages=[(0, 1), (2, 3), (4, 5)],
                     replicas={1: (PER_REPLICA, PER_REPLICA)}, untrusted=(1, 2), optimizer="adam",
                     verifiers=[(0, 0, ("act", "grad")), (1, 0, ("act", "grad"))],
                     verifier_config=VerifierConfig(warmup=50), dtype=dtype)
    assert plan.stage_ranks(1) == (ATTACKER, TWIN) and plan.ranks[VERIFIER].stage == 0
    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(st, audit_every=0) for st in plan.stages))
    return plan.save(tmp_path / "plan.json")


def _verification(result) -> dict:
    return next(r for r in result["ranks"] if r["rank"] == VERIFIER)["verification"]


def test_a_clean_run_passes_every_contribution_audit(tmp_path):
    # one run (a second without audits costs ~30 s here): that audits leave training alone is test_runtime_audits'
    result = launch(RunOptions(plan=str(_plan(tmp_path)), steps=STEPS, timeout_s=60, lr=1e-2, audit_every=1))
    audits = _verification(result)["audits"]
    # every microbatch audited (output and input gradient), and each replica's whole contribution once a step
    expected = STEPS * (2 * PER_REPLICA + 1)
    assert audits["run_by_sender"] == {str(ATTACKER): expected, str(TWIN): expected}, audits
    assert audits["failed"] == 0 and not audits["suspended"] and not result["banned"]


def test_fp16_honest_replicas_pass_their_contribution_audits(tmp_path):
    """fp16 run in fp16 here (``rehearse_dtype="plan"``): the replica's gradients carry the loss scale, the
    gradient the verifier keeps for the recompute does not; the reported sketch is unscaled (review: every honest
    replica failed by the scale, 65,536x)."""
    result = launch(RunOptions(plan=str(_plan(tmp_path, "float16")), steps=3, timeout_s=60, lr=1e-2, audit_every=1,
                               rehearse_dtype="plan"))
    audits = _verification(result)["audits"]
    assert audits["run_by_sender"] == {str(ATTACKER): 3 * (2 * PER_REPLICA + 1), str(TWIN): 3 * (2 * PER_REPLICA + 1)}
    assert audits["failed"] == 0 and not result["banned"], audits


def test_a_replica_scaling_its_contribution_is_banned_by_the_first_attacked_steps_audit(tmp_path):
    path = _plan(tmp_path)
    attack = f"rank={ATTACKER},kind=scale,factor=3,dir=params,start={ATTACK_START}"
    assert ATTACK_START + 1 < WARMUP_STEPS   # the contribution monitor flags nothing before this
    with pytest.raises(RunBanned) as stopped:
        launch(RunOptions(plan=str(path), steps=STEPS + 2, timeout_s=60, lr=1e-2, audit_every=1,
                          attacks=(attack,)))
    (notice,) = stopped.value.notices
    assert notice.rank == ATTACKER and ATTACK_START <= notice.ban_step <= ATTACK_START + 1, notice
    assert notice.first_flagged_step >= ATTACK_START, notice
    verification = _verification(stopped.value.result)
    audits = verification["audits"]
    assert audits["failed_by_sender"] == {str(ATTACKER): 1}, audits   # its tensors honest: its contribution alone
    failed = [e for e in verification["events"] if e["type"] == "flag" and "audit" in e["reasons"]]
    assert [(e["sender"], e["scope"], e["boundary"], e["direction"]) for e in failed] == [(ATTACKER, "step", 1,
                                                                                          "grad")], failed
