"""Where a placement's replicas can be audited, and what a step's audit costs there (``cost_models.audit``).

The runtime (``planner.runtime.rank.audits``) audits a stage with an untrusted replica on the verifier of its
output activations, the *auditor*: it recomputes the stage on a secret share of the microbatches and compares
with what the replica sent. It needs the stage's input as the replica received it, from a trusted sender or
under a signature it can check (an untrusted neighbour could send the auditor another copy than the replica and
frame it), either

* *held*: the auditor verifies the boundary before the stage too (the placement that keeps its link tests), so it
  holds every input; where it also verifies both gradient boundaries (fed by trusted stages) it audits the
  gradient the stage sends upstream as well; or
* *copied*: the trusted upstream stage's ranks send the auditor a copy of the audited microbatches' inputs at the
  step's end (they share the auditor's secret, so they know which; the replica does not): a cheap audit where a
  full link test is too dear. Outputs only. A stage with one untrusted replica is audited this way too (with the
  link tests' placement its link tests check it already). Where the stage after it is trusted too (its ranks
  send the replicas their gradients), gradients are audited from copies as well (``grads_from``): those ranks,
  sharing the same secret, keep the gradients they send the audited microbatches and send them to the auditor
  at the step's end in one message each, and the upstream ranks add to their copies the input gradient each
  replica sent them back (as received, compared whatever its taint header says; the stage after's copy flags a
  gradient that went tainted, recomputed on zeros: ``audit_grads.resolve``). The auditor recomputes forward and
  backward from them once they are all in (during the next step, as outputs-only audits); where the stage after is
  untrusted, outputs only (it could send the auditor another gradient than the replica's); or
* *signed*: where the upstream stage is untrusted, each of its ranks signs every activation it sends the stage
  (Ed25519 over SHA-256 of the payload, step, microbatch and boundary) and each replica checks the signature as it
  takes the input and keeps both; at the step's end the auditor asks each replica (once its outputs left: the
  share stays secret) for its audited inputs, which it forwards with their signatures, checked against the
  upstream ranks' keys: a replica cannot forward another input than it took, nor the upstream stage frame it.
  Outputs only, from the stage's own replicas, whether or not the auditor holds the input boundary (a held copy
  could differ from what the replica got), one replica alone too. Signing and checking are work on the senders
  and the replicas per microbatch (``cost_models.audit.sign_ms``, ``check_signature_ms``: :func:`signing_ms`).

Never a stage that draws random numbers (``planner.random_ops``: a dropout in training, a sampler; ``random_ops``
of its blocks): the recompute would draw others and fail an honest replica (the runtime would stop its audits at
step 0). Never the first or last stage, and never where the stage's boundaries are compressed: the auditor compares the
decoded wire tensor with an uncompressed recompute, and a codec's round trip alone (int8 ~0.007 relative error,
fp8 0.02-0.05, int4 0.08-0.12) would ban honest replicas at the fp32 tolerance of 0.01
(``integrity.audit.TOLERANCE``). ``audit_rule`` is that rule, over device names (the planner) or ranks (a plan:
``simulate.audit_site``, which the simulator and the runtime's audits use).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass

from cost_models.audit import (
    COMPARE_PASSES,
    AuditCost,
    audit_ms,
    copied_input_bytes,
    copy_ms,
    signing_work,
)
from cost_models.cluster import Link
from planner.errors import InvalidInputError
from planner.solver.problem import Problem
from planner.solver.solution import StagePlacement, VerifierPlacement


@dataclass(frozen=True, slots=True)
class AuditSite:
    """A stage its auditor can audit: the auditor's device, the replica that sends it the applied gradient whole
    (the first trusted replica, else the first), whether gradients are audited too, the devices that copy it the
    audited inputs (empty: it verifies the input boundary itself) and ``signed_by``: where the upstream stage is
    untrusted, its devices (all, sorted), whose signatures come with the inputs the stage's replicas
    (``copied_from``) forward."""

    stage: int
    auditor: str
    source: str
    grads: bool
    copied_from: tuple[str, ...] = ()
    signed_by: tuple[str, ...] = ()
    grads_from: tuple[str, ...] = ()   # copied: the trusted downstream devices that copy it the gradients sent

    @property
    def audits_grads(self) -> bool:
        """Whether the input gradients are audited too (held, or from copies)."""
        return self.grads or bool(self.grads_from)


@dataclass(frozen=True, slots=True)
class AuditWhere:
    """Where ``audit_rule`` lets a stage be audited: by ``auditor``, with ``source`` sending it the applied
    gradient whole (the first trusted replica, else the first), gradients too where ``grads``; ``copied_from``:
    who copies it the audited microbatches' inputs (empty: it holds them all): the upstream stage's replicas, or,
    where ``signed_by`` (the untrusted upstream stage's replicas, all, sorted, who signed them), the stage's own;
    ``grads_from``: copied from a trusted upstream stage with a trusted stage after it, that stage's devices
    (sorted), which copy it the gradients they sent the audited microbatches (``grads`` stays False: held only)."""

    auditor: Hashable
    source: Hashable
    grads: bool
    copied_from: tuple[Hashable, ...] = ()
    signed_by: tuple[Hashable, ...] = ()
    grads_from: tuple[Hashable, ...] = ()


def audit_rule(*, stage: int, num_stages: int, replicas: Sequence[Hashable], upstream: Collection[Hashable],
               downstream: Collection[Hashable], trusted: Collection[Hashable], auditor: Hashable | None,
               auditor_checks: Collection[tuple[int, str]], codecs: tuple[str, str],
               random_ops: Sequence[str] = ()) -> AuditWhere | str:
    """Where stage ``stage`` (on ``replicas``, between stages on ``upstream`` and ``downstream``) is audited, or
    why it cannot be. ``auditor``: the verifier of its output activations (None: none); ``auditor_checks``: the
    (boundary, "act" | "grad") it verifies; ``codecs``: its input and output boundaries' codecs; ``random_ops``:
    its ops that draw random numbers (empty: none known)."""
    k = stage
    if all(r in trusted for r in replicas):
        return "it runs on trusted devices only (nothing to audit)"
    if k == 0:
        return "the first stage's input is data, which no verifier holds"
    if k == num_stages - 1:
        return "the last stage's outputs (the loss) cross no checked boundary"
    if auditor is None or (k, "act") not in set(auditor_checks):
        return "no verifier checks its output activations"
    if auditor in replicas:
        return f"its outputs' verifier {auditor} is one of its replicas"
    compressed = [f"{side} boundary travels {codec}" for side, codec in zip(("input", "output"), codecs)
                  if codec != "none"]
    if compressed:
        return (f"its {' and '.join(compressed)}-encoded: the audit recomputes uncompressed, and a codec's round "
                f"trip alone errs near or past its tolerance (fp32 0.01; int8 ~0.007, fp8 to 0.05, int4 to 0.12)")
    signed = not all(r in trusted for r in upstream)   # it could send the auditor another copy: the replicas do
    held = not signed and (k - 1, "act") in set(auditor_checks)
    if held and len(replicas) < 2:
        return "its one replica's verifier holds both its boundaries: its link tests check it"
    if random_ops:
        return random_reason(random_ops)
    grads = held and {(k - 1, "grad"), (k, "grad")} <= set(auditor_checks) and all(r in trusted for r in downstream)
    source = next((r for r in replicas if r in trusted), replicas[0])
    if signed:
        return AuditWhere(auditor=auditor, source=source, grads=False, copied_from=tuple(sorted(replicas)),
                          signed_by=tuple(sorted(upstream)))
    if held:
        return AuditWhere(auditor=auditor, source=source, grads=grads)
    # copied: gradients too where the stage after is trusted (it sends the replicas their gradients)
    after = tuple(sorted(downstream)) if downstream and all(r in trusted for r in downstream) else ()
    return AuditWhere(auditor=auditor, source=source, grads=False, copied_from=tuple(sorted(upstream)),
                      grads_from=after)


def random_reason(random_ops: Sequence[str]) -> str:
    """Why a stage drawing random numbers is not audited."""
    return (f"it draws random numbers ({', '.join(random_ops)}): an audit's recompute would draw others and fail "
            f"an honest replica")


def stage_random_ops(problem: Problem, st: StagePlacement) -> tuple[str, ...]:
    """The ops of ``st``'s blocks that draw random numbers (``Problem.random_ops``; empty: none known)."""
    per_block = problem.random_ops[st.first_block:st.last_block + 1]
    return tuple(dict.fromkeys(op for ops in per_block for op in ops))


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
                      codecs=(_codec(problem, stages[k - 1]) if k > 0 else "none", _codec(problem, stages[k])),
                      random_ops=stage_random_ops(problem, stages[k]))


def audit_site(problem: Problem, stages: tuple[StagePlacement, ...], verifiers: tuple[VerifierPlacement, ...],
               k: int) -> AuditSite | None:
    """How stage ``k`` is audited, or None where the runtime could not audit it (``audit_rule``)."""
    if not problem.policy.enabled:
        return None
    where = audit_where(problem, stages, verifiers, k)
    if isinstance(where, str):
        return None
    return AuditSite(stage=k, auditor=str(where.auditor), source=str(where.source), grads=where.grads,
                     copied_from=tuple(str(d) for d in where.copied_from),
                     signed_by=tuple(str(d) for d in where.signed_by),
                     grads_from=tuple(str(d) for d in where.grads_from))


def audit_sites(problem: Problem, stages: tuple[StagePlacement, ...],
                verifiers: tuple[VerifierPlacement, ...]) -> tuple[AuditSite, ...]:
    return tuple(s for k in range(len(stages)) if (s := audit_site(problem, stages, verifiers, k)) is not None)


# The share of a stage's backward an audit recomputes for the input gradient alone (``runtime.rank.audit_copy.grads``
# asks autograd for the inputs' gradients only) where its blocks record no split (``input_grad_share``): a
# matmul-dominated stage spends one forward's flops on the input gradient and one on the weights'. From the trace, a
# d=768 GPT stage of 2 layers (microbatch 4 x 128) is 0.514 (attention's and the norms' backward are all the input's);
# timed on one CPU thread 0.51-0.53 (CPU time, 167 of 318 ms; 0.46 once by wall clock); a weightless stage's ~1.
# The weights' share is recomputed too only for a contribution audit (``audit_contrib``).
INPUT_GRAD_SHARE = 0.5


def input_grad_share(bwd_flops: Sequence[int], bwd_input_flops: Sequence[int | None]) -> float:
    """The share of a stage's backward an audit recomputes for the input gradient alone, from its blocks' backward
    FLOPs (``bwd_flops``) and, of those, the ones producing the gradients of activations rather than weights
    (``bwd_input_flops``, ``ir.Block.bwd_input_flops``; None: not recorded, counted at
    :data:`INPUT_GRAD_SHARE`): a weightless stage's is 1, a linear layer's 1/2. No backward FLOPs at all: 1 where
    some block recorded its split (no weight gradient to skip), else the constant."""
    if len(bwd_flops) != len(bwd_input_flops) or any(f < 0 for f in bwd_flops):
        raise InvalidInputError("a stage's backward flops", expected="one non-negative count and split per block",
                                found=f"{len(bwd_flops)} counts, {len(bwd_input_flops)} splits")
    if all(i is None for i in bwd_input_flops):
        return INPUT_GRAD_SHARE
    total = sum(bwd_flops)
    if total <= 0:
        return 1.0
    known = sum(i for i in bwd_input_flops if i is not None)
    unknown = sum(f for f, i in zip(bwd_flops, bwd_input_flops) if i is None)
    return min(1.0, (known + INPUT_GRAD_SHARE * unknown) / total)


def stage_input_grad_share(problem: Problem, first: int, last: int) -> float:
    """:func:`input_grad_share` of blocks ``first`` to ``last`` (``Problem.bwd_split``; none known: the constant)."""
    split = problem.bwd_split[first:last + 1]
    return input_grad_share([f for f, _ in split], [i for _, i in split]) if split else INPUT_GRAD_SHARE


def audited_backward_ms(backward_ms: float, *, every: int, replica_microbatches: Sequence[int],
                        contributions: bool, share: float = INPUT_GRAD_SHARE) -> float:
    """One audited microbatch's backward on the auditor, expected: the input gradient's share (``share``,
    :func:`input_grad_share`) of ``backward_ms``
    (the stage's backward of one microbatch) and, where contribution audits run (``contributions``: gradients
    audited from trusted ranks' tensors, two replicas or more), the weights' share on the microbatches of a
    replica all of whose ``m`` microbatches the draw audits (probability ``every ** -m`` a step: every one of them
    at ``--audit-every 1``), spread over the step's ``sum / every`` audited microbatches. The lead verifier alone
    runs them (``runtime.rank.audit_verdicts._contrib_sums``): charged wherever they can run (at most the weights' share
    more than runs, and only at ``every ** -m``)."""
    if every < 1 or backward_ms < 0 or not 0.0 <= share <= 1.0:
        raise InvalidInputError("audited backward", expected="every >= 1, backward_ms >= 0 and a share in [0, 1]",
                                found=f"every {every}, backward_ms {backward_ms}, share {share}")
    total = sum(replica_microbatches)
    if not contributions or len(replica_microbatches) < 2 or total <= 0:
        return share * backward_ms
    full = sum(m * every ** -m for m in replica_microbatches if m > 0)
    return backward_ms * (share + (1.0 - share) * full / (total / every))


def audit_cost(problem: Problem, st: StagePlacement, site: AuditSite, every: int, num_microbatches: int,
               upstream: StagePlacement | None = None, downstream: StagePlacement | None = None) -> AuditCost:
    """One step's audit of ``st`` at one in ``every`` of its ``num_microbatches``, priced on the auditor;
    ``upstream``: the stage before it, whose devices copy it the audited inputs where ``site.copied_from`` (its
    own replicas do where ``site.signed_by``); ``downstream``: the stage after it, whose devices copy it the
    gradients they sent where ``site.grads_from`` (:func:`with_copied_grads`)."""
    tables, cls = problem.tables(st.recompute), problem.class_of(site.auditor)
    first, last = st.first_block, st.last_block
    whole = tables.range_bwd_ms(first, last, cls)
    backward = audited_backward_ms(whole, every=every, replica_microbatches=st.microbatches,
                                   contributions=site.audits_grads, share=stage_input_grad_share(problem, first, last))
    tensors = 1 if problem.param_tensors is None else int(problem.param_tensors[first:last + 1].sum())
    slowest = max(st.devices, key=lambda d: problem.transfer_ms(1e6, d, site.auditor))
    cost = _outputs_cost(problem, st, site, every, num_microbatches, upstream, tensors, (whole, backward), slowest)
    if not site.grads_from:
        return cost
    grad_senders = _sent_microbatches(site, downstream, site.grads_from, "downstream")
    return with_copied_grads(cost, every=every, microbatches=num_microbatches, backward_ms=backward,
                             input_bytes=problem.raw_bytes(first - 1), output_bytes=problem.raw_bytes(last),
                             elem_bytes=problem.elem_bytes,
                             verifier_mem_bw_bytes_per_s=problem.classes[cls].spec.mem_bw_bytes_per_s,
                             upstream=_copy_links(problem, site, upstream),
                             downstream=tuple((None if d == site.auditor else problem.link(d, site.auditor), n)
                                              for d, n in grad_senders))


def _outputs_cost(problem: Problem, st: StagePlacement, site: AuditSite, every: int, num_microbatches: int,
                  upstream: StagePlacement | None, tensors: int, backward: tuple[float, float],
                  slowest: str) -> AuditCost:
    """``audit_cost`` but the gradients copied (``cost_models.audit.audit_ms``: held gradients, or outputs);
    ``backward``: the stage's whole backward of a microbatch and an audited one's (``audited_backward_ms``)."""
    tables, cls = problem.tables(st.recompute), problem.class_of(site.auditor)
    first, last = st.first_block, st.last_block
    return audit_ms(every=every, microbatches=num_microbatches, params=problem.range_params(first, last),
                    param_tensors=tensors, forward_ms=tables.range_time_ms(first, last, cls) - backward[0],
                    backward_ms=backward[1] if site.grads else None, output_bytes=problem.raw_bytes(last),
                    input_bytes=problem.raw_bytes(first - 1), source_link=problem.link(site.source, site.auditor),
                    digest_link=problem.link(slowest, site.auditor),
                    verifier_mem_bw_bytes_per_s=problem.classes[cls].spec.mem_bw_bytes_per_s,
                    optim_ms=problem.range_optim_ms(first, last, cls),
                    copy_links=_copy_links(problem, site, st if site.signed_by else upstream),
                    input_elem_bytes=problem.elem_bytes, signed=bool(site.signed_by), sole=len(st.devices) == 1)


def _copy_links(problem: Problem, site: AuditSite,
                senders: StagePlacement | None) -> tuple[tuple[Link | None, int], ...]:
    """Per device that copies the auditor the audited inputs (``senders``: the upstream stage, or signed, the
    stage itself): its link there (None: the auditor itself) and the microbatches it sends (takes) a step."""
    if not site.copied_from:
        return ()
    return tuple((None if d == site.auditor else problem.link(d, site.auditor), n)
                 for d, n in _sent_microbatches(site, senders, site.copied_from, "upstream"))


def _sent_microbatches(site: AuditSite, senders: StagePlacement | None, devices: Sequence[str],
                       side: str) -> list[tuple[str, int]]:
    """Per device of ``devices`` (of the stage ``senders``), the microbatches it runs a step."""
    if senders is None:
        k = site.stage - 1 if side == "upstream" else site.stage + 1
        raise InvalidInputError(f"stage {site.stage}'s copied audit", expected=f"the {side} stage's placement",
                                found="none", fix=f"pass {side}=stages[{k}]")
    sent = dict(zip(senders.devices, senders.microbatches))
    return [(d, sent[d]) for d in devices]


# per microbatch copied where gradients come copied too, a taint flag (float32): in an upstream rank's copy its input
# gradient's, in a downstream rank's the gradient it sent's
COPY_FLAG_BYTES = 4


def copied_message_bytes(input_bytes: float, output_bytes: float, elem_bytes: int, *,
                         grads: bool) -> tuple[float, float]:
    """One audited microbatch's bytes in an upstream rank's copy (its input and, where ``grads``, the input
    gradient its replica sent back, of the input's shape, and a flag) and in a downstream rank's (the gradient it
    sent, of the output's shape, and a flag; 0 where not ``grads``): float32
    (``cost_models.audit.copied_input_bytes``) from bytes at ``elem_bytes`` a value
    (``runtime.rank.audit_inputs.send_inputs``, ``audit_grads.send_grads``)."""
    one = copied_input_bytes(input_bytes, elem_bytes)
    if not grads:
        return one, 0.0
    return 2 * one + COPY_FLAG_BYTES, copied_input_bytes(output_bytes, elem_bytes) + COPY_FLAG_BYTES


def with_copied_grads(cost: AuditCost, *, every: int, microbatches: int, backward_ms: float, input_bytes: float,
                      output_bytes: float, elem_bytes: int, verifier_mem_bw_bytes_per_s: float,
                      upstream: Sequence[tuple[Link | None, int]],
                      downstream: Sequence[tuple[Link | None, int]]) -> AuditCost:
    """``cost``, an outputs-only audit from copied inputs, with the gradients audited from copies too
    (``backward_ms``: an audited microbatch's backward, ``audited_backward_ms``): each
    upstream rank's message grows by the input gradients (``copied_message_bytes``), each downstream rank (a link,
    None: the auditor itself; the microbatches it runs a step) sends one of the gradients it sent, received after
    the upstream ones, one after another; every audited microbatch recomputes its backward too and compares its
    input gradient (``COMPARE_PASSES`` over ``input_bytes``), still on the copy's stepper during the next step."""
    up, down = copied_message_bytes(input_bytes, output_bytes, elem_bytes, grads=True)
    copy = sum(copy_ms(every=every, sent_microbatches=n, input_bytes=up, link=link) for link, n in upstream) + \
        sum(copy_ms(every=every, sent_microbatches=n, input_bytes=down, link=link) for link, n in downstream)
    backward = backward_ms + 1e3 * COMPARE_PASSES * input_bytes / verifier_mem_bw_bytes_per_s
    return dataclasses.replace(cost, recompute_ms=cost.recompute_ms + microbatches / every * backward, copy_ms=copy)


def signing_ms(problem: Problem, stages: tuple[StagePlacement, ...],
               verifiers: tuple[VerifierPlacement, ...]) -> dict[tuple[int, str], float]:
    """(stage, device) -> what each forward there grows by for the audits from signed inputs the placement runs
    (``audit_every``): a rank of the stage before an audited one signs the activation it sends it, a replica of
    the audited stage checks the signature of its input (``cost_models.audit``)."""
    out: dict = {}
    for k, st in enumerate(stages):
        site = audit_site(problem, stages, verifiers, k) if st.audit_every else None
        if site is None or not site.signed_by:
            continue
        payload = problem.wire_bytes(stages[k - 1].last_block, stages[k - 1].out_codec)
        signing_work(payload, [(k - 1, d) for d in stages[k - 1].devices], [(k, d) for d in st.devices], out)
    return out
