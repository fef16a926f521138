"""Contribution audits (``planner.runtime.rank.audits``, issue 37): where the auditor recomputed the input gradient
of every microbatch a replica ran in a step, the copy's backward also gives their parameter gradients, and their
sum is what the replica's contribution to its stage's all-reduce should be (before clipping, unscaling and the
sum over replicas, as ``Executor._sum_grads`` forms it: loss scale and the 1 / M of the mean loss ride in the
gradient the replica was sent). Its sketch against the one the replica reported (``replica_checks.exchange``)
is an audit: past the tolerance a failed audit (a ban at once), close to none a pass that vouches for the
contribution (its flag of the step withdrawn where still unsent, and the contribution monitor's CUSUMs restart,
unless the replica was a suspect, which knew its step would be audited: its history stands). Scaled fp16
gradients are compared unscaled (the replica's sketch and the gradient the verifier keeps both are); an
overflowed step, and a replica that trained nothing (both zero), give no verdict.

Only on the lead verifier: it alone hears the sketches and keeps the contribution monitor, so only a stage whose
auditor is the lead is checked so (the replicated plans' one verifier). Parameter gradients are computed only for
a replica all of whose microbatches of the step are to be audited (every one of a suspect's, or all drawn): the
weight half of a backward is not spent where no check can use it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from planner.integrity import audit
from planner.integrity.contributions import sketch_seed
from planner.runtime.rank.stage import stage_state_names


@dataclass(slots=True)
class ContribSums:
    """One audited stage's step at the lead: per replica whose every microbatch is audited (``owned``), the sum of
    the recomputed parameter gradients so far, which microbatches it holds, and its sketch once heard (kept until
    the sum is complete: the rest recompute at the step's end or during the next step)."""

    stage: int
    step: int
    owned: dict[int, frozenset[int]]   # replica -> all its microbatches of the step (each audited)
    # the owned replicas audited as suspects: each knew it would be (the verdict names suspects to every rank), so
    # a pass clears that step only, never the history (else: attack, behave the one suspected step, start again)
    predictable: frozenset[int] = frozenset()
    sums: dict[int, torch.Tensor] = field(default_factory=dict)
    counted: dict[int, set[int]] = field(default_factory=dict)
    heard: dict[int, torch.Tensor] = field(default_factory=dict)   # replica -> its reported sketch, not yet judged

    def wants(self, sender: int) -> bool:
        return sender in self.owned

    def add(self, sender: int, mb: int, flat: torch.Tensor) -> None:
        """``mb``'s recomputed parameter gradient (flat) into ``sender``'s sum (each microbatch once)."""
        seen = self.counted.setdefault(sender, set())
        if sender not in self.owned or mb in seen:
            return
        seen.add(mb)
        flat = flat.detach().float()
        self.sums[sender] = flat.clone() if sender not in self.sums else self.sums[sender].add_(flat)

    def complete(self, sender: int) -> bool:
        return sender in self.owned and self.counted.get(sender, set()) == set(self.owned[sender])


@dataclass(frozen=True, slots=True)
class Judged:
    """A contribution audit's outcome: the replica, whether it passed, whether the pass vouches, the flag if not."""

    sender: int
    passed: bool
    vouched: bool
    event: dict[str, Any] | None


def tied_names(plan: Any, split: Any, stage: int) -> frozenset[str]:
    """The parameters ``stage`` shares with another stage (summed across stages, outside its replicas'
    all-reduce: ``rank_setup.make_groups``' rule)."""
    params = {target for kind, target in split.state.values() if kind == "param"}
    mine = set(stage_state_names(split, stage)) & params
    others = {n for k in range(plan.num_stages) if k != stage for n in stage_state_names(split, k)}
    return frozenset(mine & others)


def full_replicas(plan: Any, stage: int, audited: Any) -> dict[int, frozenset[int]]:
    """Replica -> its microbatches of the step, for the replicas of ``stage`` all of whose microbatches
    ``audited(mb)`` says are audited this step."""
    out = {}
    for r in plan.stage_ranks(stage):
        mbs = frozenset(plan.ranks[r].microbatches)
        if mbs and all(audited(mb) for mb in mbs):
            out[int(r)] = mbs
    return out


def judge(sums: ContribSums, sender: int, sent: torch.Tensor, *, tolerance: float) -> Judged | None:
    """``sender``'s reported sketch against its complete recomputed sum (None: no verdict, where the sum is
    incomplete or not finite, a diverged stage being every replica's, not one's; where the reported sketch is not
    finite, an fp16 step that overflowed, skipped on every rank; or where both are zero, a replica whose every
    microbatch was dropped upstream trained nothing to judge)."""
    if not sums.complete(sender):
        return None
    total = sums.sums[sender]
    if not bool(torch.isfinite(total).all()) or not bool(torch.isfinite(sent).all()):
        return None
    if float(sent[0]) == 0.0 and not bool(total.any()):
        return None
    err = audit.contribution_error(sent, [total], seed=sketch_seed(0, sums.stage))
    event = audit.contribution_event(step=sums.step, stage=sums.stage, sender=sender, error=err,
                                     tolerance=tolerance)
    return Judged(sender=sender, passed=event is None, vouched=audit.vouches(err, tolerance), event=event)


def record(verifier: Any, monitor: Any, sums: ContribSums, outcomes: list[Judged], *, at_step: int) -> None:
    """The outcomes into ``verifier`` (its ledger under the audited step; failed ones among ``at_step``'s flags,
    late ones as ``audit.late_audit_event``) and a vouching pass into ``monitor`` (its CUSUMs of the replica
    restart: ``ContributionMonitor.vouch``)."""
    events = []
    for o in outcomes:
        verifier.record_audit(o.sender, sums.step, passed=o.passed)
        if o.event is not None:
            events.append(o.event if sums.step == at_step else audit.late_audit_event(o.event, at_step=at_step))
        elif o.vouched and monitor is not None and o.sender not in sums.predictable:
            monitor.vouch(sums.stage, o.sender)
    verifier.add_flags(at_step, events)


def settle(verifier: Any, monitor: Any, sums: ContribSums | None, *, at_step: int, tolerance: float) -> None:
    """Judge the sketches heard before their sums were complete (now they are, or never will be: forgotten)."""
    if sums is None or verifier is None:
        return
    heard, sums.heard = sums.heard, {}
    outcomes = [o for r, sent in sorted(heard.items()) if (o := judge(sums, r, sent, tolerance=tolerance))]
    record(verifier, monitor, sums, outcomes, at_step=at_step)
