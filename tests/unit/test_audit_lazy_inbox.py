"""The auditor's receive of an applied gradient never waits for its copy's last step (issue 37: the audits' fixed
per-step cost): two receive buffers used in turn, never the one the copy may still be stepping from."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import torch

from planner.runtime.rank import audit_copy, audit_state, audit_sync
from planner.runtime.rank.stage import ValueSpec


class _Runtime:
    def __init__(self):
        torch.manual_seed(0)
        self.module = torch.nn.Linear(3, 2)
        self.inputs = (ValueSpec(name="x", shape=(1, 3), dtype=torch.float32, carries_grad=True),)
        self.outputs = (ValueSpec(name="y", shape=(1, 2), dtype=torch.float32, carries_grad=True),)

    def parameters(self):
        return tuple(self.module.named_parameters())


class _Received:
    """A posted receive (``comm.Pending``) that a test fills: the source's message lands in the posted buffer."""

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer

    def completed(self) -> bool:
        return True

    def wait(self) -> list[torch.Tensor]:
        return [self.buffer]


def test_receives_alternate_buffers_and_never_wait_for_the_copys_step_still_running(monkeypatch):
    """Step after step the auditor posts its receive while the copy's last step, blocked on the stepper, still
    reads the buffer before: the receive goes to the other one, and the copy ends with both steps applied."""
    posted = []
    monkeypatch.setattr(audit_sync.dist, "P2POp", lambda op, tensor, peer, tag, group: tensor)
    monkeypatch.setattr(audit_sync.comm, "post", lambda ops, tensors, **kw: posted.append(tensors[0]) or _Received(tensors[0]))
    monkeypatch.setattr(audit_sync.control, "gather_to", lambda value, **kw: {1: torch.tensor([1, 0, 0, 0, 0]),
                                                                          0: value})
    st = audit_state.AuditedStage(stage=1, replicas=(1,), auditor=0, source=1, every=4)
    gate, started = threading.Event(), threading.Event()
    with ThreadPoolExecutor(max_workers=1) as stepper:
        runtime = _Runtime()
        start = [p.detach().clone() for _, p in runtime.parameters()]
        copy = audit_copy.StageCopy(runtime=runtime, optimizer=torch.optim.SGD(runtime.module.parameters(), lr=1.0),
                                    stepper=stepper)
        stepper.submit(lambda: started.set() or gate.wait(10.0))   # the stepper busy: the copy's steps queue
        started.wait(5.0)
        state = audit_state.RuntimeAudits(stages={1: st}, copies={1: copy})
        ex = SimpleNamespace(audits=state, rank=0, device=torch.device("cpu"), verify=None)
        for step, value in enumerate((1.0, 2.0)):
            audit_sync.post_hearing(ex, step)   # would hang on ``settle`` with one buffer: the stepper is blocked
            assert copy.pending is None or not copy.pending.done()   # step 0's step still queued behind the gate
            posted[-1].fill_(value)   # the source's gradient lands: every value, then the presence flags
            posted[-1][-len(copy.params):] = 1.0
            if step == 1:
                gate.set()   # step 1's ``step_later`` waits for step 0's, as ever
            audit_sync._sync_copy(ex, st, step)
        audit_sync.post_hearing(ex, 2)
        assert posted[0] is not posted[1] and posted[2] is posted[0]
        copy.settle()
    for (_, p), p0 in zip(runtime.parameters(), start):
        assert torch.equal(p.detach(), p0 - 1.0 - 2.0)   # SGD at lr 1: the two gradients stepped, in order


def test_the_inbox_after_a_step_not_taken_is_the_one_just_filled_again():
    state = audit_state.RuntimeAudits(stages={})
    first = audit_sync._free_inbox(state, 1, 4, torch.device("cpu"))
    state.stepped_from[1] = state.filling[1]
    second = audit_sync._free_inbox(state, 1, 4, torch.device("cpu"))
    assert second is not first
    # no step from ``second`` (the replicas took none): the copy may still read ``first``, so ``second`` again
    assert audit_sync._free_inbox(state, 1, 4, torch.device("cpu")) is second


def test_the_planner_counts_both_receive_buffers_in_the_auditors_memory():
    from planner.solver.audits import APPLIED_GRADIENT_BYTES_PER_PARAM

    state, size = audit_state.RuntimeAudits(stages={}), 1000
    for last in (1, 0, 1, 0):   # the copy stepped from one buffer, then the other: the receives alternate
        state.stepped_from[3] = last
        audit_sync._free_inbox(state, 3, size, torch.device("cpu"))
    held = sum(box.numel() * box.element_size() for box in state.inboxes[3])
    assert held == APPLIED_GRADIENT_BYTES_PER_PARAM * size
