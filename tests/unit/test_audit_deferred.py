"""A step's audits recomputed during the next step (issue 37: the recompute off the verdict path,
``runtime.rank.audit_recompute``): on the copy's stepper, at the audited step's weights although the copy's step is
queued at once, the caller never waiting; the verdict a step late still bans, from the audited step on; a step that
writes a checkpoint or ends the run audits in line."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
import torch

from planner.errors import InvalidInputError
from planner.integrity import audit
from planner.integrity.blame import FLAG_EVENTS_SCHEMA, proven
from planner.integrity.verifier import Verifier
from planner.runtime.rank import (
    audit_copy,
    audit_recompute,
    audit_state,
    audit_verdicts,
)
from planner.runtime.rank.stage import ValueSpec
from planner.verifier_config import VerifierConfig


class _Stage(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(6, 3)

    def forward(self, x):
        return (self.net(x),)


class _Runtime:
    def __init__(self):
        torch.manual_seed(0)
        self.module = _Stage()
        self.inputs = (ValueSpec(name="x", shape=(4, 6), dtype=torch.float32, carries_grad=True),)
        self.outputs = (ValueSpec(name="y", shape=(4, 3), dtype=torch.float32, carries_grad=True),)

    def parameters(self):
        return tuple(self.module.named_parameters())


class _Precision:
    def autocast(self, device):
        return torch.autocast("cpu", enabled=False)

    def to_wire(self, outputs):
        return outputs


def _kept(x, y):
    return {"x": [x], "y": [y], "g": None, "gin": None}


def test_a_deferred_recompute_sees_the_audited_steps_weights_and_the_caller_never_waits():
    """The stepper busy (the pipeline's fill): the recompute and then the copy's step queue behind it without the
    caller waiting; the honest output passes and the damped one fails, both against the weights before the step."""
    gate = threading.Event()
    with ThreadPoolExecutor(max_workers=1) as stepper:
        runtime = _Runtime()
        copy = audit_copy.StageCopy(runtime=runtime, optimizer=torch.optim.SGD(runtime.module.parameters(), lr=1.0),
                                    stepper=stepper)
        x = torch.randn(4, 6)
        with torch.no_grad():
            honest = runtime.module(x)[0].clone()
        stepper.submit(gate.wait, 10.0)
        taken = {0: _kept(x, honest), 1: _kept(x, 0.5 * honest)}
        deferred = audit_recompute.defer(copy, taken, stage=1, step=7, owner=lambda mb: 3 + mb,
                                         precision=_Precision(), device=torch.device("cpu"), tolerance=0.01)
        copy.step_later(torch.cat([torch.ones(copy.flat_size - 2), torch.ones(2)]))   # queued: no wait
        assert deferred is not None and not deferred.outcomes.done()
        gate.set()
        outcomes = deferred.outcomes.result(timeout=10.0)
        copy.settle()
    assert [(o.sender, o.step, o.passed) for o in outcomes] == [(3, 7, True), (4, 7, False)]
    assert outcomes[1].event is not None and outcomes[1].event["mb"] == 1
    with torch.no_grad():   # the copy did step after the recompute
        assert not torch.allclose(runtime.module(x)[0], honest)


def test_a_late_verdict_bans_from_the_audited_step():
    failed = audit.audit_event(step=12, mb=2, boundary=1, direction="act", sender=1, error=0.4, tolerance=0.01)
    late = audit.late_audit_event(failed, at_step=13)
    jsonschema.validate([late], FLAG_EVENTS_SCHEMA)
    assert (late["step"], late["since"], late["mb"], late["scope"]) == (13, 12, -1, "step")
    assert proven([late]) == {1}
    with pytest.raises(InvalidInputError):
        audit.late_audit_event(failed, at_step=11)
    verifier = Verifier(VerifierConfig().to_dict(), [(0, "grad"), (1, "act")], stage_of={1: 1, 2: 2},
                        microbatches={1: 1, 2: 1})
    audit_recompute.record(verifier, [audit_recompute.Outcome(sender=1, step=12, passed=False, event=failed)],
                           at_step=13)
    assert verifier.audit_ledger.failed[1] == {12}
    assert verifier.end_step(13, [verifier.flag_events(13)]) == {1}
    assert verifier.ban_records()[1] == (12, 13)   # recovery sets aside the checkpoints from step 12 on


def test_a_rank_says_which_step_its_audits_are_still_out_from():
    from concurrent.futures import Future
    from types import SimpleNamespace

    state = audit_state.RuntimeAudits(stages={})
    ex = SimpleNamespace(audits=state)
    assert audit_verdicts.unaudited_since(ex) is None and audit_verdicts.unaudited_since(SimpleNamespace()) is None
    state.deferred = {1: audit_recompute.Deferred(step=5, outcomes=Future()),
                      2: audit_recompute.Deferred(step=4, outcomes=Future())}
    assert audit_verdicts.unaudited_since(ex) == 4


def test_steps_that_write_a_checkpoint_or_end_the_run_audit_in_line():
    state = audit_state.RuntimeAudits(stages={}, last_step=9, checkpoint_every=4)
    assert [s for s in range(10) if state.inline_at(s)] == [3, 7, 9]
    assert [s for s in range(10) if audit_state.RuntimeAudits(stages={}, last_step=9).inline_at(s)] == [9]
    assert audit_state.RuntimeAudits(stages={}).inline_at(0)   # nothing known of the run: in line, as ever
