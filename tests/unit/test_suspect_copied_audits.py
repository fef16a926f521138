"""Suspects audited from copies (issue 37): the senders the last step's verdict left unresolved or named suspects
(``ex.unresolved``, ``ex.suspects``: the same on every rank) are audited on every microbatch where the inputs come
copied or signed, and the upstream rank that copies them and the auditor that hears them name the same
microbatches (``audit_inputs.agreed_suspects``, read once a step)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from planner.integrity import audit
from planner.runtime.rank import audit_inputs, audit_state, audit_verdicts

SECRET = bytes(range(16))
NEVER = 10 ** 6
# stage 1 on replicas 1 and 3, four microbatches each (0-3 on 1, 4-7 on 3); stage 0 on rank 0, the auditor rank 2
OWNERS = {**{mb: 1 for mb in range(4)}, **{mb: 3 for mb in range(4, 8)}}


def _plan() -> SimpleNamespace:
    ranks = {0: SimpleNamespace(microbatches=tuple(range(8))), 1: SimpleNamespace(microbatches=(0, 1, 2, 3)),
             3: SimpleNamespace(microbatches=(4, 5, 6, 7))}
    return SimpleNamespace(owner=lambda stage, mb: 0 if stage == 0 else OWNERS[mb], ranks=ranks)


def _ranks(step: int, unresolved: dict[int, int], *, suspects: frozenset[int] = frozenset(),
           signed: bool = False) -> tuple[SimpleNamespace, SimpleNamespace, audit_state.AuditedStage]:
    """The upstream rank 0 (copies stage 1's inputs) and the auditor rank 2, both told ``unresolved`` and
    ``suspects``."""
    st = audit_state.AuditedStage(stage=1, replicas=(1, 3), auditor=2, source=1, every=NEVER,
                             copied_from=(1, 3) if signed else (0,), signed_by=(0,) if signed else ())
    plan, schedule = _plan(), audit.AuditSchedule(SECRET, NEVER)
    upstream = SimpleNamespace(plan=plan, rank=0, step=step, unresolved=dict(unresolved), suspects=suspects,
                               stage=object(),
                               info=SimpleNamespace(stage=0), audits=audit_state.RuntimeAudits(
                                   stages={1: st}, sharing={1: schedule}),
                               _delivered=lambda d, mb: [torch.full((2,), float(mb))])
    auditor = SimpleNamespace(plan=plan, rank=2, step=step, unresolved=dict(unresolved), suspects=suspects,
                              audits=audit_state.RuntimeAudits(stages={1: st}, schedules={1: schedule}))
    return upstream, auditor, st


def test_a_sender_left_unresolved_has_all_its_microbatches_copied_and_audited():
    upstream, auditor, st = _ranks(8, {1: 6})
    for mb in range(8):
        audit_inputs.keep_input_copy(upstream, mb)
    # the upstream rank keeps, and would send, all of replica 1's inputs and none of replica 3's (a draw of 1e-6)
    assert sorted(mb for _, mb in upstream.audits.outbox) == [0, 1, 2, 3]
    sent = audit_inputs.copied_mbs(upstream.plan, upstream.audits.sharing[1], st, 0, 8,
                                   audit_inputs.agreed_suspects(upstream))
    heard = audit_inputs.copied_mbs(auditor.plan, auditor.audits.schedules[1], st, 0, 8,
                                    audit_inputs.agreed_suspects(auditor))
    assert sent == heard == [0, 1, 2, 3]
    # and the auditor keeps those outputs for the audit
    assert [mb for mb in range(8) if audit_verdicts._audited(auditor, st, mb)] == [0, 1, 2, 3]


def test_nothing_unresolved_leaves_the_draw_alone():
    upstream, auditor, st = _ranks(8, {})
    for mb in range(8):
        audit_inputs.keep_input_copy(upstream, mb)
    assert upstream.audits.outbox == {}
    assert not any(audit_verdicts._audited(auditor, st, mb) for mb in range(8))


def test_a_suspect_the_verdict_names_is_copied_and_audited_as_an_unresolved_one_is():
    # an alert of step 7 named replica 3 (blaming nobody): the verdict names it, so the upstream rank copies too
    upstream, auditor, st = _ranks(8, {}, suspects=frozenset({3}))
    for mb in range(8):
        audit_inputs.keep_input_copy(upstream, mb)
    assert sorted(mb for _, mb in upstream.audits.outbox) == [4, 5, 6, 7]
    assert [mb for mb in range(8) if audit_verdicts._audited(auditor, st, mb)] == [4, 5, 6, 7]


def test_signed_inputs_the_auditor_keeps_every_output_it_asks_the_suspect_for():
    _, auditor, st = _ranks(8, {3: 2}, signed=True)
    kept = [mb for mb in range(8) if audit_verdicts._audited(auditor, st, mb)]
    asked = [mb for r in st.replicas for mb in audit_inputs.copied_mbs(
        auditor.plan, auditor.audits.schedules[1], st, r, 8, audit_inputs.agreed_suspects(auditor))]
    assert kept == asked == [4, 5, 6, 7]


def test_the_suspects_are_read_once_a_step_so_both_ends_name_the_same_microbatches():
    upstream, _, _ = _ranks(8, {1: 6})
    audit_inputs.keep_input_copy(upstream, 0)
    upstream.unresolved = {}   # changed within the step (it never is; the step's end reads what its start read)
    assert audit_inputs.agreed_suspects(upstream) == {1}
    upstream.step = 9   # the next step reads the verdict anew
    assert audit_inputs.agreed_suspects(upstream) == frozenset()
