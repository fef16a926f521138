"""Audits of a replicated stage (issue 37, deliverable 3): the secret share, the recompute's comparison, the
failed audit as proof in blame and bans, and its price."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from planner.errors import InvalidInputError
from planner.integrity import audit
from planner.integrity.bans import BanTest
from planner.integrity.blame import blame_weights
from planner.integrity.verifier import Verifier
from planner.verifier_config import VerifierConfig

SECRET = bytes(range(16))
STAGE_OF = {0: 0, 1: 1, 3: 1, 2: 2}
ONE_EACH = {0: 2, 1: 1, 3: 1, 2: 2}


def test_each_microbatch_is_audited_independently_with_probability_one_in_every():
    schedule = audit.AuditSchedule(SECRET, every=4)
    picks = [schedule.audited(1, step, slot, 4) for step in range(1000) for slot in range(4)]
    assert 0.23 <= sum(picks) / len(picks) <= 0.27   # 4,000 draws: 0.25 +- 0.007 (1 sd)
    # an audit seen tells nothing of the next microbatch (no window to be past): still one in four after one
    after = [b for a, b in itertools.pairwise(picks) if a]
    assert 0.19 <= sum(after) / len(after) <= 0.31 and len(after) > 800
    assert all(schedule.audited(1, step, 0, 2, suspected=True) for step in range(8))


def test_the_positions_depend_on_the_secret_and_the_sender():
    one = [audit.AuditSchedule(SECRET, 8).audited(1, s, 0, 1) for s in range(64)]
    other = [audit.AuditSchedule(bytes(16), 8).audited(1, s, 0, 1) for s in range(64)]
    twin = [audit.AuditSchedule(SECRET, 8).audited(3, s, 0, 1) for s in range(64)]
    assert one != other and one != twin
    assert one == [audit.AuditSchedule(SECRET, 8).audited(1, s, 0, 1) for s in range(64)]
    assert SECRET.hex() not in repr(audit.AuditSchedule(SECRET, 8)) and str(SECRET) not in repr(audit.AuditSchedule(SECRET, 8))


@pytest.mark.parametrize("secret, every", [(b"short", 4), (SECRET, 0)])
def test_a_weak_secret_or_no_share_is_refused(secret, every):
    with pytest.raises(InvalidInputError):
        audit.AuditSchedule(secret, every)


def test_the_recompute_passes_an_honest_output_and_fails_stale_damped_and_noisy_ones():
    torch.manual_seed(0)
    stage = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    x, other, grad_out = torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8)
    honest = stage(x).detach()
    tol = audit.TOLERANCE["float32"]
    assert audit.relative_error(honest, audit.recompute_output(stage, x)) <= tol
    for sent in (stage(other).detach(), 0.5 * honest, honest + torch.randn(4, 8) * honest.std()):
        assert audit.relative_error(sent, audit.recompute_output(stage, x)) > tol
    xg = x.clone().requires_grad_(True)
    stage(xg).backward(grad_out)
    before = [p.grad.clone() for p in stage.parameters()]
    expected = audit.recompute_input_grad(stage, x, grad_out)
    assert audit.relative_error(xg.grad, expected) <= tol
    assert all(torch.equal(p.grad, g) for p, g in zip(stage.parameters(), before))   # the replica's sum untouched
    assert audit.relative_error(xg.grad + torch.randn(4, 8), expected) > tol
    assert audit.relative_error(torch.full((4, 8), math.nan), expected) == math.inf
    assert audit.relative_error(torch.zeros(3, 8), expected) == math.inf


def test_a_failed_audit_is_its_senders_own_evidence_and_bans_at_once():
    failed = audit.audit_event(step=30, mb=0, boundary=1, direction="act", sender=1, error=0.7, tolerance=0.01)
    assert audit.audit_event(step=30, mb=0, boundary=1, direction="act", sender=1, error=0.001,
                             tolerance=0.01) is None
    # an honest stage's flag upstream does not outrank it
    upstream = {**failed, "boundary": 0, "sender": 0, "reasons": ["mad", "l2"], "scores": {"mad": 3.0},
                "fences": {}}
    weights = blame_weights([failed, upstream], stage_of=STAGE_OF, microbatches=ONE_EACH)
    assert weights[1] == math.inf
    bans = BanTest(honest_rate=0.05, attack_rate=0.6, false_steps=1e5)
    assert bans.step({3}, at=29) == [] and bans.step({1}, proven={1}, at=30) == [1]
    assert bans.bans[1] == (30, 30)
    v = Verifier(VerifierConfig().to_dict(), [(0, "grad"), (1, "act")], stage_of=STAGE_OF, microbatches=ONE_EACH)
    assert v.end_step(30, [[failed]]) == {1}
    assert v.ban_records()[1] == (30, 30)


def test_recovery_resumes_after_the_last_step_an_audit_vouched_for():
    ledger = audit.AuditLedger()
    assert ledger.suspect_since(1, 20) == 0
    for step, passed in ((13, True), (17, True), (22, True), (22, False)):   # 22: activations pass, params fail
        ledger.record(1, step, passed=passed)
    assert ledger.suspect_since(1, 22) == 18
    ledger.record(3, 21, passed=True)
    assert ledger.suspect_since(3, 25) == 22 and ledger.suspect_since(1, 30) == 18
