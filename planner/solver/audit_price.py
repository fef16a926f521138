"""Where a placement's replicas can be audited, and what a step's audit costs there (``cost_models.audit``).

The runtime (``planner.runtime.rank.audits``) audits a *watched* stage (two replicas or more, one untrusted) on
the verifier of its output activations, from the tensors that verifier's checks already hold: the stage's
input it verifies on the boundary before (sent by a trusted stage: an untrusted neighbour could send it another
copy than the replica's), and for the gradient the stage sends upstream, the gradient it was sent (from a
trusted stage) and the one it sent. So a stage is auditable only where one verifier holds both of its
boundaries, the placement that also keeps its link tests (``link_tests``), never the first or last stage, and
only where neither boundary is compressed: the auditor compares the decoded wire tensor with an uncompressed
recompute, and a codec's round trip alone (int8 ~0.007 relative error, fp8 0.02-0.05, int4 0.08-0.12) would ban
honest replicas at the fp32 tolerance of 0.01 (``integrity.audit.TOLERANCE``).
``audit_rule`` is that rule, over device names (the planner) or ranks (a plan: ``simulate.audit_site``, which
the simulator and the runtime's audits use).
"""
from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence
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


@dataclass(frozen=True, slots=True)
class AuditWhere:
    """Where ``audit_rule`` lets a watched stage be audited: by ``auditor``, with ``source`` sending it the
    applied gradient whole (the first trusted replica, else the first), gradients too where ``grads``."""

    auditor: Hashable
    source: Hashable
    grads: bool


def audit_rule(*, stage: int, num_stages: int, replicas: Sequence[Hashable], upstream: Collection[Hashable],
               downstream: Collection[Hashable], trusted: Collection[Hashable], auditor: Hashable | None,
               auditor_checks: Collection[tuple[int, str]], codecs: tuple[str, str]) -> AuditWhere | str:
    """Where stage ``stage`` (on ``replicas``, between stages on ``upstream`` and ``downstream``) is audited, or
    why it cannot be. ``auditor``: the verifier of its output activations (None: none); ``auditor_checks``: the
    (boundary, "act" | "grad") it verifies; ``codecs``: its input and output boundaries' codecs."""
    k = stage
    if len(replicas) < 2 or all(r in trusted for r in replicas):
        return "it is not replicated on an untrusted device (nothing to audit)"
    if k == 0:
        return "the first stage's input is data, which no verifier holds"
    if k == num_stages - 1:
        return "the last stage's outputs (the loss) cross no checked boundary"
    if auditor is None or not {(k - 1, "act"), (k, "act")} <= set(auditor_checks):
        return "no verifier holds both its input and its outputs (its link tests are lost too)"
    if auditor in replicas:
        return f"its outputs' verifier {auditor} is one of its replicas"
    if not all(r in trusted for r in upstream):
        return f"its input comes from stage {k - 1}, which is untrusted (it could send the auditor another copy)"
    compressed = [f"{side} boundary travels {codec}" for side, codec in zip(("input", "output"), codecs)
                  if codec != "none"]
    if compressed:
        return (f"its {' and '.join(compressed)}-encoded: the audit recomputes uncompressed, and a codec's round "
                f"trip alone errs near or past its tolerance (fp32 0.01; int8 ~0.007, fp8 to 0.05, int4 to 0.12)")
    grads = {(k - 1, "grad"), (k, "grad")} <= set(auditor_checks) and all(r in trusted for r in downstream)
    source = next((r for r in replicas if r in trusted), replicas[0])
    return AuditWhere(auditor=auditor, source=source, grads=grads)


def _codec(problem: Problem, st: StagePlacement) -> str:
    return problem.codec if st.out_codec is None else st.out_codec


def audit_where(problem: Problem, stages: tuple[StagePlacement, ...], verifiers: tuple[VerifierPlacement, ...],
                k: int) -> AuditWhere | str:
    """``audit_rule`` for stage ``k`` of a placement (its auditor: the verifier of its output boundary)."""
    after = next((v for v in verifiers if v.boundary == k and "act" in v.directions), None)
    auditor = None if after is None else after.device
    checks = {(v.boundary, d) for v in verifiers if v.device == auditor for d in v.directions}
    trusted = {d for st in stages[max(0, k - 1):k + 2] for d in st.devices
               if problem.classes[problem.class_of(d)].trusted}
    return audit_rule(stage=k, num_stages=len(stages), replicas=stages[k].devices,
                      upstream=stages[k - 1].devices if k > 0 else (),
                      downstream=stages[k + 1].devices if k + 1 < len(stages) else (), trusted=trusted,
                      auditor=auditor, auditor_checks=checks,
                      codecs=(_codec(problem, stages[k - 1]) if k > 0 else "none", _codec(problem, stages[k])))


def audit_site(problem: Problem, stages: tuple[StagePlacement, ...], verifiers: tuple[VerifierPlacement, ...],
               k: int) -> AuditSite | None:
    """How stage ``k`` is audited, or None where the runtime could not audit it (``audit_rule``)."""
    if not problem.policy.enabled:
        return None
    where = audit_where(problem, stages, verifiers, k)
    if isinstance(where, str):
        return None
    return AuditSite(stage=k, auditor=str(where.auditor), source=str(where.source), grads=where.grads)


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
