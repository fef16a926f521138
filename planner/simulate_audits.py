"""The audits a plan runs, priced on its ranks (``planner.simulate``): where each audited stage is audited
(``audit_site``, the rule the runtime's audits use too), one step's audit on its auditor, and what audits add to
the auditor's checks, to the forwards that sign or check signed inputs, and to the auditor's copies' stepper."""
from __future__ import annotations

from cost_models import compute, memory
from cost_models.audit import AuditCost, audit_ms, signing_work
from cost_models.cluster import Link
from cost_models.optim import optim_ms
from planner.instruction_costs import CostModel, stage_param_tensors
from planner.ir import dtype_bytes
from planner.plan import Plan
from planner.solver.audit_price import (
    AuditWhere,
    audit_rule,
    audited_backward_ms,
    input_grad_share,
    with_copied_grads,
)
from planner.solver.audit_stepper import Stepper, stepper_parts


def audit_site(plan: Plan, k: int) -> AuditWhere | str:
    """Where stage ``k`` of ``plan`` can be audited, by ranks, or why not (``audit_price.audit_rule``, the rule
    the planner prices; the runtime's audits use this too). Its auditor: the lowest rank verifying its outputs."""
    cluster = plan.effective_cluster()
    trusted = {r.rank for r in plan.ranks if cluster.device(r.device).trusted}
    auditor = min((v.rank for v in plan.verifiers if v.boundary == k and "act" in v.directions), default=None)
    last = plan.num_stages - 1
    return audit_rule(stage=k, num_stages=plan.num_stages, replicas=sorted(plan.stage_ranks(k)),
                      upstream=plan.stage_ranks(k - 1) if k > 0 else (),
                      downstream=plan.stage_ranks(k + 1) if k < last else (), trusted=trusted, auditor=auditor,
                      auditor_checks={(v.boundary, d) for v in plan.verifiers if v.rank == auditor
                                      for d in v.directions},
                      codecs=(plan.stages[k - 1].out_codec if k > 0 else "none", plan.stages[k].out_codec),
                      random_ops=tuple(dict.fromkeys(op for b in plan.stages[k].blocks for op in b.random_ops)))


def audited_stages(plan: Plan) -> dict[int, tuple[int, int, bool]]:
    """Stage -> (auditor rank, source rank, gradients audited too) for every stage the plan audits
    (``audit_every``) where ``audit_site`` allows it, as the runtime audits them."""
    return {k: (int(w.auditor), int(w.source), w.grads) for k, w in _audit_wheres(plan).items()}


def _audit_wheres(plan: Plan) -> dict[int, AuditWhere]:
    """Stage -> where it is audited (``audit_site``), for every stage the plan audits."""
    if not plan.policy.enabled:
        return {}
    out = {}
    for k, st in enumerate(plan.stages):
        where = audit_site(plan, k) if st.audit_every else None
        if isinstance(where, AuditWhere):
            out[k] = where
    return out


def _audit_cost(plan: Plan, costs: CostModel, k: int, where: AuditWhere) -> AuditCost:
    """One step's audit of stage ``k`` (``cost_models.audit``), priced as the stage's passes on the auditor."""
    auditor, source = int(where.auditor), int(where.source)
    chain, config, spec = costs.chain, costs.config, costs.spec[auditor]
    lo, hi = costs.ranges[k]
    traced = memory.trace_dtype(chain)
    fwd = compute.range_fwd_ms(chain, lo, hi, spec, config.dtype, trace_dtype=traced)
    bwd = compute.range_bwd_ms(chain, lo, hi, spec, config.dtype, trace_dtype=traced) \
        + (fwd if costs.recompute[k] else 0.0)
    params, tensors = memory.stage_param_count(chain, lo, hi), stage_param_tensors(chain, lo, hi)
    device = plan.ranks[auditor].device
    slowest = max(plan.stage_ranks(k), key=lambda r: costs.message_ms("F", k, r, auditor))
    every, inputs = plan.stages[k].audit_every, costs.boundary_bytes[k - 1] if k else 0.0
    # the input gradient's share of the backward, the weights' too for a contribution audit (as the planner prices)
    blocks = chain.blocks[lo:hi + 1]
    bwd = audited_backward_ms(bwd, every=every, replica_microbatches=[len(plan.ranks[r].microbatches)
                                                                     for r in plan.stage_ranks(k)],
                              contributions=bool(where.grads or where.grads_from),
                              share=input_grad_share([b.bwd_flops for b in blocks],
                                                     [b.bwd_input_flops for b in blocks]))
    cost = audit_ms(every=every, microbatches=plan.num_microbatches, params=params,
                    param_tensors=tensors, forward_ms=fwd, backward_ms=bwd if where.grads else None,
                    output_bytes=costs.boundary_bytes[k], input_bytes=inputs,
                    source_link=costs.cluster.link(plan.ranks[source].device, device),
                    digest_link=costs.cluster.link(plan.ranks[slowest].device, device),
                    verifier_mem_bw_bytes_per_s=spec.mem_bw_bytes_per_s,
                    optim_ms=optim_ms(params, config, spec, param_tensors=tensors),
                    copy_links=_copy_links(plan, costs, where), input_elem_bytes=dtype_bytes(config.dtype),
                    signed=bool(where.signed_by), sole=len(plan.stage_ranks(k)) == 1)
    if not where.grads_from:
        return cost
    # gradients audited from copies too (``audit_price.with_copied_grads``, as the planner prices them)
    return with_copied_grads(cost, every=every, microbatches=plan.num_microbatches, backward_ms=bwd,
                             input_bytes=inputs, output_bytes=costs.boundary_bytes[k],
                             elem_bytes=dtype_bytes(config.dtype), verifier_mem_bw_bytes_per_s=spec.mem_bw_bytes_per_s,
                             upstream=_copy_links(plan, costs, where),
                             downstream=_copy_links(plan, costs, where, where.grads_from))


def _copy_links(plan: Plan, costs: CostModel, where: AuditWhere,
                senders: tuple[int, ...] | None = None) -> tuple[tuple[Link | None, int], ...]:
    """Per rank copying the auditor the audited inputs (an upstream rank, or signed, a replica; ``senders``: those
    ranks instead, the downstream ones copying gradients): its link there (None: the auditor itself) and the
    microbatches it sends the stage (takes) a step."""
    auditor = plan.ranks[int(where.auditor)].device
    return tuple((None if int(r) == int(where.auditor) else costs.cluster.link(plan.ranks[int(r)].device, auditor),
                  len(plan.ranks[int(r)].microbatches))
                 for r in (where.copied_from if senders is None else senders))


def _audit_checks(plan: Plan, costs: CostModel) -> dict[tuple[int, int, str], float]:
    """An auditor that audits gradients too recomputes a microbatch once it has checked the gradient the
    replica sent upstream (its last tensor): that check takes the recompute's expected share longer."""
    out = {}
    for k, where in _audit_wheres(plan).items():
        if where.grads:
            cost = _audit_cost(plan, costs, k, where)
            out[(int(where.auditor), k - 1, "B")] = cost.recompute_ms / plan.num_microbatches
    return out


def _signing(plan: Plan, costs: CostModel) -> dict[int, float]:
    """Rank -> what each of its forwards adds for the audits from signed inputs: an upstream rank signs the
    activation it sends the audited stage, a replica checks its input's signature (``audit_price.signing_ms``)."""
    out: dict = {}
    for k, where in _audit_wheres(plan).items():
        if where.signed_by:
            signing_work(costs.wire_bytes[k - 1], plan.stage_ranks(k - 1), plan.stage_ranks(k), out)
    return out


def _steppers(plan: Plan, costs: CostModel) -> dict[int, Stepper]:
    """Auditor rank -> its copies' stepper: the last step's deferred recomputes and copy steps, queued at the
    step's start (``audit_stepper.stepper_parts``)."""
    parts = stepper_parts([(k, int(w.auditor), _audit_cost(plan, costs, k, w)) for k, w in _audit_wheres(plan).items()])
    return {int(a): Stepper(parts=p) for a, p in parts.items()}
