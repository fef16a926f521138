"""Which watched stages' replicas the plan audits, and how often (``planner.runtime.rank.audits``).

An audit is a link test on a share of microbatches that recomputes exactly: where the stage's auditor sees
its input, held or copied from the trusted stage before, or forwarded by the replicas themselves from signed
inputs where the stage before is untrusted (``audit_price``), it catches stale and damped outputs on
the first audited microbatch, which the link tests' surrogate sees only as its statistics drift. Its price is mostly per step, whatever the share:
the applied gradient sent whole to the auditor and the auditor's optimizer step. Each microbatch is audited on its
own with probability ``1 / every`` (``integrity.audit.AuditSchedule``), so a replica that corrupts all of its ``m``
microbatches a step goes unaudited for the policy's ``audit_within_steps`` steps ``w`` with probability
``(1 - 1 / every) ** (w m)`` (``miss_probability``). Audits are turned on at the sparsest (cheapest) share of ``EVERY_CHOICES`` that keeps that
under ``MISS_TARGET``, else at the densest share the price allows (the notes then give its miss probability),
while all of them together cost at most the policy's ``audit_cost`` share of the step (priced by the program
cost, as every plan is), and only where the auditor has the memory for its copy of the stage beside what its
programs keep (``copy_bytes``; the plan's memory figures do not include the copy). A run's ``--audit-every``
overrides the plan's shares.
"""
from __future__ import annotations

import dataclasses

from cost_models.audit import check_signature_ms, sign_ms
from planner.solver.audit_price import (
    AuditSite,
    audit_cost,
    audit_site,
    audit_where,
    random_reason,
    stage_random_ops,
)
from planner.solver.objective import Placement, price_program, program_memory
from planner.solver.problem import Problem
from planner.solver.solution import StagePlacement

# 1 in 2 meets MISS_TARGET over 10 steps with one microbatch a replica a step; only 1 in 1 within 1 step
EVERY_CHOICES = (1, 2, 4, 8, 16)
MISS_TARGET = 1e-3     # the chance a replica corrupting every microbatch goes unaudited audit_within_steps steps
# the replicas' applied gradient, received whole as float32 into one of two buffers in turn (the copy's last step
# may still read the other: ``runtime.rank.audit_sync._free_inbox``)
APPLIED_GRADIENT_BYTES_PER_PARAM = 2 * 4
CONTRIBUTION_SUM_BYTES = 4   # a float32 sum of a replica's recomputed parameter gradients, per parameter


def with_audits(placement: Placement, every: dict[int, int]) -> Placement:
    """``placement`` auditing stage ``k`` at one in ``every[k]`` microbatches, no other stage."""
    stages = tuple(dataclasses.replace(st, audit_every=every.get(st.index, 0)) for st in placement.stages)
    return dataclasses.replace(placement, stages=stages)


def miss_probability(every: int, microbatches: int, steps: int) -> float:
    """The chance that none of ``microbatches`` a step, each audited on its own with probability ``1 / every``,
    is audited in ``steps`` steps."""
    return (1 - 1 / every) ** (steps * microbatches)


def replica_microbatches(st: StagePlacement) -> int:
    """The fewest microbatches a replica of ``st`` runs a step: the attacker's best seat."""
    return min((m for m in st.microbatches if m > 0), default=0)


def _shares(st: StagePlacement, steps: int) -> tuple[int, ...]:
    """``EVERY_CHOICES`` in the order to try them: the sparsest meeting ``MISS_TARGET`` within ``steps``, then
    the sparser ones (a denser share costs more); all, densest first, where none meets it."""
    m = replica_microbatches(st)
    meeting = [k for k in EVERY_CHOICES if miss_probability(k, m, steps) <= MISS_TARGET]
    return tuple(k for k in EVERY_CHOICES if k >= max(meeting, default=EVERY_CHOICES[0]))


def _sites(problem: Problem, placement: Placement) -> tuple[AuditSite, ...]:
    return tuple(s for k in range(placement.num_stages)
                 if (s := audit_site(problem, placement.stages, placement.verifiers, k)) is not None)


def copy_bytes(problem: Problem, st: StagePlacement, site: AuditSite | None = None) -> int:
    """What an auditor holds for its copy of stage ``st`` (``runtime.rank.audit_copy.StageCopy``): the weights,
    gradients and optimizer state a replica holds, the two buffers the applied gradient is received into, the activations of
    the one microbatch it recomputes, and the audited microbatches' input and output it keeps until then (each
    is drawn on its own, so a step may audit all of them: counted for all). Where ``site`` audits the replicas'
    gradients (held, or from copies: ``grads_from``), the gradient sent and the one sent back it keeps too (the
    size of the output and the input), and their contribution sums (``runtime.rank.audit_contrib``: a float32 sum
    per replica, for two steps where the verdict comes a step late, and a microbatch's parameter gradients with
    their flat copy)."""
    tables = problem.tables(st.recompute)
    first, last = st.first_block, st.last_block
    per_param = tables.state_bytes_per_param + APPLIED_GRADIENT_BYTES_PER_PARAM
    grads = site is not None and site.audits_grads and not site.signed_by
    if grads and len(st.devices) > 1:
        per_param += CONTRIBUTION_SUM_BYTES * (2 * len(st.devices) + 2)
    # from copies the gradients are kept beside the input and output (held, they are: not counted before either)
    sides = 2 if grads and site.grads_from else 1
    kept = sum(st.microbatches) * sides * ((problem.raw_bytes(first - 1) if first else 0.0) + problem.raw_bytes(last))
    return int(tables.range_params(first, last) * per_param + tables.range_act_bytes(first, last)
               + tables.buffer_bytes(first, last) + kept)


def _free_bytes(problem: Problem, placement: Placement) -> dict[str, int]:
    """Device -> bytes its class holds beyond what the placement's programs keep there (before any audit)."""
    plain = with_audits(placement, {})
    used = dict(program_memory(problem, plain, price_program(problem, plain).in_flight))
    devices = {d for st in placement.stages for d in st.devices} | {v.device for v in placement.verifiers}
    return {d: problem.classes[problem.class_of(d)].mem_bytes - used.get(d, 0) for d in devices}


def choose_audits(problem: Problem, placement: Placement) -> Placement:
    """``placement`` with audits on every auditable stage, at the sparsest share meeting ``MISS_TARGET`` or else
    as often as the policy's ``audit_cost`` allows, where the auditor has the memory for its copy of the stage."""
    chosen: dict[int, int] = {}
    sites = _sites(problem, placement) if problem.policy.audit_cost > 0 else ()
    if not sites:
        return with_audits(placement, chosen)
    limit = (1 + problem.policy.audit_cost) * price_program(problem, with_audits(placement, {})).step_ms
    free = _free_bytes(problem, placement)
    for site in sites:
        need = copy_bytes(problem, placement.stages[site.stage], site)
        if need > free[site.auditor]:
            continue
        for every in _shares(placement.stages[site.stage], problem.policy.audit_within_steps):
            if price_program(problem, with_audits(placement, {**chosen, site.stage: every})).step_ms <= limit:
                chosen[site.stage] = every
                free[site.auditor] -= need
                break
    return with_audits(placement, chosen)


def audit_notes(problem: Problem, placement: Placement) -> tuple[str, ...]:
    """One line per stage with an untrusted replica: audited at what price, or why not (a stage on one replica
    only where it could be audited, or would be but for its random numbers: elsewhere its link tests check it, or
    nothing does)."""
    if not problem.policy.enabled:
        return ()
    base = price_program(problem, with_audits(placement, {})).step_ms
    free = _free_bytes(problem, placement)
    for k, st in enumerate(placement.stages):   # what the chosen copies take
        site = audit_site(problem, placement.stages, placement.verifiers, k) if st.audit_every else None
        if site is not None:
            free[site.auditor] -= copy_bytes(problem, st, site)
    out = []
    for k, st in enumerate(placement.stages):
        if all(problem.classes[problem.class_of(d)].trusted for d in st.devices):
            continue
        site = audit_site(problem, placement.stages, placement.verifiers, k)
        who = "replicas" if len(st.devices) > 1 else "its replica"
        if site is None:
            why = audit_where(problem, placement.stages, placement.verifiers, k)
            random = stage_random_ops(problem, st)
            if len(st.devices) > 1 or (random and why == random_reason(random)):
                out.append(f"stage {k}: {who} not audited: {why}")
            continue
        out.append(_note(problem, placement, k, site, base, free, who))
    return tuple(out)


def _note(problem: Problem, placement: Placement, k: int, site: AuditSite, base: float, free: dict[str, int],
          who: str) -> str:
    """The note on stage ``k``, which ``site`` can audit: at what price, or why it is not."""
    st = placement.stages[k]
    every = st.audit_every or EVERY_CHOICES[-1]
    extra = price_program(problem, with_audits(placement, {k: every})).step_ms - base
    after = placement.stages[k + 1] if k + 1 < placement.num_stages else None
    cost = audit_cost(problem, st, site, every, placement.num_microbatches, upstream=placement.stages[k - 1],
                      downstream=after)
    link = problem.link(site.source, site.auditor)
    copied = (f"the audited inputs come copied from stage {k - 1} ({', '.join(site.copied_from)}) at the step's "
              f"end in {cost.copy_ms:.1f} ms, " if site.copied_from else "")
    if site.grads_from:
        copied = (f"the audited inputs and the input gradients the replicas sent back come copied from stage {k - 1} "
                  f"({', '.join(site.copied_from)}) and the gradients sent to them from stage {k + 1} "
                  f"({', '.join(site.grads_from)}) at the step's end in {cost.copy_ms:.1f} ms, ")
    if site.signed_by:
        up = placement.stages[k - 1]
        payload = problem.wire_bytes(up.last_block, up.out_codec)
        senders = ("the replicas ({}) forward" if len(site.copied_from) > 1 else "its replica ({}) forwards")
        copied = (f"from signed inputs: {senders.format(', '.join(site.copied_from))} the audited inputs, "
                  f"signed by stage {k - 1} ({', '.join(site.signed_by)}), at the step's end in "
                  f"{cost.copy_ms:.1f} ms (a microbatch's signature costs {sign_ms(payload):.2f} ms on stage "
                  f"{k - 1} and its check {check_signature_ms(payload):.2f} ms on a replica), ")
    why = (f"{copied}the applied gradient to {site.auditor} costs {cost.gradient_ms:.1f} ms a step over a "
           f"{link.bandwidth_gbps:g} Gb/s link, its recomputes {cost.recompute_ms:.1f} ms"
           f"{' (on the copy thread during the next step, the verdict a step late)' if cost.deferred else ''} "
           f"and the copy's optimizer step {cost.optim_ms:.1f} ms")
    need = copy_bytes(problem, st, site)
    if not st.audit_every and need > free[site.auditor]:
        room = problem.classes[problem.class_of(site.auditor)].mem_bytes
        return (f"stage {k}: {who} not audited: the copy its auditor {site.auditor} would keep (weights, "
                f"gradients, optimizer state, the applied gradient, a microbatch's activations: "
                f"{need / 2**30:.2f} GiB) does not fit in its {max(0, free[site.auditor]) / 2**30:.2f} GiB "
                f"free of {room / 2**30:.2f} GiB")
    if st.audit_every:
        share = "every microbatch" if every == 1 else f"one microbatch in {every}"
        return (f"stage {k}: {who} audited by {site.auditor}, {share} "
                f"({'outputs and input gradients' if site.audits_grads else 'outputs'}): +{extra:.1f} ms a step "
                f"({100 * extra / base:.1f}%); {why}{_miss(st, problem.policy.audit_within_steps)}")
    return (f"stage {k}: {who} not audited: even one microbatch in {every} costs +{extra:.1f} ms a "
            f"step ({100 * extra / base:.1f}%, over the policy's audit_cost "
            f"{100 * problem.policy.audit_cost:g}%); {why}")


def _miss(st: StagePlacement, steps: int) -> str:
    """What the note on an audited stage adds where its share misses ``MISS_TARGET`` within ``steps``."""
    m = replica_microbatches(st)
    miss = miss_probability(st.audit_every, m, steps)
    if miss <= MISS_TARGET:
        return ""
    return (f"; a replica corrupting all its {m} microbatch{'es' if m != 1 else ''} a step goes unaudited "
            f"{steps} step{'s' if steps != 1 else ''} with probability {100 * miss:.2g}% "
            f"(over {100 * MISS_TARGET:g}%; --audit-within)")
