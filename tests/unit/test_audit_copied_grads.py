"""Gradients audited from copies (issue 37, ``planner.runtime.rank.audit_grads``): the rule (the stage after trusted,
else outputs only), which microbatches the trusted ranks on either side keep (the auditor's shared schedule, the
suspects every rank hears alike), what the copies carry (the input gradient as received, its taint flag, fp16's
loss scale out), what the auditor keeps of them, and the price (the extra bytes, the backward recompute)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cost_models.audit import AuditCost, copied_input_bytes, copy_ms
from cost_models.cluster import Link
from planner.integrity import audit
from planner.runtime.rank import (
    audit_contrib,
    audit_grads,
    audit_inputs,
    audit_recompute,
    audit_state,
)
from planner.solver.audit_price import (
    AuditWhere,
    audit_rule,
    copied_message_bytes,
    with_copied_grads,
)

SECRET = bytes(range(16))
NEVER = 10 ** 6
# stage 1 on replicas 1 (mbs 0-3) and 2 (4-7); stage 0 on rank 0, stage 2 on rank 3, the auditor rank 4
OWNERS = {**{mb: 1 for mb in range(4)}, **{mb: 2 for mb in range(4, 8)}}
SPEC = SimpleNamespace(shape=(2,), dtype=torch.float32, carries_grad=True)


def _rule(downstream_trusted: bool = True, upstream=("t0",), checks=((1, "act"),)):
    trusted = {"t0", "v"} | ({"t2"} if downstream_trusted else set())
    return audit_rule(stage=1, num_stages=3, replicas=("u1", "u2"), upstream=upstream, downstream=("t2",),
                      trusted=trusted, auditor="v", auditor_checks=checks, codecs=("none", "none"))


def test_gradients_come_copied_only_where_the_stage_after_is_trusted():
    assert _rule() == AuditWhere(auditor="v", source="u1", grads=False, copied_from=("t0",), grads_from=("t2",))
    # an untrusted stage after could send the auditor another gradient than the replica's: outputs only, as before
    assert _rule(downstream_trusted=False) == AuditWhere(auditor="v", source="u1", grads=False, copied_from=("t0",))
    # held (the auditor verifies both boundaries) or signed inputs: no copied gradients
    held = _rule(checks=((0, "act"), (0, "grad"), (1, "act"), (1, "grad")))
    assert held.grads and not held.grads_from
    assert not _rule(upstream=("u9",)).grads_from


def _plan() -> SimpleNamespace:
    ranks = {r: SimpleNamespace(microbatches=tuple(range(8))) for r in (0, 3)}
    ranks |= {1: SimpleNamespace(microbatches=(0, 1, 2, 3)), 2: SimpleNamespace(microbatches=(4, 5, 6, 7))}
    return SimpleNamespace(owner=lambda stage, mb: OWNERS[mb] if stage == 1 else (0 if stage == 0 else 3),
                           ranks=ranks)


def _stage() -> audit_state.AuditedStage:
    return audit_state.AuditedStage(stage=1, replicas=(1, 2), auditor=4, source=1, every=NEVER, copied_from=(0,),
                               grads_from=(3,))


def _rank(rank: int, stage: int, *, suspects=frozenset(), scale: float | None = None, taint=None):
    """A trusted rank of ``stage`` (0 upstream, 2 downstream) holding the auditor's shared schedule of stage 1;
    replica 2 a suspect by default of the draw (one in a million): every one of its microbatches is kept."""
    sent = {mb: [torch.full((2,), float(mb))] for mb in range(8)}
    return SimpleNamespace(
        plan=_plan(), rank=rank, step=5, unresolved={}, suspects=suspects, info=SimpleNamespace(stage=stage),
        stage=SimpleNamespace(outputs=(SPEC,)), scaler=None if scale is None else SimpleNamespace(scale=scale),
        taint_in=taint or {}, device=torch.device("cpu"),
        audits=audit_state.RuntimeAudits(stages={1: _stage()}, sharing={1: audit.AuditSchedule(SECRET, NEVER)}),
        _delivered=lambda d, mb: [t * (10.0 if d == "B" else 1.0) for t in sent[mb]])


def test_the_stage_after_keeps_the_gradients_it_sends_the_audited_microbatches_unscaled():
    down = _rank(3, 2, suspects=frozenset({2}), scale=1024.0)
    for mb in range(8):
        audit_grads.keep_sent_grad(down, mb)
    assert sorted(mb for _, mb in down.audits.grad_outbox) == [4, 5, 6, 7]
    # kept as a reference with the scale in force (no copy before the send), unscaled in the step's-end message
    tensors, tainted, scale = down.audits.grad_outbox[(1, 5)]
    assert (tainted, scale) == (False, 1024.0)
    torch.testing.assert_close(tensors[0], torch.full((2,), 50.0))
    grad, flag = audit_grads.grad_parts(down.audits, _stage(), 5)
    torch.testing.assert_close(grad, torch.full((2,), 50.0 / 1024.0))
    assert float(flag) == 0.0
    # the auditor names the same microbatches for this sender (its schedule from the same key)
    auditor = SimpleNamespace(plan=down.plan, rank=4, step=5, unresolved={}, suspects=frozenset({2}),
                              audits=audit_state.RuntimeAudits(stages={1: _stage()},
                                                          schedules={1: audit.AuditSchedule(SECRET, NEVER)}))
    heard = audit_inputs.copied_mbs(auditor.plan, auditor.audits.schedules[1], _stage(), 3, 5,
                                    audit_inputs.agreed_suspects(auditor))
    assert heard == [4, 5, 6, 7]
    # nothing kept where no sender is suspected and the draw picks none; and no gradient outside a copies stage
    quiet = _rank(3, 2)
    for mb in range(8):
        audit_grads.keep_sent_grad(quiet, mb)
    assert quiet.audits.grad_outbox == {}


def test_the_stage_before_copies_the_input_gradients_as_received_with_their_taint():
    up = _rank(0, 0, suspects=frozenset({1}), taint={("B", 2): True}, scale=4.0)
    for mb in range(8):
        audit_inputs.keep_input_copy(up, mb)
    # nothing made as the input leaves (no audited send slower than another): the gradient's place comes later
    assert sorted(mb for _, mb in up.audits.outbox) == [0, 1, 2, 3] and up.audits.gin_outbox == {}
    for mb in range(1, 8):   # mb 0's never came (the run stopped): zeros, flagged, in the message
        audit_grads.keep_received_grad(up, mb, [torch.full((2,), -4.0 * mb)])
    assert sorted(mb for _, mb in up.audits.gin_outbox) == [1, 2, 3]
    assert [up.audits.gin_outbox[(1, mb)][1] for mb in (1, 2, 3)] == [False, True, False]
    # one copy a microbatch: its input, the input gradient (unscaled now), the taint flag; in the auditor's shapes
    st = _stage()
    parts = [t for mb in (0, 1, 2) for t in audit_inputs.message_parts(up, st, mb)]
    flat = torch.cat([t.reshape(-1).float() for t in parts])
    copy = SimpleNamespace(runtime=SimpleNamespace(inputs=(SPEC,), outputs=(SPEC,)))
    specs = [SPEC, *audit_inputs._gradient_specs(copy, st)]
    none, one, two = audit_inputs.unflatten(flat, specs, 3)
    torch.testing.assert_close(none[1], torch.zeros(2))
    torch.testing.assert_close(one[0], torch.full((2,), 1.0))
    torch.testing.assert_close(one[1], torch.full((2,), -1.0))
    assert float(none[2]) == 1.0 and float(one[2]) == 0.0 and float(two[2]) == 1.0


def _auditor_hearing(gin: dict, grads: dict) -> dict:
    """The auditor running both neighbours (each copy its own, no message): inputs and input gradients (mb ->
    (value, tainted)) from the stage before, the gradients sent (mb -> (value, tainted)) from the stage after,
    for the outputs it kept (mbs 0-3); what it keeps of them."""
    st = audit_state.AuditedStage(stage=1, replicas=(1, 2), auditor=4, source=1, every=NEVER, copied_from=(4,),
                             grads_from=(4,))
    schedule = audit.AuditSchedule(SECRET, NEVER)
    plan = _plan()
    plan.ranks[4] = SimpleNamespace(microbatches=tuple(range(8)))
    copy = SimpleNamespace(runtime=SimpleNamespace(inputs=(SPEC,), outputs=(SPEC,)))
    ex = SimpleNamespace(plan=plan, rank=4, step=5, unresolved={}, suspects=frozenset({1}), device=torch.device("cpu"),
                         stage=SimpleNamespace(outputs=(SPEC,)),
                         audits=audit_state.RuntimeAudits(stages={1: st}, schedules={1: schedule}, copies={1: copy}))
    for mb in (0, 1, 2, 3):
        ex.audits.kept[(1, "y", mb)] = [torch.zeros(2)]
        ex.audits.outbox[(1, mb)] = [torch.full((2,), float(mb))]
        ex.audits.gin_outbox[(1, mb)] = ([torch.full((2,), gin[mb][0])], gin[mb][1], None)
        ex.audits.grad_outbox[(1, mb)] = ([torch.full((2,), grads[mb][0])], grads[mb][1], None)
    audit_inputs.hear_inputs(ex, st, 5)
    audit_grads.hear_grads(ex, st, 5)
    return ex.audits.kept


def test_the_auditor_compares_every_input_gradient_whatever_the_replicas_taint_header_says():
    # mb 1: the stage after sent its gradient tainted (the replica dropped it honestly: zeros, marked); mb 2: marked,
    # zeros, with no sign the auditor sees (a verifier's verdict elsewhere dropped its gradient); mb 3: marked, not
    # zeros, no cause: a drop the replica made up
    kept = _auditor_hearing(gin={0: (-1.0, False), 1: (0.0, True), 2: (0.0, True), 3: (-3.0, True)},
                            grads={0: (10.0, False), 1: (0.0, True), 2: (20.0, False), 3: (30.0, False)})
    assert sorted(mb for k, role, mb in kept if role == "x") == [0, 1, 2, 3]
    assert sorted(mb for k, role, mb in kept if role == "gin") == [0, 1, 2, 3]   # none left out for its header
    assert sorted(mb for k, role, mb in kept if role == "g") == [0, 1, 2, 3]
    torch.testing.assert_close(kept[(1, "g", 0)][0], torch.full((2,), 10.0))
    # recomputed on a zero gradient where it was dropped (by the stage after, or where the replica's zeros say so)
    torch.testing.assert_close(kept[(1, "g", 1)][0], torch.zeros(2))
    torch.testing.assert_close(kept[(1, "g", 2)][0], torch.zeros(2))
    torch.testing.assert_close(kept[(1, "g", 3)][0], torch.full((2,), 30.0))
    assert sorted(mb for k, role, mb in kept if role == audit_grads.FORGED) == [3]


def test_an_honest_replicas_marked_input_gradient_fails_no_audit_and_a_made_up_one_fails():
    """Recomputed on a linear stage (y = 2x): the honest drops (the gradient it was sent tainted, or zeros with no
    sign) pass, the made-up one fails, and every microbatch's backward runs (its contribution complete)."""
    kept = _auditor_hearing(gin={0: (-1.0, False), 1: (0.0, True), 2: (0.0, True), 3: (60.0, True)},
                            grads={0: (-0.5, False), 1: (0.0, True), 2: (20.0, False), 3: (30.0, False)})
    kept[(1, "y", 0)] = [torch.zeros(2)]
    for mb in (1, 2, 3):
        kept[(1, "y", mb)] = [torch.full((2,), 2.0 * mb)]

    class Linear:
        drifts = False

        def forward(self, xs, precision, device, *, grad, settle):
            ins = [x.clone().requires_grad_(grad) for x in xs]
            return ins, [2.0 * ins[0]]

        def grads(self, ins, outs, gs, *, params):
            (g,) = torch.autograd.grad(outs, ins, gs)
            return [g], torch.ones(1)

    sums = audit_contrib.ContribSums(stage=1, step=5, owned={1: frozenset({0, 1, 2, 3})})
    taken = audit_recompute.take_kept(kept, 1)
    out = audit_recompute.recompute(Linear(), taken, stage=1, step=5, owner=lambda mb: 1, precision=None,
                                           device=torch.device("cpu"), tolerance=1e-3, contrib=sums)
    grads = {o.mb: o.passed for o in out if o.boundary == 0}
    assert grads == {0: True, 1: True, 2: True, 3: False}, out
    assert sums.complete(1)


def test_the_price_adds_the_gradients_bytes_and_the_backward_recompute():
    link = Link(bandwidth_gbps=1.0, latency_ms=0.5)
    outputs_only = AuditCost(recompute_ms=8.0, gradient_ms=2.0, digest_ms=0.5, optim_ms=0.1, copy_ms=1.0,
                             copied=True, deferred=True)
    cost = with_copied_grads(outputs_only, every=4, microbatches=8, backward_ms=3.0, input_bytes=2**16,
                             output_bytes=2**15, elem_bytes=2, verifier_mem_bw_bytes_per_s=1e10,
                             upstream=((link, 8), (None, 8)), downstream=((link, 8),))
    up, down = copied_message_bytes(2**16, 2**15, 2, grads=True)
    assert (up, down) == (2 * copied_input_bytes(2**16, 2) + 4, copied_input_bytes(2**15, 2) + 4)   # a flag each
    assert cost.copy_ms == pytest.approx(copy_ms(every=4, sent_microbatches=8, input_bytes=up, link=link)
                                         + copy_ms(every=4, sent_microbatches=8, input_bytes=down, link=link))
    assert cost.recompute_ms == pytest.approx(8.0 + 8 / 4 * (3.0 + 1e3 * 3 * 2**16 / 1e10))
    assert cost.deferred and not cost.during_step and cost.optim_ms == 0.1


def test_a_step_the_overflow_vote_skipped_compares_no_input_gradient():
    """An overflow inside the audited stage's backward gives the honest replica infinities its copy may not have:
    on a step the vote skipped, its input gradients (and made-up drops) leave the audits; outputs stay."""
    from planner.runtime.rank.precision import LossScaler
    scaler = LossScaler()
    ex = SimpleNamespace(scaler=scaler, audits=audit_state.RuntimeAudits(stages={}))
    scaler.update(False)
    assert not audit_grads.overflow_skipped(ex)   # the first step: a clean vote
    scaler.update(True)
    assert audit_grads.overflow_skipped(ex)
    scaler.update(False)
    assert not audit_grads.overflow_skipped(ex)
    assert not audit_grads.overflow_skipped(SimpleNamespace(scaler=None))   # fp32: never
    resumed = SimpleNamespace(scaler=LossScaler(skipped=3, good_steps=0), audits=audit_state.RuntimeAudits(stages={}))
    assert audit_grads.overflow_skipped(resumed)   # resumed, the first vote overflowed
    kept = {(1, "y", 0): [torch.zeros(1)], (1, "gin", 0): [torch.zeros(1)], (1, audit_grads.FORGED, 2): [],
            (2, "gin", 0): [torch.zeros(1)]}
    audit_grads.drop_input_grads(kept, 1)
    assert sorted(kept) == [(1, "y", 0), (2, "gin", 0)]


def test_a_made_up_drops_late_verdict_names_the_drop_its_step_recorded_with_no_sender():
    from planner.integrity.drops import TAINTED_BY_SENDER
    from planner.integrity.hooks import VerifyHooks
    blank = {"microbatch": None, "boundary": None, "direction": None, "sender": None, "reason": TAINTED_BY_SENDER}
    hooks = SimpleNamespace(drops=[{"step": 4, **blank}, {"step": 5, **blank}, {"step": 5, **blank}])
    hooks.name_drop = lambda *a, **kw: VerifyHooks.name_drop(hooks, *a, **kw)
    verifier = SimpleNamespace(record_audit=lambda *a, **kw: None, add_flags=lambda *a: None)
    forged = audit_recompute.Outcome(sender=1, step=5, passed=False, event={"step": 5, "mb": 3}, mb=3,
                                            boundary=0, forged=True)
    other = audit_recompute.Outcome(sender=2, step=5, passed=False, event={"step": 5, "mb": 6}, mb=6,
                                           boundary=0)
    audit_recompute.record(verifier, [forged, other], at_step=6, hooks=hooks)
    assert [d["sender"] for d in hooks.drops] == [None, 1, None]
    assert (hooks.drops[1]["microbatch"], hooks.drops[1]["boundary"]) == (3, 0)
    # in line (the audited step's own verdict) its microbatch flag names it: nothing renamed
    audit_recompute.record(verifier, [forged], at_step=5, hooks=hooks)
    assert [d["sender"] for d in hooks.drops] == [None, 1, None]
