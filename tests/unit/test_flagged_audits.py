"""A flag or alert costs an audit: the senders a step's flags name (alerts and lone microbatch flags included,
which blame nobody) are audited on every microbatch of the next step (``audit.flagged_senders``): the lead
verifier names them in the step's verdict (``executor_verify._suspects``, with the contributions' suspects), and
the runtime's auditor (``audit_verdicts._audited``) audits them, from copies too, as the twins benchmark does."""
from __future__ import annotations

from types import SimpleNamespace

from planner.integrity import audit
from planner.runtime.rank import audit_state, audit_verdicts
from planner.runtime.rank.executor_verify import Verification

SECRET = bytes(range(16))


def _flag(step: int, sender: int, *, mb: int = -1, reasons: tuple[str, ...] = ("spectral",), **extra) -> dict:
    return {"type": "flag", "step": step, "mb": mb, "boundary": 1, "direction": "act", "sender": sender,
            "scope": "step" if mb < 0 else "microbatch", "scores": {r: 2.0 for r in reasons},
            "fences": {r: 1.0 for r in reasons}, "reasons": list(reasons), **extra}


def test_every_sender_a_flag_names_is_a_suspect_alerts_and_upstream_inputs_included():
    flags = [_flag(7, 1), _flag(7, 2, mb=3, reasons=("link",), upstream=0)]
    assert audit.flagged_senders(flags) == {0, 1, 2}
    assert audit.flagged_senders([{"type": "ban", "step": 7, "sender": 3}]) == set()
    assert audit.flagged_senders([]) == set()


def test_the_lead_names_every_verifiers_flagged_senders_and_the_suspect_contributions():
    contrib = SimpleNamespace(suspects=lambda stage: {5} if stage == 2 else set())
    lead = SimpleNamespace(plan=SimpleNamespace(num_stages=3), _contributions=contrib)
    # one list per verifier rank, as the exchange returns them
    assert Verification._suspects(lead, [[_flag(7, 1)], [_flag(7, 2, mb=0, upstream=0)]]) == {0, 1, 2, 5}
    assert Verification._suspects(SimpleNamespace(plan=lead.plan), [[], []]) == frozenset()


def _auditor(step: int, suspects: frozenset[int], *, copied_from: tuple[int, ...] = ()) -> tuple[SimpleNamespace, audit_state.AuditedStage]:
    """An auditor of stage 1 (replicas 1 and 3, one microbatch each: 0 and 1) at ``step``, told ``suspects`` by the
    step before's verdict, with nothing unresolved."""
    st = audit_state.AuditedStage(stage=1, replicas=(1, 3), auditor=2, source=1, every=10 ** 6, copied_from=copied_from)
    owners = {0: 1, 1: 3}
    plan = SimpleNamespace(owner=lambda stage, mb: owners[mb],
                           ranks={1: SimpleNamespace(microbatches=(0,)), 3: SimpleNamespace(microbatches=(1,))})
    state = audit_state.RuntimeAudits(stages={1: st}, schedules={1: audit.AuditSchedule(SECRET, 10 ** 6)})
    return SimpleNamespace(plan=plan, audits=state, step=step, unresolved={}, suspects=suspects), st


def test_the_runtime_auditor_audits_every_microbatch_of_a_sender_the_verdict_named():
    ex, st = _auditor(8, frozenset({1}))
    # one in a million drawn: only the alert of step 7 on replica 1 makes its microbatch of step 8 audited
    assert audit_verdicts._audited(ex, st, 0)
    assert not audit_verdicts._audited(ex, st, 1)
    ex.step, ex.suspects = 9, frozenset()   # no flag in step 8: the draw alone again
    assert not audit_verdicts._audited(ex, st, 0)


def test_a_suspect_is_audited_where_the_inputs_come_copied_too():
    ex, st = _auditor(8, frozenset({1}), copied_from=(0,))
    assert audit_verdicts._audited(ex, st, 0)


def test_the_suspects_are_read_once_a_step():
    ex, st = _auditor(8, frozenset({1}))
    assert audit_verdicts._audited(ex, st, 0)
    ex.suspects = frozenset({3})   # read already this step: both ends keep what the step's start read
    assert not audit_verdicts._audited(ex, st, 1)
