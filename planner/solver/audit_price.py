"""Where a placement's replicas can be audited, and what a step's audit costs there (``cost_models.audit``).

The runtime (``planner.runtime.rank.audits``) audits a *watched* stage (two replicas or more, one untrusted) on
the verifier of its output activations, from the tensors that verifier's checks already hold: the stage's
input it verifies on the boundary before (sent by a trusted stage: an untrusted neighbour could send it another
copy than the replica's), and for the gradient the stage sends upstream, the gradient it was sent (from a
trusted stage) and the one it sent. So a stage is auditable only where one verifier holds both of its
boundaries, the placement that also keeps its link tests (``link_tests``), never the first or last stage.
"""
from __future__ import annotations

from dataclasses import dataclass

from cost_models.audit import AuditCost, audit_ms
from planner.solver.problem import Problem
from planner.solver.solution import StagePlacement, VerifierPlacement


@dataclass(frozen=True, slots=True)
class AuditSite:
    """A watched stage its auditor can audit: the auditor's device, the replica that sends it the applied
    gradient whole (the first trusted replica, else the first) and whether gradients are audited too."""

    stage: int
    auditor: str
    source: str
    grads: bool


def _trusted(problem: Problem, st: StagePlacement) -> bool:
    return all(problem.classes[problem.class_of(d)].trusted for d in st.devices)


def _verifier(verifiers: tuple[VerifierPlacement, ...], boundary: int) -> VerifierPlacement | None:
    return next((v for v in verifiers if v.boundary == boundary), None)


def audit_site(problem: Problem, stages: tuple[StagePlacement, ...], verifiers: tuple[VerifierPlacement, ...],
               k: int) -> AuditSite | None:
    """How stage ``k`` is audited, or None where the runtime could not audit it (see the module docstring)."""
    st = stages[k]
    if not problem.policy.enabled or len(st.devices) < 2 or _trusted(problem, st) or not 0 < k < len(stages) - 1:
        return None
    before, after = _verifier(verifiers, k - 1), _verifier(verifiers, k)
    if before is None or after is None or before.device != after.device or after.device in st.devices:
        return None
    if "act" not in after.directions or "act" not in before.directions or not _trusted(problem, stages[k - 1]):
        return None
    grads = "grad" in after.directions and "grad" in before.directions and _trusted(problem, stages[k + 1])
    source = next((d for d in st.devices if problem.classes[problem.class_of(d)].trusted), st.devices[0])
    return AuditSite(stage=k, auditor=after.device, source=source, grads=grads)


def audit_sites(problem: Problem, stages: tuple[StagePlacement, ...],
                verifiers: tuple[VerifierPlacement, ...]) -> tuple[AuditSite, ...]:
    return tuple(s for k in range(len(stages)) if (s := audit_site(problem, stages, verifiers, k)) is not None)


def audit_cost(problem: Problem, st: StagePlacement, site: AuditSite, every: int, num_microbatches: int) -> AuditCost:
    """One step's audit of ``st`` at one in ``every`` of its ``num_microbatches``, priced on the auditor."""
    tables, cls = problem.tables(st.recompute), problem.class_of(site.auditor)
    first, last = st.first_block, st.last_block
    backward = tables.range_bwd_ms(first, last, cls)
    tensors = 1 if problem.param_tensors is None else int(problem.param_tensors[first:last + 1].sum())
    slowest = max(st.devices, key=lambda d: problem.transfer_ms(1e6, d, site.auditor))
    return audit_ms(every=every, microbatches=num_microbatches, params=problem.range_params(first, last),
                    param_tensors=tensors, forward_ms=tables.range_time_ms(first, last, cls) - backward,
                    backward_ms=backward if site.grads else None, output_bytes=problem.raw_bytes(last),
                    input_bytes=problem.raw_bytes(first - 1), source_link=problem.link(site.source, site.auditor),
                    digest_link=problem.link(slowest, site.auditor),
                    verifier_mem_bw_bytes_per_s=problem.classes[cls].spec.mem_bw_bytes_per_s,
                    optim_ms=problem.range_optim_ms(first, last, cls))
