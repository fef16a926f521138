"""Contribution audits (issue 37, ``audit.contribution_error``, ``runtime.rank.audit_contrib``): the sketch a
replica reports of its gradient contribution against the sketch of the sum of its microbatches' recomputed
parameter gradients. An honest contribution passes and vouches, one the replica scaled, flipped or noised before
its all-reduce fails; the sum is only judged once every microbatch of the replica is in."""
from __future__ import annotations

import math

import pytest
import torch

from planner.integrity import audit
from planner.integrity.contributions import sketch, sketch_seed
from planner.runtime.rank import audit_contrib
from planner.runtime.rank.audit_copy import StageCopy
from planner.runtime.rank.precision import Precision
from planner.runtime.rank.stage import ValueSpec
from planner.runtime.wire import comm

STAGE = 1
SEED = sketch_seed(0, STAGE)
TOL = audit.TOLERANCE["float32"]


def _per_mb(n: int = 2, size: int = 5000) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(size, generator=g) for _ in range(n)]


def _reported(parts: list[torch.Tensor]) -> torch.Tensor:
    """What a replica sends: the sketch of its accumulated contribution (``replica_checks.reduce_replicas``),
    accumulated in place in its own order, as autograd does."""
    acc = torch.zeros_like(parts[0])
    for p in reversed(parts):
        acc += p
    return sketch(acc, seed=SEED)


def test_an_honest_contribution_of_two_microbatches_passes_and_vouches():
    parts = _per_mb(2)
    err = audit.contribution_error(_reported(parts), parts, seed=SEED)
    assert err <= audit.VOUCH_SHARE * TOL and audit.vouches(err, TOL)
    assert audit.contribution_event(step=3, stage=STAGE, sender=1, error=err, tolerance=TOL) is None


@pytest.mark.parametrize("poison", ["scale3", "sign", "noise", "one_microbatch_missing"])
def test_a_poisoned_contribution_fails_as_an_audit(poison):
    parts = _per_mb(2)
    total = parts[0] + parts[1]
    sent = {"scale3": 3 * total, "sign": -total, "noise": total + torch.randn_like(total) * total.std(),
            "one_microbatch_missing": parts[0]}[poison]
    err = audit.contribution_error(sketch(sent, seed=SEED), parts, seed=SEED)
    assert err > TOL
    event = audit.contribution_event(step=3, stage=STAGE, sender=1, error=err, tolerance=TOL)
    assert event is not None and audit.is_audit(event) and audit.failed_audits([event]) == {1}
    assert (event["scope"], event["boundary"], event["direction"], event["step"]) == ("step", STAGE, "grad", 3)
    late = audit.late_audit_event(event, at_step=4)
    assert late["since"] == 3 and late["step"] == 4 and audit.failed_audits([late]) == {1}


def test_a_malformed_report_or_no_microbatch_is_no_pass():
    parts = _per_mb(2)
    assert audit.contribution_error(torch.zeros(7, dtype=torch.float64), parts, seed=SEED) == math.inf
    assert audit.contribution_error(_reported(parts), [], seed=SEED) == math.inf
    assert audit.contribution_error(_reported(parts), [parts[0], parts[1][:10]], seed=SEED) == math.inf


def test_sums_are_judged_only_when_every_microbatch_of_the_replica_is_in():
    parts = _per_mb(2)
    sums = audit_contrib.ContribSums(stage=STAGE, step=5, owned={1: frozenset({0, 2})})
    assert sums.wants(1) and not sums.wants(2)
    sums.add(1, 0, parts[0])
    assert not sums.complete(1) and audit_contrib.judge(sums, 1, _reported(parts), tolerance=TOL) is None
    sums.add(1, 2, parts[1])
    sums.add(1, 2, parts[1])   # the same microbatch twice counts once
    honest = audit_contrib.judge(sums, 1, _reported(parts), tolerance=TOL)
    assert honest is not None and honest.passed and honest.vouched and honest.event is None
    poisoned = audit_contrib.judge(sums, 1, _reported([3 * p for p in parts]), tolerance=TOL)
    assert poisoned is not None and not poisoned.passed and audit.failed_audits([poisoned.event]) == {1}


def test_a_diverged_sum_gives_no_verdict():
    sums = audit_contrib.ContribSums(stage=STAGE, step=5, owned={1: frozenset({0})})
    bad = torch.full((100,), float("nan"))
    sums.add(1, 0, bad)
    assert audit_contrib.judge(sums, 1, sketch(bad, seed=SEED), tolerance=TOL) is None


class _Recorder:
    def __init__(self) -> None:
        self.audits, self.flags = [], {}

    def record_audit(self, sender, step, *, passed):
        self.audits.append((sender, step, passed))

    def add_flags(self, step, events):
        self.flags.setdefault(step, []).extend(events)


class _Monitor:
    def __init__(self) -> None:
        self.vouched = []

    def vouch(self, stage, rank):
        self.vouched.append((stage, rank))


def test_settle_judges_the_held_sketches_late_and_vouches_the_honest():
    parts = _per_mb(2)
    sums = audit_contrib.ContribSums(stage=STAGE, step=5, owned={1: frozenset({0}), 2: frozenset({1})})
    sums.add(1, 0, parts[0])
    sums.add(2, 1, parts[1])
    sums.heard = {1: sketch(parts[0], seed=SEED), 2: sketch(-parts[1], seed=SEED)}
    verifier, monitor = _Recorder(), _Monitor()
    audit_contrib.settle(verifier, monitor, sums, at_step=6, tolerance=TOL)
    assert verifier.audits == [(1, 5, True), (2, 5, False)] and monitor.vouched == [(STAGE, 1)]
    (late,) = verifier.flags[6]
    assert late["sender"] == 2 and late["since"] == 5 and sums.heard == {}


class _Runtime:
    """A stage of two linear layers (``StageRuntime``'s surface: module, parameters, edge specs), ``head`` tied
    to another stage."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.module = _Two()
        self.inputs = (ValueSpec(name="x", shape=(3, 6), dtype=torch.float32, carries_grad=True),)
        self.outputs = (ValueSpec(name="y", shape=(3, 4), dtype=torch.float32, carries_grad=True),)

    def parameters(self):
        return tuple(self.module.named_parameters())


class _Two(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(6, 8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        return (self.head(torch.tanh(self.body(x))),)


def test_the_copys_one_backward_gives_what_the_replica_contributes():
    runtime = _Runtime()
    copy = StageCopy(runtime=runtime, optimizer=None, tied=frozenset({"head.weight", "head.bias"}))
    assert [id(p) for p in copy.contributed] == [id(p) for p in runtime.module.body.parameters()]
    precision = Precision.of("float32")
    xs, gs = [torch.randn(3, 6) for _ in range(2)], [torch.randn(3, 4) for _ in range(2)]
    recomputed = []
    for x, g in zip(xs, gs):
        inputs, outputs = copy.forward([x], precision, torch.device("cpu"), grad=True)
        ins, flat = copy.grads(inputs, outputs, [g], params=True)
        torch.testing.assert_close(ins[0], copy.input_grads(*copy.forward([x], precision, torch.device("cpu"),
                                                                          grad=True), [g])[0])
        recomputed.append(flat)
    assert all(p.grad is None for p in runtime.module.parameters())   # the copy's .grad left alone
    # the replica: a backward per microbatch into .grad, then its contribution as ``comm.flat_grads`` forms it
    for x, g in zip(xs, gs):
        (y,) = runtime.module(x.requires_grad_())
        torch.autograd.backward([y], [g])
    contribution = comm.flat_grads(list(runtime.module.body.parameters()))
    err = audit.contribution_error(sketch(contribution, seed=SEED), recomputed, seed=SEED)
    assert audit.vouches(err, TOL), err
    assert audit.contribution_error(sketch(3 * contribution, seed=SEED), recomputed, seed=SEED) > TOL


def test_a_replica_that_trained_nothing_is_not_judged_and_one_that_claims_a_gradient_there_fails():
    """Every microbatch of the replica dropped upstream (review): both zero, no verdict (was inf: an honest ban);
    a non-zero report against a zero recomputed sum is a poisoned one."""
    zero = torch.zeros(500)
    assert audit.sketch_error(sketch(zero, seed=SEED), sketch(zero, seed=SEED)) == 0.0
    sums = audit_contrib.ContribSums(stage=STAGE, step=5, owned={1: frozenset({0})})
    sums.add(1, 0, zero)
    assert audit_contrib.judge(sums, 1, sketch(zero, seed=SEED), tolerance=TOL) is None
    lie = audit_contrib.judge(sums, 1, sketch(torch.ones(500), seed=SEED), tolerance=TOL)
    assert lie is not None and not lie.passed
    empty = audit_contrib.ContribSums(stage=STAGE, step=5, owned={1: frozenset({0})})   # every parameter tied
    empty.add(1, 0, torch.zeros(0))
    assert audit_contrib.judge(empty, 1, sketch(torch.zeros(0), seed=SEED), tolerance=TOL) is None


def test_an_overflowed_fp16_report_gives_no_verdict():
    """An fp16 step whose gradients overflowed on the replica (skipped on every rank): its sketch is not finite,
    the copy's unscaled sum is; no verdict (was a failed audit)."""
    parts = _per_mb(1)
    sums = audit_contrib.ContribSums(stage=STAGE, step=5, owned={1: frozenset({0})})
    sums.add(1, 0, parts[0])
    overflowed = parts[0].clone()
    overflowed[7] = float("inf")
    assert audit_contrib.judge(sums, 1, sketch(overflowed, seed=SEED), tolerance=TOL) is None


def test_a_suspect_s_pass_clears_its_step_but_not_its_history():
    """A suspect knows every microbatch of its step is audited (the verdict names it to every rank): its pass
    vouches for that step (judged so) but does not restart the monitor's CUSUMs (review: else attack, behave the
    one suspected step, attack again); a drawn full audit, which it could not foresee, does."""
    parts = _per_mb(2)
    sums = audit_contrib.ContribSums(stage=STAGE, step=5, owned={1: frozenset({0}), 2: frozenset({1})},
                                     predictable=frozenset({2}))
    sums.add(1, 0, parts[0])
    sums.add(2, 1, parts[1])
    outcomes = [audit_contrib.judge(sums, r, sketch(parts[i], seed=SEED), tolerance=TOL) for i, r in enumerate((1, 2))]
    assert all(o is not None and o.passed and o.vouched for o in outcomes)
    verifier, monitor = _Recorder(), _Monitor()
    audit_contrib.record(verifier, monitor, sums, outcomes, at_step=5)
    assert verifier.audits == [(1, 5, True), (2, 5, True)] and monitor.vouched == [(STAGE, 1)]
