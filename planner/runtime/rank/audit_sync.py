"""The auditor's copy kept at the replicas' weights (``planner.runtime.rank.audits``): each replica's report of the
gradient its optimizer applied (its digest; from the source, the gradient whole, sent as it steps), the auditor's
receives of it, posted ahead, and the copy's step as ``judge_applied`` says."""
from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor, Future
from typing import Any

import torch
import torch.distributed as dist

from planner.integrity import audit
from planner.runtime.rank.audit_applied import (
    DIGEST_WORDS,
    digest,
    judge_applied,
    stepped_only,
)
from planner.runtime.rank.audit_state import AuditedStage, RuntimeAudits
from planner.runtime.wire import comm, control


def keep_applied(ex: Any, idle: Sequence[torch.nn.Parameter]) -> None:
    """On a replica of an audited stage, right before its optimizer steps: the gradient it steps with."""
    audits: RuntimeAudits | None = getattr(ex, "audits", None)
    if audits is None or ex.stage is None or ex.info.stage not in audits.stages or ex.optimizer is None:
        return
    if len(idle) >= len(ex.params):
        return
    skipped = {id(p) for p in idle}
    values = [(p.grad if p.grad is not None and id(p) not in skipped else torch.zeros_like(p)).detach().float()
              .reshape(-1) for p in ex.params]
    present = torch.tensor([float(p.grad is not None and id(p) not in skipped) for p in ex.params],
                           device=values[0].device)
    _sent(audits)   # last step's gradient left ``outbox_flat`` before it is rewritten
    if audits.outbox_flat is None:
        audits.outbox_flat = torch.empty(sum(v.numel() for v in values) + len(values), device=values[0].device)
    # into last step's buffer, whose send (``_sent``) and digest are done: no fresh pages to fault in
    audits.applied = torch.cat([*values, present], out=audits.outbox_flat)
    st = audits.stages[ex.info.stage]
    if ex.rank == st.source and ex.rank != st.auditor:   # on its way while the optimizer steps (``end_step``)
        audits.sending = comm.send([audits.applied], peer=st.auditor, doing=_sending(st, ex.step),
                                   **_whole_tag(st))
    if audits.hasher is not None:   # the twins' digests: hashed meanwhile too (hashlib lets go of the GIL)
        audits.claim = audits.hasher.submit(digest, audits.applied)


def _whole_tag(st: AuditedStage) -> dict[str, Any]:
    """The tag of stage ``st``'s applied gradient, sent whole (its digests': index ``2 k``)."""
    return control._tag_args(control.Topic.AUDIT, 2 * st.stage + 1)


def _sending(st: AuditedStage, step: int) -> str:
    return f"sending stage {st.stage}'s applied gradient whole to its auditor rank {st.auditor} (step {step})"


def post_hearing(ex: Any, step: int) -> None:
    """The auditor's receives of its stages' applied gradients, posted as its program ends (before the replicas'
    sketches and its recomputes, as priced): the gradients travel meanwhile (the source sent each as it stepped,
    ``keep_applied``)."""
    audits: RuntimeAudits | None = getattr(ex, "audits", None)
    if audits is None:
        return
    for k, st in audits.stages.items():
        copy = audits.copies.get(k)
        if st.auditor == ex.rank and st.source != ex.rank and copy is not None:
            inbox = _free_inbox(audits, k, copy.flat_size, ex.device)
            tag = _whole_tag(st)
            receive = dist.P2POp(dist.irecv, inbox, st.source, tag=comm.make_tag(**tag),
                                 group=comm.channel_group(tag["kind"], tag["boundary"]))
            audits.hearing[k] = comm.post([receive], [inbox], peer=st.source,
                                          doing=f"hearing stage {k}'s applied gradient from rank {st.source} "
                                                f"(step {step})")


def _free_inbox(audits: RuntimeAudits, stage: int, size: int, device: torch.device) -> torch.Tensor:
    """The receive buffer of ``stage``'s next applied gradient: not the one its copy's last step read (that step
    may still run on the stepper, the gradients views of it), so posting never waits for it. Allocated once each:
    fresh pages cost a fill."""
    boxes = audits.inboxes.setdefault(stage, [])
    i = 1 - audits.stepped_from.get(stage, 1)
    while len(boxes) <= i:
        boxes.append(torch.empty(size, device=device))
    audits.filling[stage] = i
    return boxes[i]


def _send_applied(ex: Any, st: AuditedStage, step: int, applied: torch.Tensor | None,
                  claim: Future | None = None) -> None:
    """A replica's report of its update to the auditor (its digest, ``claim`` where ``keep_applied`` hashed it
    already) and, from the source, the gradient whole (on its way since ``keep_applied``; else zeros, no step)."""
    doing = f"sending stage {st.stage}'s applied gradient digest to its auditor rank {st.auditor} (step {step})"
    ranks = sorted({*st.replicas, st.auditor})
    sending = None
    if ex.rank == st.source:
        sending, ex.audits.sending = ex.audits.sending, None
        if sending is None:   # it took no step (``keep_applied`` sent nothing): zeros, before the digest as ever
            _sent(ex.audits)   # last step's, still in flight: in order, and never dropped unwaited
            size = sum(p.numel() for p in ex.params) + len(ex.params)
            sending = comm.send([torch.zeros(size, device=ex.device)], peer=st.auditor, doing=_sending(st, step),
                                **_whole_tag(st))
    if claim is not None:
        report = claim.result()
    else:
        report = digest(applied) if len(st.replicas) > 1 else stepped_only(applied)
    control.gather_to(report.to(ex.device), dst=st.auditor, me=ex.rank, ranks=ranks,
                      topic=control.Topic.AUDIT, device=ex.device, index=2 * st.stage, doing=doing)
    # the transfer goes on past the step's end: waited before the buffer is rewritten (``keep_applied``, ``finish``)
    ex.audits.in_flight = sending


def _sent(audits: RuntimeAudits) -> None:
    """The source's last applied gradient received by the auditor (its send waited)."""
    in_flight, audits.in_flight = audits.in_flight, None
    if in_flight is not None:
        in_flight.wait()


def _sync_copy(ex: Any, st: AuditedStage, step: int, audit_first: Any = None) -> None:
    """The replicas' digests and the source's gradient; the copy steps as ``judge_applied`` says, a replica it
    proves lying fails an audit. ``audit_first``: queues the step's deferred recomputes on the copy's stepper,
    called right before the copy's step is queued there (after the early digest, which the step's end awaits)."""
    audits: RuntimeAudits = ex.audits
    copy = audits.copies.get(st.stage)
    ranks = sorted({*st.replicas, st.auditor})
    doing = f"hearing stage {st.stage}'s applied gradient from its replicas (step {step})"
    assert copy is not None   # every auditor builds a copy of each stage it audits (``build``)
    hearing = audits.hearing.pop(st.stage, None)
    hashed = None if st.stage in audits.suspended else _hashed_early(audits.hasher, st, hearing)
    got = control.gather_to(torch.zeros(1 + DIGEST_WORDS, dtype=torch.int64, device=ex.device), dst=st.auditor,
                            me=ex.rank, ranks=ranks, topic=control.Topic.AUDIT, device=ex.device,
                            index=2 * st.stage, doing=doing)
    filled = audits.filling.pop(st.stage, None) if hearing is not None else None
    if hearing is not None and len(st.replicas) == 1:
        assert got is not None and filled is not None
        control.checked_ints({st.source: got[st.source]}, what="applied-gradient report",
                             expected="1 (stepped) or 0 first", allowed=lambda _, v: v in (0, 1))
        # a sole replica's report is judged without its tensor (``judge_applied``): the copy steps once the
        # gradient is in, on its stepper, and the step's end (the verdict) does not wait for the transfer
        if audit_first is not None:
            audit_first()
        copy.step_when_heard(hearing, st.stage not in audits.suspended and int(got[st.source][0]) == 1)
        audits.stepped_from[st.stage] = filled
        return
    if hearing is not None:
        flat = hearing.wait()[0]
    else:   # not posted ahead (``post_hearing``); the value only gives the shape and dtype: not filled
        whole = control.gather_to(torch.empty(copy.flat_size, device=ex.device), dst=st.auditor, me=ex.rank,
                                  ranks=[st.source, st.auditor], topic=control.Topic.AUDIT, device=ex.device,
                                  index=2 * st.stage + 1, doing=doing)
        assert whole is not None
        flat = whole[st.source]
    assert got is not None
    control.checked_ints({r: got[r] for r in st.replicas}, what="applied-gradient digest",
                         expected="1 (stepped) or 0 first", allowed=lambda _, v: v in (0, 1))
    if st.stage in audits.suspended:
        return
    judged = judge_applied({r: tuple(got[r].cpu().tolist()) for r in st.replicas}, flat, source=st.source,
                           trusted=audits.trusted, hashed=None if hashed is None else hashed.result())
    verifier = ex.verify.verifier if ex.verify is not None else None
    if judged.liars and verifier is not None:
        for r in judged.liars:
            verifier.record_audit(r, step, passed=False)
        verifier.add_flags(step, [audit.applied_gradient_event(step=step, stage=st.stage, sender=r)
                                  for r in judged.liars])
    if judged.suspend:
        if audit_first is not None:   # this step's audits still run: the copy stays at its weights
            audit_first()
        audits.suspended[st.stage] = step   # someone lied about its update and nobody is believed: audit no more
        if verifier is not None:
            verifier.suspend_audits(st.stage, step)
        return
    if audit_first is not None:
        audit_first()
    copy.step_later(flat if judged.stepped else None)
    if filled is None:
        audits.stepped_from.pop(st.stage, None)   # it steps from a buffer of its own: both inboxes free
    else:
        audits.stepped_from[st.stage] = filled


def _hashed_early(hasher: Executor | None, st: AuditedStage, hearing: Any) -> Future | None:
    """The ``digest`` of a gradient already in (sent as the source stepped), hashed on the auditor's digest thread
    while the twins' digests come (None: no twin to compare with, or not in yet)."""
    if hearing is None or not hearing.completed() or len(st.replicas) < 2 or hasher is None:
        return None
    return hasher.submit(digest, hearing.wait()[0])
