"""The price of auditing a watched stage's replicas, as ``planner.runtime.rank.audits`` does it.

At the end of every step each replica sends the auditor (the verifier of the stage's output activations) a
digest of the gradient its optimizer applied and one replica (the source) sends that gradient whole: float32,
a value per parameter and a presence flag per parameter tensor, as its optimizer step starts, into a receive the
auditor posts once its own program is done (the transfer overlaps the source's step and the auditor's recomputes). The auditor recomputes the stage on the step's
audited microbatches (one in ``every``: a forward, and a backward where it audits the gradient sent upstream),
compares the result with what the replica sent (``COMPARE_PASSES`` reads and writes; what it recomputes at the
step's end, on its copy's stepper during the next step, before the copy steps, the verdict a step late:
``deferred``, off the step's end but for the stage's own parts of the stepper, :meth:`AuditCost.heard_ms`), and
applies the replicas' optimizer step to its copy once it has heard them (a sole replica's report, judged without the gradient: once the
gradient is in, the step's end not waiting for it, as long as it is in, and the copy stepped, by the next step's
recompute, and in before the source sends the next one), on a thread of its own: the step goes on meanwhile, and the copy's
next recompute waits for it (``optim_ms``: work on the auditor, never on the step's path, which assumes the
auditor's idle time before its next audit, the pipeline's fill at least, covers it). Where it verifies the stage's input boundary too (*held*),
it recomputes from tensors its checks already hold (the link tests' copy of the stage's input). Where it audits
gradients too, it has all of a microbatch's tensors once it has checked the gradient the replica sent upstream,
and recomputes right then, among its checks (``during_step``); else at the step's end. Where it does not
(*copied*), each rank of the trusted upstream stage, once its own program is done, sends it one float32 message
with the inputs of the audited microbatches it sent the stage (``copy_ms``; the auditor receives them one rank
after another, each send returning once received): it recomputes them (outputs only) once they are all in. Where
the upstream stage is untrusted (*signed*), every rank of it signs each activation it sends the stage (SHA-256 of
the payload, then Ed25519: :func:`sign_ms`, work on the sender as it sends) and each replica checks the signature
as it takes the input (:func:`check_signature_ms`) and keeps it; at the step's end the auditor asks each replica
for its audited inputs, one replica after another (each request a link latency, sent once the copy before is in),
and each forwards them with their signatures in one float32 message once its program is done; the source's copy
follows its applied gradient on their shared link (the signatures, 64 bytes an input, are not priced). The rest follows the step's programs: it
lengthens the step where the auditor ends after the pipeline's last rank (:meth:`AuditCost.end_ms`).
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from cost_models import comm
from cost_models.cluster import Link
from planner.errors import InvalidInputError

COMPARE_PASSES = 3   # read the sent and the recomputed tensor, write their difference
GRADIENT_VALUE_BYTES = 4   # the applied gradient travels as float32 whatever the training dtype
COPY_VALUE_BYTES = 4   # copied inputs travel as float32 whatever the wire dtype
DIGEST_BYTES = 8 * 5   # int64 words: stepped or not, then a blake2b-256 digest (runtime.rank.audits.DIGEST_WORDS)
# Signed transfers, measured on a 2-core x86 VM (hashlib sha256, cryptography Ed25519), 2026-12-05:
HASH_BYTES_PER_S = 2.0e9   # SHA-256 of a payload: 1.57 MB in 0.76 ms
SIGN_MS = 0.02             # an Ed25519 signature of the digest (with the step, microbatch and boundary)
VERIFY_SIGNATURE_MS = 0.06   # an Ed25519 signature checked


@dataclass(frozen=True, slots=True)
class AuditCost:
    """One step's audit of one stage, in milliseconds."""

    recompute_ms: float   # the auditor's recomputes and comparisons of the step's audited microbatches
    gradient_ms: float    # the applied gradient, whole, from the source replica to the auditor
    digest_ms: float      # a replica's digest to the auditor, on the slowest replica's link
    optim_ms: float       # the auditor's optimizer step on its copy of the stage, off the step's path
    during_step: bool = False   # recomputed among the auditor's checks as each microbatch's tensors are in
    copy_ms: float = 0.0  # copied mode: the upstream ranks' messages of audited inputs to the auditor, in turn
    copied: bool = False  # the audited inputs come copied from the upstream stage at the step's end
    signed: bool = False  # ... from the stage's own replicas, signed by the (untrusted) upstream stage
    request_ms: float = 0.0   # signed: the auditor's request to the first replica (the later ones: in copy_ms)
    sole: bool = False    # one replica: its report is judged without the gradient, needed only by the next step
    # recomputed on the copy's stepper during the next step, before the copy steps (its verdict a step late): the
    # auditor waits for this stage's parts of the stepper's queue only (and those queued before them), from its start
    deferred: bool = False

    @property
    def total_ms(self) -> float:
        return self.copy_ms + self.recompute_ms + self.gradient_ms + self.digest_ms + self.optim_ms

    def end_ms(self, *, auditor_free_ms: float, replicas_done_ms: float, upstream_done_ms: float = 0.0,
               gradient_sent_ms: float | None = None, posted_ms: float | None = None,
               stepper_ms: tuple[float, float] | None = None) -> float:
        """When the auditor is done with the step's audit. Copied, it first receives the inputs (a transfer starts
        when both ends have posted it: the upstream ranks send once their programs are done, ``upstream_done_ms``).
        It recomputes what is left once it is free (``auditor_free_ms``: its program and its audits of earlier
        stages done) and the inputs are in, then asks for the digests (the replicas send after their optimizer
        steps) and, where it has twins, the source's gradient, whose receive it posted as its program ended
        (``posted_ms``; None: ``auditor_free_ms``); deferred, no sooner than its stepper is through this stage's
        parts (``stepper_ms``, :meth:`heard_ms`); its copy steps once the gradient is in, off the step's path."""
        posted = auditor_free_ms if posted_ms is None else posted_ms
        start = self.inputs_in_ms(auditor_free_ms=auditor_free_ms, upstream_done_ms=upstream_done_ms,
                                  gradient_sent_ms=gradient_sent_ms if gradient_sent_ms is not None else replicas_done_ms,
                                  posted_ms=posted)
        return self.heard_ms(recompute_from_ms=start, replicas_done_ms=replicas_done_ms, posted_ms=posted,
                             gradient_sent_ms=gradient_sent_ms, stepper_ms=stepper_ms)

    def inputs_in_ms(self, *, auditor_free_ms: float, upstream_done_ms: float = 0.0,
                     gradient_sent_ms: float = 0.0, posted_ms: float | None = None) -> float:
        """When the auditor can recompute: it is free (``auditor_free_ms``) and, copied, the inputs in (received in
        turn from when both ends are there: ``upstream_done_ms``, the senders' programs done). Signed, the replicas
        send once they have its request, the source's copy behind its applied gradient (sent from
        ``gradient_sent_ms``, received from when the auditor posted its receive, ``posted_ms``, its program done;
        None: ``auditor_free_ms``) on their one link."""
        if not self.copied:
            return auditor_free_ms
        start = max(auditor_free_ms, upstream_done_ms)
        if self.signed:
            posted = auditor_free_ms if posted_ms is None else posted_ms
            start = max(start, auditor_free_ms + self.request_ms, max(gradient_sent_ms, posted) + self.gradient_ms)
        return start + self.copy_ms

    def heard_ms(self, *, recompute_from_ms: float, replicas_done_ms: float, posted_ms: float | None = None,
                 gradient_sent_ms: float | None = None, stepper_ms: tuple[float, float] | None = None) -> float:
        """When the auditor, recomputing what is left from ``recompute_from_ms``, has heard the digests (asked
        for once it is done, sent once the replicas are) and the source's gradient, which travels from when the
        source sent it (``gradient_sent_ms``, its optimizer step's start; None: ``replicas_done_ms``) and the
        auditor posted its receive (``posted_ms``, its own program done; None: ``recompute_from_ms``). Deferred,
        ``stepper_ms``: when its stepper is through this stage's recompute of the last step and through its copy's
        step (and all queued before them: ``planner.solver.audit_stepper.Stepper.through_ms``; None: this stage's
        parts alone from the step's start, as on an idle auditor): the verdict's wait comes before the digests
        are asked for, the copy's step's before the auditor goes on (``runtime.rank.audits.end_step``)."""
        recomputed, stepped = self._stepper(stepper_ms)
        left = 0.0 if self.during_step or self.deferred else self.recompute_ms
        digests = max(recompute_from_ms + left, recomputed, replicas_done_ms) + self.digest_ms
        gradient_in = self.gradient_in_ms(replicas_done_ms=replicas_done_ms, posted_ms=posted_ms
                                          if posted_ms is not None else recompute_from_ms,
                                          gradient_sent_ms=gradient_sent_ms)
        if self.sole:
            # it must be in, and the copy stepped, by the next step's recompute (``recompute_from_ms`` into it), and
            # in before the source's next send (``sent`` into it, on the same link): times from the step's start
            sent = replicas_done_ms if gradient_sent_ms is None else gradient_sent_ms
            return max(digests, gradient_in - min(recompute_from_ms - self.optim_ms, sent), stepped)
        return max(digests, gradient_in, stepped)

    def _stepper(self, stepper_ms: tuple[float, float] | None) -> tuple[float, float]:
        """(through this stage's deferred recompute, through its copy's step) on the stepper; (0, 0): not deferred."""
        if not self.deferred:
            return 0.0, 0.0
        return (self.recompute_ms, self.stepper_done_ms) if stepper_ms is None else stepper_ms

    @property
    def stepper_done_ms(self) -> float:
        """Deferred: when the copy's stepper is through this stage's recompute of the last step and its copy's
        step, from the step's start (the auditor's step's end waits for both: ``runtime.rank.audit_verdicts._collect``,
        ``StageCopy.step_later``); the work alone, as on an idle auditor holding no other stage's parts: where the
        auditor runs passes of its own or defers several stages, ``planner.solver.audit_stepper.Stepper`` runs the
        queue (0: not deferred)."""
        return self.recompute_ms + self.optim_ms if self.deferred else 0.0

    def gradient_in_ms(self, *, replicas_done_ms: float, posted_ms: float, gradient_sent_ms: float | None = None) -> float:
        """When the source's gradient is in: sent from ``gradient_sent_ms`` (None: ``replicas_done_ms``), received
        from when the auditor posted its receive (``posted_ms``). The copy steps from then (``optim_ms``), at the
        earliest once the auditor has heard the digests."""
        sent = replicas_done_ms if gradient_sent_ms is None else gradient_sent_ms
        return max(sent, posted_ms) + self.gradient_ms


def applied_gradient_bytes(params: int, param_tensors: int) -> float:
    """The applied gradient as the source sends it (``audits.StageCopy.flat_size`` values)."""
    return float(GRADIENT_VALUE_BYTES * (params + param_tensors))


def copied_input_bytes(input_bytes: float, elem_bytes: int) -> float:
    """One microbatch's input as the upstream ranks copy it: float32 (``COPY_VALUE_BYTES``), from its bytes at
    ``elem_bytes`` a value. An integer input (token ids) travels as float64, twice that: not priced (only a
    stage's activations, floating point, are copied: the first stage, fed data, is never audited)."""
    return input_bytes * COPY_VALUE_BYTES / elem_bytes


def sign_ms(payload_bytes: float) -> float:
    """What signing one activation of ``payload_bytes`` costs its sender: hash it, sign the digest."""
    return 1e3 * payload_bytes / HASH_BYTES_PER_S + SIGN_MS


def signing_work(payload_bytes: float, signers: Sequence[Hashable], checkers: Sequence[Hashable],
                 out: dict[Hashable, float]) -> None:
    """Add to ``out`` what each forward costs for one stage's signed inputs: each rank (device) of the stage before
    signs the activation it sends, each replica checks its input's signature."""
    for who, ms in [(s, sign_ms(payload_bytes)) for s in signers] + \
            [(c, check_signature_ms(payload_bytes)) for c in checkers]:
        out[who] = out.get(who, 0.0) + ms


def check_signature_ms(payload_bytes: float) -> float:
    """What checking the signature of one input of ``payload_bytes`` costs its receiver: hash it, verify."""
    return 1e3 * payload_bytes / HASH_BYTES_PER_S + VERIFY_SIGNATURE_MS


def copy_ms(*, every: int, sent_microbatches: int, input_bytes: float, link: Link | None) -> float:
    """One upstream rank's message of the audited inputs, ``sent_microbatches`` of which it sends the stage a
    step (one in ``every`` audited, expected), each ``input_bytes`` (float32, :func:`copied_input_bytes`);
    ``link`` None: it is the auditor itself (nothing travels)."""
    if link is None:
        return 0.0
    return comm.transfer_ms(sent_microbatches / every * input_bytes, link)


def audit_ms(*, every: int, microbatches: int, params: int, param_tensors: int, forward_ms: float,
             output_bytes: float, source_link: Link, digest_link: Link, verifier_mem_bw_bytes_per_s: float,
             optim_ms: float, backward_ms: float | None = None, input_bytes: float = 0.0,
             copy_links: Sequence[tuple[Link | None, int]] = (), input_elem_bytes: int = 4,
             signed: bool = False, sole: bool = False) -> AuditCost:
    """The expected cost of one step's audit of a stage running ``microbatches`` a step, one in ``every``
    audited. ``forward_ms``/``backward_ms`` (None: activations only): the stage's passes of one microbatch on
    the auditor; ``output_bytes``/``input_bytes``: one microbatch's output and input at the training dtype,
    ``input_elem_bytes`` a value (the input gradient is compared too when ``backward_ms`` is given);
    ``source_link``: from the source replica to the auditor, ``digest_link``: the slowest from a replica to it;
    ``optim_ms``: the optimizer step of the stage on the auditor. ``copy_links`` (copied mode, outputs only):
    per upstream rank, its link to the auditor (None: the auditor itself) and the microbatches it sends the
    stage a step; the auditor receives their copies of the audited inputs one after another (:func:`copy_ms`).
    ``signed``: the copies come from the stage's own replicas (``copy_links`` theirs), each on the auditor's
    request over the same link (a latency), sent once the copy before is in: the first request is ``request_ms``,
    the later ones count in ``copy_ms``. ``sole``: the stage runs on one replica, whose report the auditor judges
    without the gradient: its step's end waits for the digests, and for the gradient only as far as the next
    step's recompute and the source's next send need it (:meth:`AuditCost.heard_ms`)."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise InvalidInputError("audit every", expected="one audited microbatch in every >= 1", found=repr(every))
    if microbatches < 0:
        raise InvalidInputError("audit microbatches", expected="microbatches >= 0 a step", found=str(microbatches))
    for name, value in (("params", params), ("param_tensors", param_tensors), ("forward_ms", forward_ms),
                        ("output_bytes", output_bytes), ("input_bytes", input_bytes), ("optim_ms", optim_ms),
                        ("backward_ms", backward_ms or 0.0)):
        if value < 0:
            raise InvalidInputError(f"audit {name}", expected=">= 0", found=str(value))
    if verifier_mem_bw_bytes_per_s <= 0:
        raise InvalidInputError("verifier memory bandwidth", expected="> 0 bytes/s",
                                found=str(verifier_mem_bw_bytes_per_s))
    grads = backward_ms is not None
    if copy_links and grads:
        raise InvalidInputError("copied audit", expected="outputs only (backward_ms None) where the inputs come "
                                "copied", found="backward_ms given", fix="audit gradients only where held")
    if signed and not copy_links:
        raise InvalidInputError("signed audit", expected="the replicas' copy links", found="none",
                                fix="pass copy_links for the replicas forwarding the signed inputs")
    if input_elem_bytes <= 0:
        raise InvalidInputError("audit input element bytes", expected="> 0", found=str(input_elem_bytes))
    # signed inputs travel as their wire bytes (``audit_signed.pack``), copies from trusted ranks as float32
    one_input = input_bytes if signed else copied_input_bytes(input_bytes, input_elem_bytes)
    copy = sum(copy_ms(every=every, sent_microbatches=n, input_bytes=one_input, link=link) for link, n in copy_links)
    requests = [link.latency_ms for link, _ in copy_links if link is not None] if signed else []
    copy += sum(requests[1:])
    compared = output_bytes + (input_bytes if grads else 0.0)
    one = forward_ms + (backward_ms or 0.0) + 1e3 * COMPARE_PASSES * compared / verifier_mem_bw_bytes_per_s
    return AuditCost(recompute_ms=microbatches / every * one,
                     gradient_ms=comm.transfer_ms(applied_gradient_bytes(params, param_tensors), source_link),
                     digest_ms=comm.transfer_ms(DIGEST_BYTES, digest_link), optim_ms=optim_ms, during_step=grads,
                     copy_ms=copy, copied=bool(copy_links), signed=signed, request_ms=requests[0] if requests else 0.0,
                     sole=sole, deferred=not grads)
