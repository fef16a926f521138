"""A flag or alert costs an audit: the senders a step's flags name (alerts and lone microbatch flags included,
which blame nobody) are audited on every microbatch of the next step (``audit.flagged_senders``), in the runtime
(``audits._audited``) as in the twins benchmark."""
from __future__ import annotations

from types import SimpleNamespace

from planner.integrity import audit
from planner.runtime.rank import audits

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


def test_the_log_is_read_for_its_step_only():
    log = [_flag(4, 3), _flag(5, 1), {"type": "ban", "step": 5, "sender": 2}, _flag(6, 3, mb=0)]
    assert audit.flagged_at(log, 5) == {1}
    assert audit.flagged_at(log, 6) == {3}
    assert audit.flagged_at(log, 4) == {3}
    assert audit.flagged_at(log, 3) == set()


def _auditor(step: int, events: list[dict], *, copied_from: tuple[int, ...] = ()) -> tuple[SimpleNamespace, audits.AuditedStage]:
    """An auditor of stage 1 (replicas 1 and 3, one microbatch each: 0 and 1) at ``step``, its verifier's log
    ``events``, with nothing unresolved and no contribution monitor."""
    st = audits.AuditedStage(stage=1, replicas=(1, 3), auditor=2, source=1, every=10 ** 6, copied_from=copied_from)
    owners = {0: 1, 1: 3}
    plan = SimpleNamespace(owner=lambda stage, mb: owners[mb],
                           ranks={1: SimpleNamespace(microbatches=(0,)), 3: SimpleNamespace(microbatches=(1,))})
    state = audits.RuntimeAudits(stages={1: st}, schedules={1: audit.AuditSchedule(SECRET, 10 ** 6)})
    ex = SimpleNamespace(plan=plan, audits=state, step=step, unresolved={},
                         verify=SimpleNamespace(verifier=SimpleNamespace(events=events)))
    return ex, st


def test_the_runtime_auditor_audits_every_microbatch_of_a_sender_its_flags_named_the_step_before():
    ex, st = _auditor(8, [_flag(7, 1)])
    # one in a million drawn: only the alert of step 7 on replica 1 makes its microbatch of step 8 audited
    assert audits._audited(ex, st, 0)
    assert not audits._audited(ex, st, 1)
    ex.step = 9   # no flag in step 8: the draw alone again
    assert not audits._audited(ex, st, 0)


def test_no_suspicion_audit_where_the_inputs_come_copied():
    # from copies the upstream ranks know only the schedule: a suspect's other microbatches have no input there
    ex, st = _auditor(8, [_flag(7, 1)], copied_from=(0,))
    assert not audits._audited(ex, st, 0)


def test_the_log_is_read_once_a_step():
    events = [_flag(7, 1)]
    ex, st = _auditor(8, events)
    assert audits._audited(ex, st, 0)
    events.append(_flag(7, 3))   # read already this step: the auditor does not rescan the log per microbatch
    assert not audits._audited(ex, st, 1)
