"""Gradients audited from copies (issue 37, ``planner.runtime.rank.audit_grads``): in issue 37's own placement (the
middle stage on two untrusted replicas, one verifier host checking boundary 0's gradients and boundary 1's
activations, so no verifier holds the stage's input or the gradient it is sent), the trusted stage after it copies
the auditor the gradients it sent the audited microbatches and the trusted stage before copies it their inputs and
the input gradients the replicas sent back. The auditor recomputes forward and backward from the copies: a replica
scaling the gradient it sends upstream, which outputs-only audits never saw, fails an audit and is banned within
a step or two of the attack's start, its twin never; one scaling its contribution to the all-reduce fails the
contribution audit (the auditor is the lead verifier); a clean run, fp16 too, fails nothing."""
from __future__ import annotations

import dataclasses

import pytest

from planner.runtime.launcher.launch import RunBanned, launch
from planner.runtime.options import RunOptions
from planner.simulate_audits import audit_site
from planner.solver.audit_price import AuditWhere
from planner.verifier_config import VerifierConfig
from tests.dist.plans import make_plan

STEPS, ATTACK_START = 5, 2
ATTACKER, TWIN, UPSTREAM, DOWNSTREAM, AUDITOR = 1, 2, 0, 3, 4
PER_REPLICA = 4


def _plan(tmp_path, dtype: str = "float32"):
    # mlp-tiny in 3 stages; ranks 1 and 2 (untrusted) replicate the middle one; the verifier host (rank 4, the lead
    # and only verifier) checks boundary 0's gradients and boundary 1's activations, as in issue 37. A long
    # warm-up: what bans here is the audit.
    plan = make_plan("mlp-tiny", microbatch=2, num_microbatches=8, stages=[(0, 1), (2, 3), (4, 5)],
                     replicas={1: (PER_REPLICA, PER_REPLICA)}, untrusted=(1, 2), optimizer="adam", verifier_host=True,
                     verifiers=[(0, 4, ("grad",)), (1, 4, ("act",))], verifier_config=VerifierConfig(warmup=50),
                     dtype=dtype)
    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(st, audit_every=0) for st in plan.stages))
    where = audit_site(plan, 1)
    assert isinstance(where, AuditWhere) and (where.auditor, where.copied_from, where.grads_from) == \
        (AUDITOR, (UPSTREAM,), (DOWNSTREAM,)), where
    assert plan.stage_ranks(1) == (ATTACKER, TWIN)
    return plan.save(tmp_path / "plan.json")


def _verification(result) -> dict:
    return next(r for r in result["ranks"] if r["rank"] == AUDITOR)["verification"]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_clean_run_passes_every_audit_of_outputs_input_gradients_and_contributions(tmp_path, dtype):
    steps = 3
    result = launch(RunOptions(plan=str(_plan(tmp_path, dtype)), steps=steps, timeout_s=90, lr=1e-2, audit_every=1,
                               rehearse_dtype="plan"))
    audits = _verification(result)["audits"]
    # every microbatch audited, output and input gradient, and each replica's whole contribution once a step: the
    # last step's in line, the others' during the next step (all in by the run's end)
    expected = steps * (2 * PER_REPLICA + 1)
    assert audits["run_by_sender"] == {str(ATTACKER): expected, str(TWIN): expected}, audits
    assert audits["failed"] == 0 and not audits["suspended"] and not result["banned"], audits


def test_a_replica_scaling_the_gradient_it_sends_upstream_is_banned_by_an_audit_from_copies(tmp_path):
    attack = f"rank={ATTACKER},kind=scale,factor=3,dir=grad,start={ATTACK_START}"
    with pytest.raises(RunBanned) as stopped:
        launch(RunOptions(plan=str(_plan(tmp_path)), steps=STEPS + 3, timeout_s=90, lr=1e-2, audit_every=1,
                          attacks=(attack,)))
    (notice,) = stopped.value.notices
    # recomputed during the next step: banned a step after the attacked one, which is its first flagged step
    assert notice.rank == ATTACKER and notice.first_flagged_step == ATTACK_START, notice
    assert ATTACK_START <= notice.ban_step <= ATTACK_START + 2, notice
    audits = _verification(stopped.value.result)["audits"]
    assert audits["failed_by_sender"].get(str(ATTACKER), 0) >= 1 and str(TWIN) not in audits["failed_by_sender"]


def test_a_replica_scaling_its_contribution_is_banned_by_a_contribution_audit_from_copies(tmp_path):
    attack = f"rank={ATTACKER},kind=scale,factor=3,dir=params,start={ATTACK_START}"
    with pytest.raises(RunBanned) as stopped:
        launch(RunOptions(plan=str(_plan(tmp_path)), steps=STEPS + 3, timeout_s=90, lr=1e-2, audit_every=1,
                          attacks=(attack,)))
    (notice,) = stopped.value.notices
    assert notice.rank == ATTACKER and ATTACK_START <= notice.ban_step <= ATTACK_START + 2, notice
    assert notice.first_flagged_step >= ATTACK_START, notice
    audits = _verification(stopped.value.result)["audits"]
    # its tensors honest: its contribution alone fails
    assert audits["failed_by_sender"] == {str(ATTACKER): 1}, audits


def test_partial_draws_share_the_schedule_with_both_neighbours_and_pass_clean(tmp_path):
    """At --audit-every 4 each side keeps only what the auditor's key draws (shared point to point with the stage
    before and the stage after): a clean run's copies meet the auditor's receives, every audit passes."""
    steps = 6
    result = launch(RunOptions(plan=str(_plan(tmp_path)), steps=steps, timeout_s=120, lr=1e-2, audit_every=4))
    audits = _verification(result)["audits"]
    run = sum(audits["run_by_sender"].values())
    # some drawn, not all (every one would be 2 a microbatch, output and input gradient, and contributions)
    assert 0 < run < steps * 2 * (2 * PER_REPLICA + 1), audits
    assert audits["failed"] == 0 and not audits["suspended"] and not result["banned"], audits


def test_a_replica_marking_its_input_gradients_dropped_cannot_switch_its_contribution_audit_off(tmp_path):
    """Scaling its contribution while marking every input gradient it sends tainted (values honest): the auditor
    compares them whatever the header says, sees no cause for the mark (its input and the gradient it was sent
    came clean) and fails it; before, a tainted input gradient was left out and its contribution never judged."""
    attacks = (f"rank={ATTACKER},kind=scale,factor=3,dir=params,start={ATTACK_START}",
               f"rank={ATTACKER},kind=taint,dir=grad,start={ATTACK_START}")
    with pytest.raises(RunBanned) as stopped:
        launch(RunOptions(plan=str(_plan(tmp_path)), steps=STEPS + 3, timeout_s=120, lr=1e-2, audit_every=1,
                          attacks=attacks))
    (notice,) = stopped.value.notices
    assert notice.rank == ATTACKER and ATTACK_START <= notice.ban_step <= ATTACK_START + 2, notice
    verification = _verification(stopped.value.result)
    audits = verification["audits"]
    assert audits["failed_by_sender"].get(str(ATTACKER), 0) >= 1 and str(TWIN) not in audits["failed_by_sender"]
    # the drops it made up are named as its own (recomputed during the next step: named once the verdict is in)
    assert any(d["sender"] == ATTACKER and d["step"] == ATTACK_START for d in verification["drops"]), \
        verification["drops"]


def test_honest_drops_on_either_side_fail_no_audit(tmp_path):
    """The trusted stage before marks some inputs dropped (the replicas drop them, mark their outputs, the stage after
    drops those and marks its gradients) and the stage after marks some gradients dropped: the honest replicas mark
    their input gradients, each with a cause the auditor sees, and fail nothing; those microbatches do not train."""
    steps = 4
    attacks = (f"rank={UPSTREAM},kind=taint,dir=act,p=0.3", f"rank={DOWNSTREAM},kind=taint,dir=grad,p=0.3")
    result = launch(RunOptions(plan=str(_plan(tmp_path)), steps=steps, timeout_s=120, lr=1e-2, audit_every=1,
                               attacks=attacks))
    verification = _verification(result)
    audits = verification["audits"]
    assert audits["failed"] == 0 and not audits["suspended"] and not result["banned"], audits
    # every microbatch's output and input gradient compared, marked or not; and the contributions (no verdict on a
    # step where all of a replica's microbatches were dropped: it trained nothing)
    for sender in (ATTACKER, TWIN):
        assert steps * 2 * PER_REPLICA < audits["run_by_sender"][str(sender)] <= steps * (2 * PER_REPLICA + 1)
    assert verification["drops_total"] > 0, verification["drops_total"]
