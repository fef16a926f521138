"""Audits where the auditor holds the stage's tensors (issue 37, ``runtime.rank.audit_verdicts.observe``), as from
copies (``audit_grads``): an input gradient its replica marked tainted with no cause the auditor saw is a made-up
drop (a failed audit: held, zeros too, since the auditor sees every cause), an honest drop fails nothing; under fp16 the input gradients audited
in the step wait for the overflow vote at its end and leave the audits on a step it skipped."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch

from planner.integrity import audit
from planner.runtime.rank import audit_grads, audit_state, audit_verdicts

SECRET = bytes(range(16))


class _Linear:
    """A stage computing ``y = 2 x`` (input gradient ``2 g``)."""

    drifts = False
    random = None
    stepper = None

    def forward(self, xs, precision, device, *, grad, settle=True):
        ins = [x.clone().requires_grad_(grad) for x in xs]
        return ins, [2.0 * ins[0]]

    def grads(self, ins, outs, gs, *, params):
        (g,) = torch.autograd.grad(outs, ins, gs)
        return [g], None


class _Verifier:
    def __init__(self) -> None:
        self.audits: list[tuple[int, int, bool, int | None, int | None]] = []
        self.flags: dict[int, list] = {}

    def record_audit(self, sender, step, *, passed, mb=None, boundary=None, direction=None):
        self.audits.append((sender, step, passed, mb, boundary))

    def add_flags(self, step, events):
        self.flags.setdefault(step, []).extend(events)


def _auditor(*, fp16: bool = False) -> SimpleNamespace:
    """Rank 3 auditing stage 1 (replica rank 1, microbatches 0-3) held: it verifies boundaries 0 and 1 both ways,
    ranks 0 and 2 trusted; every microbatch drawn."""
    st = audit_state.AuditedStage(stage=1, replicas=(1,), auditor=3, source=1, every=1)
    plan = SimpleNamespace(owner=lambda stage, mb: {0: 0, 1: 1, 2: 2}[stage],
                           ranks={r: SimpleNamespace(microbatches=(0, 1, 2, 3)) for r in range(3)})
    verifier = _Verifier()
    return SimpleNamespace(
        plan=plan, rank=3, step=5, unresolved={}, suspects=frozenset(), device=torch.device("cpu"),
        precision=SimpleNamespace(dtype=torch.float32), scaler=SimpleNamespace(scale=1.0) if fp16 else None,
        groups=SimpleNamespace(verifier_ranks=(3,)), verify=SimpleNamespace(verifier=verifier),
        _timed=lambda what: contextlib.nullcontext(),
        audits=audit_state.RuntimeAudits(stages={1: st}, copies={1: _Linear()}, trusted=frozenset({0, 2, 3}),
                                    schedules={1: audit.AuditSchedule(SECRET, 1)}))


def _observe(ex, mb: int, *, x: float, y: float, g: float, gin: float, x_dropped=False, g_dropped=False,
             gin_marked=False) -> None:
    """``mb``'s four tensors as the auditor checks them, in pipeline order: the input, the replica's output, the
    gradient sent to it, the one it sent upstream (``gin_marked``: with its taint header)."""
    def one(v: float) -> list[torch.Tensor]:
        return [torch.full((2,), float(v))]

    audit_verdicts.observe(ex, 0, "F", mb, 0, one(x), dropped=x_dropped)
    audit_verdicts.observe(ex, 1, "F", mb, 1, one(y), dropped=False, tainted=x_dropped)
    audit_verdicts.observe(ex, 1, "B", mb, 2, one(g), dropped=g_dropped)
    audit_verdicts.observe(ex, 0, "B", mb, 1, one(gin), dropped=gin_marked, tainted=gin_marked)


def _grad_verdicts(verifier: _Verifier) -> dict[int, bool]:
    """Microbatch -> whether its input gradient's audit passed (a pass names its tensor, a failure flags it)."""
    passed = {mb: True for _, _, ok, mb, boundary in verifier.audits if ok and boundary == 0}
    return passed | {e["mb"]: False for events in verifier.flags.values() for e in events if e["boundary"] == 0}


def test_a_held_input_gradient_marked_dropped_with_no_cause_fails_and_honest_drops_pass():
    ex = _auditor()
    _observe(ex, 0, x=1.0, y=2.0, g=3.0, gin=6.0)                               # honest, unmarked
    _observe(ex, 1, x=1.0, y=2.0, g=3.0, gin=6.0, gin_marked=True)              # honest values, made-up drop
    _observe(ex, 2, x=1.0, y=2.0, g=3.0, gin=0.0, g_dropped=True, gin_marked=True)   # its gradient dropped
    # zeros with no cause: held, the auditor is the verifier whose verdicts reach the replica, so none it did not
    # see exists: made up too (the replica would otherwise choose which gradients upstream loses)
    _observe(ex, 3, x=1.0, y=2.0, g=3.0, gin=0.0, gin_marked=True)
    verifier = ex.verify.verifier
    assert _grad_verdicts(verifier) == {0: True, 1: False, 2: True, 3: False}, verifier.audits
    assert [e["mb"] for e in verifier.flags[5]] == [1, 3]
    assert all(passed for *_, passed, _, _ in verifier.audits[::2]) and len(verifier.audits) == 8   # outputs honest
    assert not ex.audits.kept   # each audited as its last tensor came in


def test_a_held_input_gradient_marked_where_the_input_was_dropped_fails_nothing():
    ex = _auditor()
    # its input dropped: it computed on zeros and marked its output, which the trusted stage after drops, so the
    # gradient it was sent went tainted too
    _observe(ex, 0, x=1.0, y=0.0, g=3.0, gin=0.0, x_dropped=True, g_dropped=True, gin_marked=True)
    assert _grad_verdicts(ex.verify.verifier) == {0: True}


def test_under_fp16_input_gradients_audited_in_the_step_wait_for_the_overflow_vote():
    for overflowed in (False, True):
        ex = _auditor(fp16=True)
        _observe(ex, 0, x=1.0, y=2.0, g=3.0, gin=float("inf"))   # an overflow inside the replica's backward
        _observe(ex, 1, x=1.0, y=2.0, g=3.0, gin=6.0, gin_marked=True)   # a made-up drop
        verifier = ex.verify.verifier
        assert _grad_verdicts(verifier) == {}   # the outputs are judged, the input gradients wait
        assert len(verifier.audits) == 2 and len(ex.audits.in_step_grads) == 2
        audit_verdicts.settle_in_step_grads(ex, 5, overflowed=overflowed)
        assert _grad_verdicts(verifier) == ({} if overflowed else {0: False, 1: False})
        assert not ex.audits.in_step_grads
        assert len(verifier.flags.get(5, [])) == (0 if overflowed else 2)


def test_copies_and_held_audits_judge_a_marked_input_gradient_alike():
    kept = {(1, "g", 0): [torch.ones(2)], (1, "gin", 0): [torch.ones(2)]}
    audit_grads.judge_marked(kept, 1, 0, caused=True)
    assert sorted(kept) == [(1, "g", 0), (1, "gin", 0)]
    audit_grads.judge_marked(kept, 1, 0, caused=False)
    assert (1, audit_grads.FORGED, 0) in kept
    zeros = {(1, "g", 0): [torch.ones(2)], (1, "gin", 0): [torch.zeros(2)]}
    audit_grads.judge_marked(zeros, 1, 0, caused=False)
    torch.testing.assert_close(zeros[(1, "g", 0)][0], torch.zeros(2))
