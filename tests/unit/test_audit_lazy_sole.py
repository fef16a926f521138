"""A sole replica's applied gradient is off the step's end (issue 37): the auditor judges its report without the
tensor, its copy steps on the stepper once the gradient is in, and the source waits for its send only before it
rewrites the buffer; the price (``cost_models.audit``) says so."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from cost_models.audit import audit_ms
from cost_models.cluster import Link
from planner.runtime.rank import audit_copy, audit_state, audit_sync, audits
from planner.runtime.rank.stage import ValueSpec


class _Stage(torch.nn.Linear):
    def forward(self, x):
        return (super().forward(x),)   # a stage's outputs: a tuple


class _Runtime:
    def __init__(self):
        torch.manual_seed(0)
        self.module = _Stage(3, 2)
        self.inputs = (ValueSpec(name="x", shape=(1, 3), dtype=torch.float32, carries_grad=True),)
        self.outputs = (ValueSpec(name="y", shape=(1, 2), dtype=torch.float32, carries_grad=True),)

    def parameters(self):
        return tuple(self.module.named_parameters())


class _Travelling:
    """A posted receive whose message lands when the test says (``arrive``)."""

    def __init__(self, buffer: torch.Tensor):
        self.buffer, self.arrived, self.waited = buffer, threading.Event(), False

    def completed(self) -> bool:
        return self.arrived.is_set()

    def wait(self) -> list[torch.Tensor]:
        assert self.arrived.wait(10.0)
        self.waited = True
        return [self.buffer]


def _auditor(monkeypatch, report: int):
    posted = []
    monkeypatch.setattr(audit_sync.dist, "P2POp", lambda op, tensor, peer, tag, group: tensor)
    monkeypatch.setattr(audit_sync.comm, "post", lambda ops, tensors, **kw: posted.append(_Travelling(tensors[0]))
                        or posted[-1])
    monkeypatch.setattr(audit_sync.control, "gather_to", lambda value, **kw: {1: torch.tensor([report, 0, 0, 0, 0]),
                                                                          0: value})
    return posted


@pytest.mark.parametrize("report", [1, 0])
def test_the_step_ends_before_a_sole_replicas_gradient_is_in_and_the_copy_steps_once_it_is(monkeypatch, report):
    posted = _auditor(monkeypatch, report)
    st = audit_state.AuditedStage(stage=1, replicas=(1,), auditor=0, source=1, every=4, copied_from=(0,))
    with ThreadPoolExecutor(max_workers=1) as stepper:
        runtime = _Runtime()
        start = [p.detach().clone() for _, p in runtime.parameters()]
        copy = audit_copy.StageCopy(runtime=runtime, optimizer=torch.optim.SGD(runtime.module.parameters(), lr=1.0),
                                    stepper=stepper)
        ex = SimpleNamespace(audits=audit_state.RuntimeAudits(stages={1: st}, copies={1: copy}), rank=0,
                             device=torch.device("cpu"), verify=None)
        audit_sync.post_hearing(ex, 0)
        audit_sync._sync_copy(ex, st, 0)   # returns with the gradient still travelling
        (hearing,) = posted
        assert not hearing.waited and copy.pending is not None and not copy.pending.done()
        hearing.buffer.fill_(0.5)
        hearing.buffer[-len(copy.params):] = 1.0
        hearing.arrived.set()
        _, (out,) = copy.forward([torch.ones(1, 3)], SimpleNamespace(
            autocast=lambda device: torch.autocast("cpu", enabled=False), to_wire=lambda o: o),
            torch.device("cpu"), grad=False)   # the recompute waits for the copy's step
        assert hearing.waited and copy.pending is None
    moved = 0.5 if report else 0.0   # SGD at lr 1; a replica that says it took no step: nothing moves
    for (_, p), p0 in zip(runtime.parameters(), start):
        assert torch.equal(p.detach(), p0 - moved)
    assert torch.equal(out, runtime.module(torch.ones(1, 3))[0])


def test_twins_still_judge_the_tensor_at_the_steps_end(monkeypatch):
    posted = _auditor(monkeypatch, 0)
    st = audit_state.AuditedStage(stage=1, replicas=(1, 2), auditor=0, source=1, every=4)
    monkeypatch.setattr(audit_sync.control, "gather_to", lambda value, **kw: {r: torch.zeros(5, dtype=torch.int64)
                                                                          for r in (0, 1, 2)})
    copy = audit_copy.StageCopy(runtime=_Runtime(), optimizer=None)
    ex = SimpleNamespace(audits=audit_state.RuntimeAudits(stages={1: st}, copies={1: copy}), rank=0,
                         device=torch.device("cpu"), verify=None)
    audit_sync.post_hearing(ex, 0)
    posted[0].arrived.set()
    audit_sync._sync_copy(ex, st, 0)
    assert posted[0].waited   # the source's tensor checked against its digest before the step's end


def _source():
    """A sole replica (rank 2) of stage 1, the source of its applied gradient: (module, stage, audits, executor)."""
    module = torch.nn.Linear(3, 2)
    st = audit_state.AuditedStage(stage=1, replicas=(2,), auditor=0, source=2, every=4, copied_from=(0,))
    state = audit_state.RuntimeAudits(stages={1: st})
    ex = SimpleNamespace(audits=state, stage=module, info=SimpleNamespace(stage=1), optimizer=object(),
                         params=list(module.parameters()), rank=2, step=0, device=torch.device("cpu"))
    return module, st, state, ex


def test_the_source_waits_for_its_last_send_before_rewriting_the_buffer_and_at_the_runs_end(monkeypatch):
    module, st, state, ex = _source()
    waits = []

    class _Send:
        def wait(self):
            waits.append(self)

    monkeypatch.setattr(audit_sync.comm, "send", lambda tensors, **kw: _Send())
    monkeypatch.setattr(audit_sync.control, "gather_to", lambda value, **kw: None)
    for p in module.parameters():
        p.grad = torch.randn_like(p)
    audit_sync.keep_applied(ex, idle=[])
    first = state.sending
    audit_sync._send_applied(ex, st, 0, state.applied)
    assert not waits and state.in_flight is first   # the step ends with the transfer still going
    audit_sync.keep_applied(ex, idle=[])
    assert waits == [first] and state.in_flight is None
    audit_sync._send_applied(ex, st, 1, state.applied)
    audits.finish(ex)
    assert len(waits) == 2


def _cost(gradient_bytes_per_s: float, *, sole: bool, params: int = 10**6):
    link = Link(bandwidth_gbps=8e-9 * gradient_bytes_per_s, latency_ms=0.0)
    return audit_ms(every=4, microbatches=4, params=params, param_tensors=2, forward_ms=10.0, output_bytes=1e3,
                    source_link=link, digest_link=link, verifier_mem_bw_bytes_per_s=1e10, optim_ms=5.0,
                    copy_links=((None, 4),), sole=sole)


def test_a_sole_replicas_step_ends_with_its_digest_unless_its_gradient_would_fall_behind():
    fast, twins = _cost(1e9, sole=True), _cost(1e9, sole=False)
    assert fast.gradient_ms == pytest.approx(4.000008)
    # the auditor recomputes from 100 ms: the digest is in at 110 (+ its own transfer), the gradient at 124
    assert twins.end_ms(auditor_free_ms=100.0, replicas_done_ms=0.0, gradient_sent_ms=120.0) == \
        pytest.approx(120.0 + twins.gradient_ms)
    # (outputs only: recomputed on the copy's stepper during the next step, off the step's end)
    assert fast.end_ms(auditor_free_ms=100.0, replicas_done_ms=0.0, gradient_sent_ms=120.0) == \
        pytest.approx(100.0 + fast.digest_ms)
    # 4 GB of gradient at 1 GB/s: in only 4 s after it left, past the next step's recompute (from 100 ms into it,
    # the copy's 5 ms step first): the step lasts that long
    slow = _cost(1e9, sole=True, params=10**9)
    assert slow.end_ms(auditor_free_ms=100.0, replicas_done_ms=0.0, gradient_sent_ms=120.0) == \
        pytest.approx(120.0 + slow.gradient_ms - (100.0 - 5.0))
    # sent at 20 ms, before the auditor posts at 100: in at 100 + 4 s, and the source's next send (20 ms into the
    # next step) waits for it on their one link
    assert slow.end_ms(auditor_free_ms=100.0, replicas_done_ms=0.0, gradient_sent_ms=20.0) == \
        pytest.approx(100.0 + slow.gradient_ms - 20.0)


def test_a_source_that_takes_no_step_waits_for_its_last_send_before_the_zeros(monkeypatch):
    module, st, state, ex = _source()
    events = []

    class _Send:
        def __init__(self, tensors):
            self.zeros = not bool(tensors[0].any())

        def wait(self):
            events.append(("waited", self.zeros))

    def send(tensors, **kw):
        events.append(("sent", not bool(tensors[0].any())))
        return _Send(tensors)

    monkeypatch.setattr(audit_sync.comm, "send", send)
    monkeypatch.setattr(audit_sync.control, "gather_to", lambda value, **kw: None)
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    audit_sync.keep_applied(ex, idle=[])
    audit_sync._send_applied(ex, st, 0, state.applied)
    audit_sync._send_applied(ex, st, 1, None)   # step 1: no step, zeros, only once step 0's gradient has left
    audits.finish(ex)
    assert events == [("sent", False), ("waited", False), ("sent", True), ("waited", True)]


def test_a_gradient_that_never_comes_fails_the_next_recompute_never_passes_it(monkeypatch):
    """The sole replica reports a step but its gradient never arrives (the receive times out): the copy does not
    step and its next recompute raises the transfer's failure, naming the source, instead of auditing on a copy
    left a step behind."""
    posted = _auditor(monkeypatch, 1)
    st = audit_state.AuditedStage(stage=1, replicas=(1,), auditor=0, source=1, every=4, copied_from=(0,))

    class _Lost(RuntimeError):
        pass

    with ThreadPoolExecutor(max_workers=1) as stepper:
        runtime = _Runtime()
        start = [p.detach().clone() for _, p in runtime.parameters()]
        copy = audit_copy.StageCopy(runtime=runtime, optimizer=torch.optim.SGD(runtime.module.parameters(), lr=1.0),
                                    stepper=stepper)
        ex = SimpleNamespace(audits=audit_state.RuntimeAudits(stages={1: st}, copies={1: copy}), rank=0,
                             device=torch.device("cpu"), verify=None)
        audit_sync.post_hearing(ex, 0)
        (hearing,) = posted

        def timed_out():
            raise _Lost("rank 1 failed while hearing stage 1's applied gradient")

        hearing.wait = timed_out
        audit_sync._sync_copy(ex, st, 0)   # the step ends: the report says it stepped
        with pytest.raises(_Lost, match="rank 1"):
            copy.forward([torch.ones(1, 3)], SimpleNamespace(
                autocast=lambda device: torch.autocast("cpu", enabled=False), to_wire=lambda o: o),
                torch.device("cpu"), grad=False)
    for (_, p), p0 in zip(runtime.parameters(), start):
        assert torch.equal(p.detach(), p0)
