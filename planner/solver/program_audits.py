"""What audits add to the priced programs (``planner.solver.program_cost``, ``audit_price``): the auditors' copy
steppers' queues, the signing on the forwards, the recomputes among an auditor's checks, and when the audits end."""
from __future__ import annotations

from planner.solver.audit_price import audit_cost, audit_site, signing_ms
from planner.solver.audit_stepper import StepperPart, stepper_parts, through_from_done
from planner.solver.problem import Problem
from planner.solver.program_paths import _Paths
from planner.solver.program_traffic import _Traffic


def _steppers(problem: Problem, stages, verifiers) -> dict[str, tuple[StepperPart, ...]]:
    """Auditor device -> its copies' stepper's queue at the step's start (``audit_stepper.stepper_parts``)."""
    costs = []
    for k, st in enumerate(stages):
        site = audit_site(problem, stages, verifiers, k) if st.audit_every else None
        if site is not None:
            costs.append((k, site.auditor, audit_cost(problem, st, site, st.audit_every, sum(st.microbatches),
                                                      upstream=stages[k - 1], downstream=_after(stages, k))))
    return stepper_parts(costs)


def _through(background: dict[str, tuple[StepperPart, ...]],
             stepped: dict[str, float]) -> dict[tuple[str, int], tuple[float, float]]:
    """(auditor device, stage) -> when its stepper is through the stage's recompute and its copy's step
    (``audit_stepper.Stepper.through_ms``), from when it was through its queue (``stepped``, the replay's)."""
    return {(d, k): ends for d, done in stepped.items() for k, ends in through_from_done(background[d], done).items()}


def _add_signing_ms(problem: Problem, stages, verifiers, fb) -> None:
    """Each forward grows by the signing or the signature check an audit from signed inputs adds there."""
    for (k, dev), ms in signing_ms(problem, stages, verifiers).items():
        i = stages[k].devices.index(dev)
        fb[k][i] += ms


def _audit_checks(problem: Problem, stages, verifiers) -> dict[tuple[str, int, str], float]:
    """(auditor, boundary, B) -> what each of its checks of the gradients an audited stage sends upstream adds: the
    recompute of that microbatch's expected share (``AuditCost.during_step``, ``simulate_audits._audit_checks``)."""
    out: dict[tuple[str, int, str], float] = {}
    for k, st in enumerate(stages):
        site = audit_site(problem, stages, verifiers, k) if st.audit_every else None
        if site is not None and site.grads:
            M = sum(st.microbatches)
            out[(site.auditor, k - 1, "B")] = audit_cost(problem, st, site, st.audit_every, M).recompute_ms / M
    return out


def _with_audits(problem: Problem, stages, verifiers, verify_load: dict[str, float]) -> dict[str, float]:
    """``verify_load`` with the recomputes an auditor runs among its checks (``AuditCost.during_step``), per
    microbatch of the step."""
    out = dict(verify_load)
    for k, st in enumerate(stages):
        site = audit_site(problem, stages, verifiers, k) if st.audit_every else None
        if site is not None and site.grads:
            M = sum(st.microbatches)
            out[site.auditor] = out.get(site.auditor, 0.0) + audit_cost(problem, st, site, st.audit_every, M).recompute_ms / M
    return out


def _audits_end_ms(problem: Problem, stages, verifiers, traffic: _Traffic, ends: list[float], sent: list[float],
                   p: _Paths, stepping: list[float], through: dict[tuple[str, int], tuple[float, float]],
                   ran: dict[str, float]) -> float:
    """When the last audited stage's auditor has recomputed its audited microbatches and heard the applied
    gradient (``cost_models.audit``; its copy steps off the step's path), sent from ``stepping`` (the replicas'
    optimizer steps' starts): after the replicas' optimizer steps, its own program and, where the inputs come
    copied, the upstream stage's ranks' ends and the copies' transfers (0: nothing audited). The stages are
    audited in order, each device's part in one after its part in the last (``runtime.rank.audits.end_step``), the
    gradients' receives posted as the auditor's program ended; a deferred one waits for its own parts of its
    auditor's stepper (and those queued before them: ``through``, by auditor and stage,
    ``audit_stepper.Stepper.through_ms``), never a later stage's."""
    out, clock, posted = 0.0, {}, {}

    def done(device: str) -> float:
        if device not in clock:
            clock[device] = posted[device] = _program_end_ms(problem, stages, traffic, ends, sent, p, device, ran)
        return clock[device]

    for k, st in enumerate(stages):
        site = audit_site(problem, stages, verifiers, k) if st.audit_every else None
        if site is None:
            continue
        cost = audit_cost(problem, st, site, st.audit_every, sum(st.microbatches), upstream=stages[k - 1],
                          downstream=_after(stages, k))
        # copied: the upstream ranks' copies, then the downstream ranks' of the gradients they sent (``grads_from``)
        senders = [d for d in (*site.copied_from, *site.grads_from) if d != site.auditor]
        free, upstream = done(site.auditor), max(map(done, senders), default=0.0)
        inputs_in = cost.inputs_in_ms(auditor_free_ms=free, upstream_done_ms=upstream, gradient_sent_ms=stepping[k],
                                      posted_ms=posted[site.auditor])
        for d in senders:   # a copy's send returns once received
            clock[d] = inputs_in
        # its stepper runs beside the programs (``_priced``'s background), not alone: the audit waits for this
        # stage's parts of it, and the auditor's next audit starts from there
        clock[site.auditor] = cost.end_ms(auditor_free_ms=free, replicas_done_ms=ends[k], upstream_done_ms=upstream,
                                          gradient_sent_ms=stepping[k], posted_ms=posted[site.auditor],
                                          stepper_ms=through.get((site.auditor, k), (0.0, 0.0)))
        out = max(out, clock[site.auditor])
    return out


def _after(stages, k: int):
    """The stage after ``k`` (None: ``k`` is the last), whose devices copy an auditor gradients (``grads_from``)."""
    return stages[k + 1] if k + 1 < len(stages) else None


def _program_end_ms(problem: Problem, stages, traffic: _Traffic, ends: list[float], sent: list[float], p: _Paths,
                    device: str, ran: dict[str, float]) -> float:
    """When ``device``'s program ends: its stage's optimizer step, else its last check: as the programs ran
    (``ran``), or from the closed forms, a gradient's by the time its consumer hears the verdict on the last one
    (the last microbatch's forwards all came before); with none, an activation's, conservatively after its
    sender's last backward."""
    on = [ends[k] for k, st in enumerate(stages) if device in st.devices]
    if on:
        return max(on)
    if device in ran:
        return ran[device]
    last, cls = len(p.fwd) - 1, problem.class_of(device)
    checks = traffic.checks.get(device, set())
    grads = [sent[b + 1] + p.hop_b[last][b] for b, d in checks if d == "grad"]
    return max(grads) if grads else max((sent[b] + problem.verify_ms(problem.raw_bytes(stages[b].last_block), cls)
                                         for b, _ in checks), default=0.0)
