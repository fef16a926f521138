"""An audit's recompute and comparison (``planner.runtime.rank.audits``), apart from the verifier: it runs on the
run's thread (a microbatch audited as its tensors come in, or a step that ends the run or writes a checkpoint) or,
for the rest of a step's audits, on the copy's stepper during the next step (``defer``), its verdict joining that
step's flags (``late``): off the step's end, where the verdict waits for every rank.

Why the next step: the recompute needs the copy at the weights the replicas computed the audited step with, and
the copy steps to the next ones on the same single thread right after it (first in, first out), so nothing waits
at the step's end; the auditor's main thread meanwhile waits for the pipeline's fill, so the recompute takes that
idle time first, and where it outlasts it, shares the device with the auditor's own passes and checks (priced and
simulated so: ``planner.solver.audit_stepper.Stepper``; on a CPU device the stepper runs at the idle scheduling
class, ``audit_background``, so there the passes go first and the price is an upper bound). The price is a verdict one step late: a failed audit is then a step-level flag of the next step that
carries the audited step as ``since`` (``integrity.audit.late_audit_event``), so the ban's first flagged step, and
the checkpoints set aside from it, go back to the audited step. A step that writes a checkpoint or ends the run
audits in line (``RuntimeAudits.inline_at``): no checkpoint is written, and no run ends, with an audit still out.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from planner.integrity import audit
from planner.runtime.rank.audit_contrib import ContribSums
from planner.runtime.rank.audit_copy import StageCopy

ROLES = ("x", "y", "g", "gin")   # the stage's input, its output, the gradient sent to it, the one it sent upstream
FORGED = "forged"   # kept where the replica marked its input gradient tainted with no cause (``audit_grads.resolve``)


@dataclass(frozen=True, slots=True)
class Outcome:
    """One comparison of an audited microbatch: its sender, whether it passed, and the flag where it failed; the
    tensor compared (``mb``, ``boundary``, ``direction``), whose flags a pass withdraws (``Verifier.record_audit``)."""

    sender: int
    step: int
    passed: bool
    event: dict[str, Any] | None
    mb: int = -1
    boundary: int = -1
    direction: str = ""
    forged: bool = False   # failed for a drop the replica made up (``audit_grads.resolve``)


@dataclass(frozen=True, slots=True)
class Deferred:
    """A step's audits of one stage recomputing on its copy's stepper: the audited step and the outcomes to come;
    the step's contribution sums they complete (``audit_contrib``; None: none checked)."""

    step: int
    outcomes: Future
    contrib: ContribSums | None = None


def take_kept(kept: dict[tuple[int, str, int], list[torch.Tensor]], stage: int,
              only: int | None = None) -> dict[int, dict[str, list[torch.Tensor] | None]]:
    """Microbatch -> its kept tensors by role, removed from ``kept`` (``only``: that microbatch alone)."""
    mbs = sorted({mb for k, _, mb in kept if k == stage and only in (None, mb)})
    return {mb: {role: kept.pop((stage, role, mb), None) for role in (*ROLES, FORGED)} for mb in mbs}


def recompute(copy: StageCopy, taken: dict[int, dict[str, Any]], *, stage: int, step: int,
              owner: Callable[[int], int], precision: Any, device: torch.device, tolerance: float,
              settle: bool = True, contrib: ContribSums | None = None) -> list[Outcome]:
    """Recompute each taken microbatch on ``copy`` (at the weights of ``step``) and compare its output and, where
    kept, its input gradient with the replica's; ``settle`` False on the stepper itself (its queue holds the
    copy's next step behind this). ``contrib``: the same backward's parameter gradients summed there for the
    replicas it wants (``audit_contrib``)."""
    out: list[Outcome] = []
    for mb, kept in taken.items():
        if kept["x"] is None:
            continue
        sender = owner(mb)
        grad = kept["g"] is not None and kept["gin"] is not None
        inputs, outputs = copy.forward([t.to(device) for t in kept["x"]], precision, device, grad=grad,
                                       settle=settle)
        if copy.drifts:
            return out
        checks, forged = [], False
        if kept["y"] is not None:
            checks.append((stage, "act", error(kept["y"], outputs)))
        if grad:
            wanted = contrib is not None and contrib.wants(sender)
            ins, weights = copy.grads(inputs, outputs, kept["g"], params=wanted)
            # marked dropped with no cause (``audit_grads.resolve``): its upstream lost the microbatch for nothing
            forged = kept.get(FORGED) is not None
            checks.append((stage - 1, "grad", float("inf") if forged else error(kept["gin"], ins)))
            if wanted and weights is not None:
                contrib.add(sender, mb, weights)
        for boundary, direction, err in checks:
            event = audit.audit_event(step=step, mb=mb, boundary=boundary, direction=direction, sender=sender,
                                      error=err, tolerance=tolerance)
            vouch = audit.vouches(err, tolerance)   # else it passes without withdrawing the statistics' flags
            out.append(Outcome(sender=sender, step=step, passed=event is None, event=event, mb=mb, boundary=boundary,
                               direction=direction if vouch else "",
                               forged=grad and forged and boundary == stage - 1))
    return out


def defer(copy: StageCopy, taken: dict[int, dict[str, Any]], **kw: Any) -> Deferred | None:
    """``recompute`` queued on the copy's stepper (before the copy's step to the next weights, which its caller
    queues next); None where nothing is to recompute or the copy has no stepper (then in line: the caller's)."""
    if copy.stepper is None or not any(kept["x"] is not None for kept in taken.values()):
        return None
    return Deferred(step=kw["step"], outcomes=copy.stepper.submit(recompute, copy, taken, settle=False, **kw),
                    contrib=kw.get("contrib"))


def record(verifier: Any, outcomes: Sequence[Outcome], *, at_step: int, hooks: Any = None) -> None:
    """The outcomes into ``verifier``: each audit in its ledger under its audited step, the failed ones among
    ``at_step``'s flags (a later step's: as ``audit.late_audit_event``). A made-up drop's late verdict names the
    drop its audited step recorded with no sender (``hooks.name_drop``, the lead's; in line, its flag does)."""
    events = []
    for o in outcomes:
        if o.forged and o.step < at_step and hooks is not None and hasattr(hooks, "name_drop"):
            hooks.name_drop(o.step, o.mb, boundary=o.boundary, sender=o.sender,
                            reason="marked dropped by its sender with no cause: a failed audit")
        verifier.record_audit(o.sender, o.step, passed=o.passed, **({"mb": o.mb, "boundary": o.boundary,
                                                                     "direction": o.direction} if o.direction else {}))
        if o.event is not None:
            events.append(o.event if o.step == at_step else audit.late_audit_event(o.event, at_step=at_step))
    verifier.add_flags(at_step, events)


def error(sent: Sequence[torch.Tensor], recomputed: Sequence[torch.Tensor]) -> float:
    """The largest relative error of the sent tensors against the recomputed ones (inf where they differ in
    number, shape or, for integer tensors, value)."""
    if len(sent) != len(recomputed):
        return float("inf")
    worst = 0.0
    for a, b in zip(sent, recomputed):
        b = b.detach()
        if a.is_floating_point() and b.is_floating_point():
            worst = max(worst, _finite_error(a, b))
        elif a.shape != b.shape or not torch.equal(a, b.to(a.dtype)):
            return float("inf")
    return worst


def _finite_error(sent: torch.Tensor, recomputed: torch.Tensor) -> float:
    """``relative_error`` over the finite values, where both hold the same non-finite ones: weights that a
    poisoned sum made nan give nan on every honest replica and on the copy alike (that is the contribution
    monitor's to catch; the replica computed what it should)."""
    if sent.shape != recomputed.shape:
        return float("inf")
    a, b = sent.detach().float(), recomputed.float()
    odd = ~torch.isfinite(b)
    if not odd.any():
        return audit.relative_error(a, b)
    if not torch.equal(~torch.isfinite(a), odd) or not torch.equal(torch.isnan(a), torch.isnan(b)) \
            or not torch.equal(a[torch.isinf(b)], b[torch.isinf(b)]):
        return float("inf")
    return audit.relative_error(a[~odd], b[~odd]) if bool((~odd).any()) else 0.0
