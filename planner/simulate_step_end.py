"""What ends a simulated step besides the programs (``planner.simulate``): the gradient norm's exchange where the
run clips, each audited stage's audit, and the verdict exchange of a verified step."""
from __future__ import annotations

from dataclasses import replace

from cost_models.audit import AuditCost, copy_ms
from cost_models.verify import VERDICT_BYTES, verdict_exchange
from planner.ir import dtype_bytes
from planner.simulate_audits import _audit_cost, _audit_wheres, _copy_links
from planner.simulate_events import Event
from planner.simulate_run import _Run
from planner.solver.audit_price import AuditWhere, copied_message_bytes


def _norm_exchange(run: _Run) -> None:
    """Clipping: a stage rank's optimizer step waits for the global gradient norm. Every rank sends its
    squared norm to the control rank (0), which sends back the sum (``executor_optim._clip``); OPTIM ends a
    stage rank's program, so its box moves by the wait."""
    plan, costs = run.plan, run.costs
    stage_ranks = [r.rank for r in plan.ranks if r.stage is not None]
    arrive = {r: run.reached_optim[r] if r in stage_ranks else run.clock[r] for r in range(plan.num_ranks)}
    total = max(t + (costs.verdict_ms(r, 0) if r else 0.0) for r, t in arrive.items())
    for r in stage_ranks:
        wait = total + (costs.verdict_ms(0, r) if r else 0.0) - arrive[r]
        if wait <= 0:
            continue
        run.events[:] = [replace(e, start_ms=e.start_ms + wait, end_ms=e.end_ms + wait)
                         if e.rank == r and e.start_ms >= arrive[r] and e.kind != "send" else e for e in run.events]
        run.events.append(Event(rank=r, kind="control", start_ms=arrive[r], end_ms=arrive[r] + wait,
                                label="gradient norm"))
        run.clock[r] += wait


def _hear_inputs(run: _Run, k: int, where: AuditWhere, cost: AuditCost, posted: float) -> float:
    """When the auditor of stage ``k`` can recompute: its program (and its audits of earlier stages) done and,
    copied, every sender's copy in. It receives them one rank after another, in rank order; a rank's copy
    leaves once its program (and what it did for earlier stages' audits) is done, and its send returns when it
    is received (``runtime.rank.audits.end_step``, which runs the stages in order). Signed, the senders are the
    replicas, each asked once the copy before is in (``runtime.rank.audit_signed.hear``) and sending once the
    request reached it (a latency), the source behind its applied gradient on their link (its receive ``posted``
    as the auditor's program ended)."""
    auditor = int(where.auditor)
    every, t = run.plan.stages[k].audit_every, run.clock[auditor]
    # per microbatch: wire bytes, signed; else float32, with the input gradients where those come copied too, and
    # then the downstream ranks' copies of the gradients they sent (``audit_price.copied_message_bytes``)
    up, down = copied_message_bytes(run.costs.boundary_bytes[k - 1], run.costs.boundary_bytes[k],
                                    dtype_bytes(run.costs.config.dtype), grads=bool(where.grads_from))
    if where.signed_by:
        up = run.costs.boundary_bytes[k - 1]
    messages = [(link, sent, r, up, "input copy") for (link, sent), r in
                zip(_copy_links(run.plan, run.costs, where), where.copied_from)]
    messages += [(link, sent, r, down, "gradient copy") for (link, sent), r in
                 zip(_copy_links(run.plan, run.costs, where, where.grads_from), where.grads_from)]
    for link, sent, r, one, what in messages:
        r = int(r)
        if link is None:
            continue
        begin = max(t, run.clock[r], run.link_free.get((r, auditor), 0.0))
        if where.signed_by:
            begin = max(begin, t + link.latency_ms)   # the request, sent once the copy before is in
            if r == int(where.source):
                begin = max(begin, max(run.reached_optim[r], posted) + cost.gradient_ms)
        t = begin + copy_ms(every=every, sent_microbatches=sent, input_bytes=one, link=link)
        run.events.append(Event(rank=r, kind="send", start_ms=begin, end_ms=t, label=f"stage {k} audit: {what}",
                                stage=k, peer=auditor))
        run.clock[r] = t
    return t


def _audits(run: _Run) -> None:
    """Each audited stage, in order: its auditor, once its program is done (and, copied, the upstream ranks'
    copies of the audited inputs are in), recomputes the step's audited microbatches, then hears the replicas'
    digests and applied gradient (after their optimizer steps; its receive posted as its program ended): its step
    ends then (a sole replica's: once it has the digest, the gradient needed only by the next step's recompute);
    its copy steps on a thread of its own, once the gradient is in, into the next step
    (``planner.runtime.rank.audits``). Recomputes left to the step's end (all but those among the checks) run on
    that thread in the next step, before the copy's step (``AuditCost.deferred``): work on the auditor's device
    from the step's start, beside its own passes (``audit_stepper.Stepper``, run with the programs); the auditor's
    audit of a stage waits for that stage's parts there (and those queued before them), not for a later stage's
    (``Stepper.through_ms``)."""
    plan = run.plan
    for st in run.steppers.values():
        st.done_ms()   # alone once the auditor's program is done
    posted = list(run.clock)   # each auditor posts its receives of the applied gradients as its program ends
    for k, where in _audit_wheres(plan).items():
        auditor = int(where.auditor)
        cost = _audit_cost(plan, run.costs, k, where)
        free = run.clock[auditor]
        start = _hear_inputs(run, k, where, cost, posted[auditor])
        left = 0.0 if cost.during_step or cost.deferred else cost.recompute_ms
        done = max(run.clock[r] for r in plan.stage_ranks(k))
        sent = run.reached_optim[int(where.source)]
        stepper = run.steppers[auditor].through_ms(k) if cost.deferred and auditor in run.steppers else None
        heard = cost.heard_ms(recompute_from_ms=start, replicas_done_ms=done, posted_ms=posted[auditor],
                              gradient_sent_ms=sent, stepper_ms=stepper)
        stepping = max(heard, cost.gradient_in_ms(replicas_done_ms=done, posted_ms=posted[auditor],
                                                  gradient_sent_ms=sent))
        ahead = () if cost.deferred else (("optim", stepping, stepping + cost.optim_ms, "copy's step"),)
        boxes = (("control", free, start, "input copies"), ("verify", start, start + left, "recompute"),
                 ("control", start + left, heard, "applied gradient"), *ahead)
        run.events.extend(Event(rank=auditor, kind=kind, start_ms=a, end_ms=b, label=f"stage {k} audit: {what}",
                                stage=k) for kind, a, b, what in boxes if b > a)
        run.clock[auditor] = heard
    for auditor, st in run.steppers.items():   # each part from the one before it (the first: the step's start)
        run.events.extend(Event(rank=auditor, kind="verify" if part.recompute else "optim", start_ms=a, end_ms=b,
                                label=part.label, stage=part.stage)
                          for part, a, b in zip(st.parts, [0.0, *st.ends], st.ends) if b > a)


def _verdict_exchange(run: _Run) -> None:
    """A verified step ends with the lead verifier's verdict (``cost_models.verify.verdict_exchange``): each
    rank waits for it from the end of its program. The next step starts when the first stage's ranks have
    heard it: the others' wait is drawn, but overlaps the next step's activations on their way to them."""
    plan, costs = run.plan, run.costs
    verifiers = sorted({v.rank for v in plan.verifiers})
    if not verifiers or not plan.policy.enabled:
        return
    cluster = plan.effective_cluster()
    trusted = {r.rank for r in plan.ranks if cluster.device(r.device).trusted}
    replicas = [plan.stage_ranks(k) for k in range(plan.num_stages)]
    sketches = [r for ranks in replicas if len(ranks) >= 2 and not set(ranks) <= trusted for r in ranks]

    def message_ms(src: int, dst: int) -> float:
        cpu = 0.0 if run.messages is None else (run.messages.send_cpu_ms(VERDICT_BYTES)
                                                 + run.messages.recv_cpu_ms(VERDICT_BYTES))
        return costs.verdict_ms(src, dst) + cpu

    heard = verdict_exchange(dict(enumerate(run.clock)), verifiers=verifiers, counters=replicas[0],
                             sketches=sketches, message_ms=message_ms, blame_ms=costs.blame_ms)
    for rank, t in heard.items():
        if t > run.clock[rank]:
            run.events.append(Event(rank=rank, kind="control", start_ms=run.clock[rank], end_ms=t,
                                    label="verdict exchange"))
    for rank in replicas[0]:
        run.clock[rank] = heard[rank]
