"""The auditor's copy steps off the run's thread (``audit_copy.StageCopy.step_later``) and stays bit for bit a replica's;
the applied-gradient digest hashes the gradient's bytes in place (issue 37: the audits' fixed per-step cost)."""
from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from planner.runtime.rank import (
    audit_applied,
    audit_copy,
    audit_state,
    audit_sync,
    audits,
)
from planner.runtime.rank.stage import ValueSpec


class _Stage(torch.nn.Module):
    """A stage's module: its outputs as a tuple."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))

    def forward(self, x):
        return (self.net(x),)


class _Runtime:
    """A stage runtime as ``StageCopy`` reads it: a module, its named parameters, its input and output specs."""

    def __init__(self, seed: int):
        torch.manual_seed(seed)
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


def _applied(params, grads, idle=()):
    """The applied-gradient message of ``keep_applied``: each parameter's gradient (zeros where idle), then its
    presence flag."""
    values = [torch.zeros_like(p) if i in idle else g for i, (p, g) in enumerate(zip(params, grads))]
    present = [0.0 if i in idle else 1.0 for i in range(len(params))]
    return torch.cat([*(v.reshape(-1) for v in values), torch.tensor(present)])


def test_the_digest_hashes_the_gradients_bytes_as_they_are():
    flat = torch.randn(1000)
    raw = hashlib.blake2b(flat.numpy().tobytes(), digest_size=8 * audit_applied.DIGEST_WORDS).digest()
    words = [int.from_bytes(raw[8 * i:8 * i + 8], "big", signed=True) for i in range(audit_applied.DIGEST_WORDS)]
    assert audit_applied.digest(flat).tolist() == [1, *words]
    assert audit_applied.digest(flat[::2]).tolist() == audit_applied.digest(flat[::2].clone()).tolist()   # strided: its values
    assert audit_applied.stepped_only(flat).tolist() == [1] + [0] * audit_applied.DIGEST_WORDS
    assert audit_applied.stepped_only(None).tolist() == audit_applied.digest(None).tolist()


def test_a_copy_stepped_on_its_own_thread_holds_the_replicas_weights_bit_for_bit():
    """Adam over five steps, one parameter idle in one of them: the replica steps in line as the executor does,
    the copy on the stepper from the applied-gradient message; every recompute sees the stepped weights."""
    replica, runtime = _Runtime(0), _Runtime(0)
    params = [p for _, p in replica.parameters()]
    optimizer = torch.optim.Adam(params, lr=0.05)
    with ThreadPoolExecutor(max_workers=1) as stepper:
        copy = audit_copy.StageCopy(runtime=runtime, optimizer=torch.optim.Adam(runtime.module.parameters(), lr=0.05),
                                stepper=stepper)
        x = torch.randn(4, 6)
        for step in range(5):
            grads = [torch.randn_like(p) for p in params]
            idle = {1} if step == 2 else set()
            for i, (p, g) in enumerate(zip(params, grads)):
                p.grad = None if i in idle else g.clone()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            copy.step_later(_applied(params, grads, idle))
            _, (out,) = copy.forward([x], _Precision(), torch.device("cpu"), grad=False)
            assert copy.pending is None   # the recompute waited for the step
            assert torch.equal(out, replica.module(x)[0])
        copy.step_later(None)   # the replicas took no step: nothing moves
        copy.settle()
    for (_, mine), theirs in zip(runtime.parameters(), params):
        assert torch.equal(mine, theirs)
        assert mine.grad is None


def test_a_step_that_failed_on_the_stepper_is_raised_where_the_copy_is_next_used():
    runtime = _Runtime(0)
    with ThreadPoolExecutor(max_workers=1) as stepper:
        copy = audit_copy.StageCopy(runtime=runtime, optimizer=torch.optim.SGD(runtime.module.parameters(), lr=1.0),
                                stepper=stepper)
        copy.step_later(torch.ones(copy.flat_size - 3))   # short of this stage's message: a view does not fit
        with pytest.raises(RuntimeError):
            copy.forward([torch.randn(4, 6)], _Precision(), torch.device("cpu"), grad=False)


def test_a_failed_last_step_is_raised_at_the_runs_end_and_the_threads_are_shut_down():
    runtime = _Runtime(0)
    stepper = ThreadPoolExecutor(max_workers=1)
    copy = audit_copy.StageCopy(runtime=runtime, optimizer=torch.optim.SGD(runtime.module.parameters(), lr=1.0),
                            stepper=stepper)
    copy.step_later(torch.ones(copy.flat_size - 3))   # the run's last step: no recompute follows to raise it

    class _Ex:
        audits = audit_state.RuntimeAudits(stages={}, copies={1: copy})

    with pytest.raises(RuntimeError):
        audits.finish(_Ex())
    with pytest.raises(RuntimeError, match="shutdown"):
        stepper.submit(print)


@pytest.mark.parametrize("replicas", [(1, 2), (2,)])
def test_a_replica_with_twins_hashes_its_applied_gradient_as_its_optimizer_steps(replicas, monkeypatch):
    """Rank 2 (the source only where it is alone) keeps the gradient it steps with; with a twin its digest is
    hashed on the hasher meanwhile, alone it reports only that it stepped (no digest to hash) and sends the
    gradient whole at once."""
    from types import SimpleNamespace

    module = torch.nn.Linear(3, 2)
    for p in module.parameters():
        p.grad = torch.randn_like(p)
    st = audit_state.AuditedStage(stage=1, replicas=replicas, auditor=0, source=1 if len(replicas) > 1 else 2, every=4)
    state = audit_state.RuntimeAudits(stages={1: st})
    with ThreadPoolExecutor(max_workers=1) as hasher:
        state.hasher = hasher if len(replicas) > 1 else None
        ex = SimpleNamespace(audits=state, stage=module, info=SimpleNamespace(stage=1), optimizer=object(),
                             params=list(module.parameters()), rank=2, step=0)
        sent = []   # the source sends the gradient whole as it steps: the transfer stubbed
        monkeypatch.setattr(audit_sync.comm, "send", lambda tensors, **kw: sent.append((tensors, kw)) or "pending")
        audit_sync.keep_applied(ex, idle=[])
        if st.source == ex.rank:
            assert state.sending == "pending" and sent[0][1]["peer"] == 0 and sent[0][0][0] is state.applied
        else:
            assert state.sending is None and not sent
        flat = torch.cat([module.weight.grad.reshape(-1), module.bias.grad, torch.ones(2)])
        assert torch.equal(state.applied, flat)
        if len(replicas) > 1:
            assert torch.equal(state.claim.result(), audit_applied.digest(flat))
        else:
            assert state.claim is None


def test_the_auditor_judges_twins_with_the_digest_it_hashed_early_as_with_its_own():
    flat = torch.randn(10)
    honest = tuple(audit_applied.digest(flat).tolist())
    reports = {1: honest, 2: honest}
    early = audit_applied.digest(flat)
    assert audit_applied.judge_applied(reports, flat, source=1, trusted=frozenset({1}), hashed=early) == \
        audit_applied.judge_applied(reports, flat, source=1, trusted=frozenset({1}))
    # the early hash is what the tensor is checked against: another one is the source's lie
    assert audit_applied.judge_applied(reports, flat, source=1, trusted=frozenset(), hashed=audit_applied.digest(flat + 1)).suspend
    # a source that took no step is checked against no digest, whatever was hashed
    none = {1: tuple(audit_applied.digest(None).tolist()), 2: tuple(audit_applied.digest(None).tolist())}
    assert audit_applied.judge_applied(none, torch.zeros(10), source=1, trusted=frozenset(), hashed=early) == \
        audit_applied.AppliedJudgement(stepped=False, suspend=False)


def test_a_replica_writes_its_applied_gradient_into_one_buffer_step_after_step():
    from types import SimpleNamespace

    module = torch.nn.Linear(3, 2)
    st = audit_state.AuditedStage(stage=1, replicas=(1, 2), auditor=0, source=1, every=4)
    state = audit_state.RuntimeAudits(stages={1: st})
    ex = SimpleNamespace(audits=state, stage=module, info=SimpleNamespace(stage=1), optimizer=object(),
                         params=list(module.parameters()), rank=2, step=0)
    kept = []
    for idle in ([], [module.bias]):
        for p in module.parameters():
            p.grad = torch.randn_like(p)
        audit_sync.keep_applied(ex, idle=idle)
        bias = torch.zeros(2) if idle else module.bias.grad
        assert torch.equal(state.applied, torch.cat([module.weight.grad.reshape(-1), bias,
                                                     torch.tensor([1.0, 0.0 if idle else 1.0])]))
        kept.append(state.applied.data_ptr())
    assert kept[0] == kept[1]
