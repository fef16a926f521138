"""The auditor's recomputes and their verdicts (``planner.runtime.rank.audits``): the tensors it keeps for an
audited microbatch as its checks see them, the recompute in line once they are in or deferred to the copy's
stepper in the next step, the verdicts among the step's flags, and the lead verifier's contribution audits."""
from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import CancelledError
from typing import Any

import torch

from planner.integrity import audit
from planner.runtime.rank import (
    audit_contrib,
    audit_grads,
    audit_inputs,
    audit_recompute,
)
from planner.runtime.rank.audit_background import urgent
from planner.runtime.rank.audit_recompute import ROLES, Deferred
from planner.runtime.rank.audit_state import AuditedStage, RuntimeAudits


def _role(st: AuditedStage, boundary: int, d: str, sender: int) -> str | None:
    """What a checked tensor is to the audited stage: its input, its output, the gradient sent to it, the one
    it sent upstream (None: nothing of it)."""
    k = st.stage
    if boundary == k - 1 and d == "F":
        return "x"
    if boundary == k and d == "F" and sender in st.replicas:
        return "y"
    if boundary == k and d == "B":
        return "g"
    if boundary == k - 1 and d == "B" and sender in st.replicas:
        return "gin"
    return None


def _audited(ex: Any, st: AuditedStage, mb: int) -> bool:
    """On the auditor: ``mb`` is audited, or every one of a suspect's: one the last step's verdict left unresolved
    or named a suspect (any verifier's flag or alert of it, or a contribution CUSUM past half its alarm:
    ``audit_inputs.agreed_suspects``), known to every rank alike, so from copies or signed inputs too, where the
    upstream ranks or the replicas send what the same rule picks."""
    suspected = ex.plan.owner(st.stage, mb) in audit_inputs.agreed_suspects(ex)
    return audit_inputs.scheduled(ex.plan, ex.audits.schedules[st.stage], st.stage, mb, ex.step, suspected=suspected)


def observe(ex: Any, boundary: int, d: str, mb: int, sender: int, tensors: Sequence[torch.Tensor], *,
            dropped: bool, tainted: bool = False) -> None:
    """Keep a tensor this verifier checked where an audit of ``mb`` needs it. ``dropped``: the consumer drops
    it (flagged or tainted), so the stage computed on zeros in its place; ``tainted``: its sender says it
    computed it on zeros (its input was dropped)."""
    audits: RuntimeAudits | None = getattr(ex, "audits", None)
    if audits is None:
        return
    for k, st in audits.auditing(ex.rank).items():
        role = _role(st, boundary, d, sender)
        if role is None or (role in ("x", "g") and sender not in audits.trusted) or not _audited(ex, st, mb):
            continue   # an untrusted neighbour could send this verifier another input than the replica's
        if st.copied_from and role != "y":
            continue   # audited from copies: the rest comes copied at the step's end (``audit_inputs``, ``audit_grads``)
        zero = dropped and role in ("x", "g")
        if (role == "y" and tainted) or (zero and role == "x"):
            audits.tainted.add((k, mb))   # its input dropped (or, the replica's word, its output computed on zeros)
        elif zero:
            audits.g_tainted.add((k, mb))   # the gradient sent to it dropped: the replica backpropagates zeros
        elif role == "gin" and tainted:
            audits.gin_tainted.add((k, mb))   # judged once all is in (``audit_grads.judge_marked``)
        audits.kept[(k, role, mb)] = [torch.zeros_like(t) if zero else t.detach().clone() for t in tensors]
        if all((k, r, mb) in audits.kept for r in ROLES):   # complete: audit now, while the pipeline runs on
            if (k, mb) in audits.gin_tainted:   # marked with no cause seen: a made-up drop, as from copies
                audit_grads.judge_marked(audits.kept, k, mb,
                                         caused=(k, mb) in audits.tainted or (k, mb) in audits.g_tainted,
                                         held=True)
            with ex._timed("verify"):
                _audit_stage(ex, st, ex.step, only=mb)


def unaudited_since(ex: Any, *, wait_s: float = 0.0) -> int | None:
    """The earliest step whose audits this rank (an auditor) has out with no passing verdict (None: none),
    waiting up to ``wait_s`` for each step's recomputes on the copy's stepper (local work: a peer's failure does
    not stop it). A state of that step or later holds updates no audit has vouched for: a survivor checkpoint of
    it is not to be resumed from (``recovery.survivors``)."""
    audits: RuntimeAudits | None = getattr(ex, "audits", None)
    if audits is None:
        return None
    with urgent(audits.background):
        out = [d.step for d in audits.deferred.values() if not _passed(d, wait_s)]
    return min(out, default=None)


def _passed(deferred: Deferred, wait_s: float) -> bool:
    """Whether ``deferred``'s recomputes finished within ``wait_s`` and every one passed (one still running, cancelled
    or failed in torch vouches for nothing; the peer's failure stays the error the rank reports)."""
    try:
        return all(o.passed for o in deferred.outcomes.result(timeout=wait_s))
    except (TimeoutError, CancelledError, RuntimeError, ValueError):
        return False


def _audit_stage(ex: Any, st: AuditedStage, step: int, *, only: int | None = None) -> None:
    """Recompute the kept microbatches (``only`` that one) on the copy, in line, flag each output or input
    gradient past the tolerance among the step's flags, and forget them. The copy holds the weights the replicas
    computed the whole step with (it steps after the step's end), so a microbatch is audited as soon as its
    tensors are in."""
    audits: RuntimeAudits = ex.audits
    copy = audits.copies.get(st.stage)
    verifier = ex.verify.verifier if ex.verify is not None else None
    if copy is None or copy.drifts or verifier is None or st.stage in audits.suspended:
        return
    taken = audit_recompute.take_kept(audits.kept, st.stage, only)
    outcomes = audit_recompute.recompute(copy, taken, **_recompute_args(ex, st, step))
    if only is not None and getattr(ex, "scaler", None) is not None:
        # fp16, in the step: its input gradients' verdicts wait for the overflow vote at the step's end
        # (``settle_in_step_grads``): an overflow inside an honest replica's backward is none of its copy's
        audits.in_step_grads.extend(o for o in outcomes if o.boundary == st.stage - 1)
        outcomes = [o for o in outcomes if o.boundary != st.stage - 1]
    audit_recompute.record(verifier, outcomes, at_step=step)


def settle_in_step_grads(ex: Any, step: int, *, overflowed: bool) -> None:
    """At the step's end, once the fp16 overflow vote is known: the input gradients audited in the step
    (``_audit_stage``) recorded among the step's flags, or, on a step the vote skipped, none (as from copies:
    ``audit_grads.drop_input_grads``; the step applied nothing)."""
    audits: RuntimeAudits = ex.audits
    outcomes, audits.in_step_grads = audits.in_step_grads, []
    verifier = ex.verify.verifier if ex.verify is not None else None
    if outcomes and not overflowed and verifier is not None:
        audit_recompute.record(verifier, outcomes, at_step=step)


def _tolerance(ex: Any) -> float:
    return audit.TOLERANCE.get(str(ex.precision.dtype).removeprefix("torch."), audit.TOLERANCE["float32"])


def _recompute_args(ex: Any, st: AuditedStage, step: int) -> dict[str, Any]:
    return {"stage": st.stage, "step": step, "owner": lambda mb: ex.plan.owner(st.stage, mb),
            "precision": ex.precision, "device": ex.device, "tolerance": _tolerance(ex),
            "contrib": _contrib_sums(ex, st, step)}


# ----------------------------------------------------------------------------- contribution audits (the lead's)

def _contrib_sums(ex: Any, st: AuditedStage, step: int) -> audit_contrib.ContribSums | None:
    """``st``'s contribution sums of ``step`` (made on first use), where this auditor is the lead verifier (it
    alone hears the replicas' sketches, ``replica_checks.exchange``), the stage has twins (a sole replica sends
    no sketch) and it has their gradients, held or copied (``audit_grads``; not from signed inputs or copied
    inputs alone: outputs only); None elsewhere."""
    audits: RuntimeAudits = ex.audits
    if ex.rank != min(ex.groups.verifier_ranks) or len(st.replicas) < 2 or st.signed_by \
            or (st.copied_from and not st.grads_from):
        return None
    sums = audits.contrib.get(st.stage)
    if sums is None or sums.step != step:
        owned = audit_contrib.full_replicas(ex.plan, st.stage, lambda mb: _audited(ex, st, mb))
        suspects = audit_inputs.agreed_suspects(ex)
        sums = audits.contrib[st.stage] = audit_contrib.ContribSums(
            stage=st.stage, step=step, owned=owned, predictable=frozenset(r for r in owned if r in suspects))
    return sums


def contributions_heard(ex: Any, stage: int, step: int, sketches: dict[int, torch.Tensor]) -> set[int]:
    """At the lead verifier, as ``stage``'s replicas' contribution sketches of ``step`` come in
    (``replica_checks.exchange``): each fully audited replica's, whose recomputed sum is complete, judged now
    (failed: an audit flag of the step; passed close to none: vouched, returned, its contribution flags of the
    step withdrawn by the caller); the others' kept until their recomputes end (``_settle_contrib``)."""
    audits: RuntimeAudits | None = getattr(ex, "audits", None)
    st = audits.auditing(ex.rank).get(stage) if audits is not None else None
    verifier = ex.verify.verifier if ex.verify is not None else None
    sums = _contrib_sums(ex, st, step) if st is not None and verifier is not None else None
    if sums is None:
        return set()
    outcomes = []
    for r, sent in sorted(sketches.items()):
        if not sums.wants(r):
            continue
        if not sums.complete(r):
            sums.heard[r] = sent
        elif (judged := audit_contrib.judge(sums, r, sent, tolerance=_tolerance(ex))) is not None:
            outcomes.append(judged)
    audit_contrib.record(verifier, getattr(ex, "_contributions", None), sums, outcomes, at_step=step)
    return {o.sender for o in outcomes if o.vouched}


def _settle_contrib(ex: Any, st: AuditedStage, step: int) -> None:
    """At the step's end, after its audits are in line or queued: the sketches still waiting for their sums are
    judged now (in line), or once the recomputes queued for the next step are collected (``_collect``)."""
    audits: RuntimeAudits = ex.audits
    sums = audits.contrib.pop(st.stage, None)
    deferred = audits.deferred.get(st.stage)
    if sums is None or (deferred is not None and deferred.contrib is sums):
        return
    audit_contrib.settle(ex.verify.verifier if ex.verify is not None else None, getattr(ex, "_contributions", None),
                         sums, at_step=step, tolerance=_tolerance(ex))


def _deferring(ex: Any, st: AuditedStage, step: int) -> Any:
    """What queues the step's kept microbatches of ``st`` on its copy's stepper (``audit_recompute.defer``), to
    recompute while the next step runs, before the copy steps; the tensors leave ``kept`` now. A copy without a
    stepper recomputes them in line."""
    audits: RuntimeAudits = ex.audits
    copy = audits.copies.get(st.stage)
    verifier = ex.verify.verifier if ex.verify is not None else None
    if copy is None or copy.drifts or verifier is None or st.stage in audits.suspended:
        return None
    taken = audit_recompute.take_kept(audits.kept, st.stage)

    def queue() -> None:
        deferred = audit_recompute.defer(copy, taken, **_recompute_args(ex, st, step))
        if deferred is not None:
            audits.deferred[st.stage] = deferred
        elif copy.stepper is None:
            audit_recompute.record(verifier, audit_recompute.recompute(copy, taken, **_recompute_args(ex, st, step)),
                                   at_step=step)
    return queue


def _collect(ex: Any, st: AuditedStage, step: int) -> None:
    """The verdict of ``st``'s audits deferred from the step before (recomputed on the stepper meanwhile; waited
    for only if not done yet): among this step's flags, each failed one since its audited step."""
    audits: RuntimeAudits = ex.audits
    deferred = audits.deferred.pop(st.stage, None)
    verifier = ex.verify.verifier if ex.verify is not None else None
    if deferred is None or verifier is None:
        return
    with urgent(audits.background):   # due now: at the normal class while waited for
        outcomes = deferred.outcomes.result()
    audit_recompute.record(verifier, outcomes, at_step=step, hooks=ex.verify)
    audit_contrib.settle(verifier, getattr(ex, "_contributions", None), deferred.contrib, at_step=step,
                         tolerance=_tolerance(ex))
