"""The runtime hands each audit's tensor to the verifier (``audit_recompute.record``), so a passed audit withdraws
that tensor's statistical flags in the runtime as in the benchmark (issue 37: the honest twin banned on step
statistics while every one of its microbatches passed its audit)."""
from __future__ import annotations

from planner.integrity import audit
from planner.runtime.rank.audit_recompute import Outcome, record


class _Ledger:
    def __init__(self) -> None:
        self.audits: list[tuple] = []
        self.flags: list[tuple] = []

    def record_audit(self, sender, step, *, passed, **tensor):
        self.audits.append((sender, step, passed, tensor))

    def add_flags(self, step, events):
        self.flags.append((step, list(events)))


def test_each_audit_reaches_the_verifier_with_its_tensor():
    ledger = _Ledger()
    failed = {"type": "audit_failed", "step": 4, "mb": 3, "boundary": 1, "direction": "act", "sender": 2}
    record(ledger, [Outcome(sender=1, step=4, passed=True, event=None, mb=2, boundary=1, direction="act"),
                    Outcome(sender=2, step=4, passed=False, event=failed, mb=3, boundary=1, direction="act")],
           at_step=4)
    assert ledger.audits == [(1, 4, True, {"mb": 2, "boundary": 1, "direction": "act"}),
                             (2, 4, False, {"mb": 3, "boundary": 1, "direction": "act"})]
    assert ledger.flags == [(4, [failed])]


def test_an_outcome_without_its_tensor_vouches_for_nothing():
    ledger = _Ledger()
    record(ledger, [Outcome(sender=1, step=4, passed=True, event=None)], at_step=5)
    assert ledger.audits == [(1, 4, True, {})]


def test_a_pass_just_inside_the_tolerance_does_not_vouch():
    """A steady 0.99% bias passes a float32 audit (tolerance 1%) but is the sign test's to catch: only an audit
    near a recompute's own noise vouches for its tensor (review of the vouching)."""
    tol = audit.TOLERANCE["float32"]
    assert audit.audit_event(step=1, mb=0, boundary=0, direction="grad", sender=1, error=0.0099, tolerance=tol) is None
    assert not audit.vouches(0.0099, tol) and not audit.vouches(2 * audit.VOUCH_SHARE * tol, tol)
    assert audit.vouches(0.0, tol) and audit.vouches(1e-6, tol)
