"""Audits: a link test on a secret random share of a replica's microbatches.

A replica that sends stale or damped outputs (or noise on its gradients) keeps every distribution the
boundary monitors read, and its twin computes on other data: nothing but its own function, applied to
its own input, tells its output wrong. The verifier therefore recomputes the stage on a share of the
replica's microbatches: the replica's upstream sender (or the verifier's copy of the boundary) hands the
verifier the audited microbatch's input, the verifier runs the stage (it holds the stage's weights, the
replicas' all-reduced sum it watches anyway) and compares its result to what the replica sent. An honest
replica's output is its stage applied to its input, up to the numerics of another device
(:data:`TOLERANCE`); anything further off is proof, not a tendency: the replica is banned at its first
failed audit (``bans.BanTest``, ``proven``).

Which microbatches are audited (:class:`AuditSchedule`): each replica's microbatches, in order, fall
into windows of ``every``; one of each window, at a position drawn from a keyed hash of the verifier's
secret, is audited. The replica cannot tell which (it sends its output before the verifier asks for the
input copy, and cannot compute the hash), so an attacker that corrupts a share ``q`` of its microbatches
is caught in each window with probability ``q``, and one that corrupts all of them within ``2 every - 1``
microbatches (a uniform draw per microbatch would leave a ``(1 - 1/every)^n`` chance of none in ``n``).
A sender under suspicion (any unresolved evidence, ``Verifier.unresolved``, or any flag or alert of the step
before, :func:`flagged_senders`) is audited on every microbatch until its evidence clears: a flag costs an audit,
never a ban by itself.

An audit event is a microbatch flag of the verifiers' exchange (``blame.FLAG_EVENTS_SCHEMA``, reason
:data:`AUDIT_REASON`): the sender's own evidence, outside the causal order (its input was the one it
received, so nothing upstream explains a mismatch). So is a step-level one
(:func:`applied_gradient_event`) against a replica whose reported update differs from its trusted twin's, and
a failed audit whose verdict came a step late (:func:`late_audit_event`: its ``since`` is the audited step).
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from planner.errors import InvalidInputError
from planner.integrity.contributions import SKETCH_SIZE, sketch

__all__ = [
    "AUDIT_REASON",
    "DEFAULT_EVERY",
    "TOLERANCE",
    "VOUCH_SHARE",
    "AuditLedger",
    "AuditSchedule",
    "applied_gradient_event",
    "audit_event",
    "contribution_error",
    "contribution_event",
    "failed_audits",
    "flagged_senders",
    "is_audit",
    "late_audit_event",
    "recompute_grads",
    "recompute_input_grad",
    "recompute_output",
    "relative_error",
    "sketch_error",
    "vouches",
]

AUDIT_REASON = "audit"
DEFAULT_EVERY = 4
# Relative error (``relative_error``) an honest replica's output may have against the verifier's recompute,
# by the dtype the stage runs in: another device's kernels (typically fp32 ~1e-6 a layer, TF32 matmuls ~1e-3,
# bf16 / fp16 autocast ~1e-2; not measured here: the emulation recomputes bit-exactly) against the smallest
# corruption worth an audit (damping by 0.5 is 0.5, a stale output
# of other data ~1.4, noise of the gradient's own size 1.0).
TOLERANCE = {"float32": 0.01, "bfloat16": 0.05, "float16": 0.05}
# A passed audit vouches for its tensor (withdraws the statistics' flags of it, ``Verifier.record_audit``) only
# this far inside the tolerance: near a recompute's own noise, so a steady bias just under the tolerance, the sign
# test's to catch, is not vouched for (review of issue 37's vouching).
VOUCH_SHARE = 0.01


@dataclass(frozen=True, slots=True)
class AuditSchedule:
    """Which of a sender's microbatches the verifier audits: each one independently, with probability
    ``1 / every``, by a draw keyed by ``secret`` (the verifier's, never sent to a replica). Independent draws,
    not one per window of ``every``: a replica that can tell an audited step from another (the auditor's work
    shows in the step's end) learns nothing of which of its next microbatches will be audited."""

    secret: bytes = field(repr=False)   # never in a log: whoever reads it can tell the audited microbatches
    every: int = DEFAULT_EVERY

    def __post_init__(self) -> None:
        if not isinstance(self.secret, bytes) or len(self.secret) < 16:
            raise InvalidInputError("audit secret", expected="at least 16 random bytes (secrets.token_bytes(16))",
                                    found=f"{type(self.secret).__name__} of length {len(self.secret)}")
        if not isinstance(self.every, int) or self.every < 1:
            raise InvalidInputError("audit share", expected="every >= 1 microbatches (1: audit all)",
                                    found=repr(self.every))

    @property
    def share(self) -> float:
        return 1.0 / self.every

    def audited(self, sender: int, step: int, slot: int, per_step: int, *, suspected: bool = False) -> bool:
        """Whether ``sender``'s ``slot``-th microbatch of ``step`` (of its ``per_step`` a step) is audited: drawn
        with probability ``share``, or every one while it is ``suspected`` (it has unresolved evidence)."""
        if not 0 <= slot < per_step:
            raise InvalidInputError("audited microbatch", expected=f"a slot in [0, {per_step})", found=str(slot))
        if suspected:
            return True
        digest = hashlib.blake2b(f"{sender}:{step}:{slot}".encode(), key=self.secret[:64], digest_size=8).digest()
        return int.from_bytes(digest, "big") % self.every == 0


def relative_error(sent: torch.Tensor, recomputed: torch.Tensor) -> float:
    """``|sent - recomputed| / |recomputed|`` (inf for another shape or a non-finite value)."""
    if sent.shape != recomputed.shape:
        return math.inf
    a, b = sent.detach().float().reshape(-1), recomputed.detach().float().reshape(-1)
    diff, norm = float((a - b).norm()), float(b.norm())
    if not (math.isfinite(diff) and math.isfinite(norm)):
        return math.inf
    return diff / norm if norm > 0 else (0.0 if diff == 0 else math.inf)


def recompute_output(stage: torch.nn.Module, stage_input: torch.Tensor) -> torch.Tensor:
    """The stage's output on the audited input (the activation the replica should have sent)."""
    with torch.no_grad():
        return stage(stage_input.detach())


def recompute_input_grad(stage: torch.nn.Module, stage_input: torch.Tensor,
                         output_grad: torch.Tensor) -> torch.Tensor:
    """The gradient the replica should have sent upstream: its input's, given the gradient it received."""
    return recompute_grads(stage, stage_input, output_grad)[0]


def recompute_grads(stage: torch.nn.Module, stage_input: torch.Tensor,
                    output_grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The audited microbatch's input gradient (what the replica sends upstream) and its parameters' gradient,
    flat (its part of the replica's contribution to the all-reduce); the stage's ``.grad`` are left alone."""
    params = [p for p in stage.parameters() if p.requires_grad]
    x = stage_input.detach().requires_grad_(stage_input.is_floating_point())
    with torch.enable_grad():
        out = stage(x)
        wrt = ([x] if x.requires_grad else []) + params
        grads = torch.autograd.grad(out, wrt, output_grad.detach(), allow_unused=True)
    if not x.requires_grad:   # token ids: no input gradient to send
        grads = (torch.zeros_like(stage_input, dtype=torch.float32), *grads)
    flat = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads[1:])]
    return grads[0], torch.cat([g.reshape(-1) for g in flat]) if flat else torch.zeros(0)


def sketch_error(sent: torch.Tensor, recomputed: torch.Tensor) -> float:
    """:func:`relative_error` of two gradient sketches (``contributions.sketch``: norm, density, unit count
    sketch): the count sketch is linear, so the sketch of a replica's per-microbatch gradient is compared
    without the gradient itself leaving the replica (the norms too: a sketch's buckets can cancel)."""
    norms = sent[0], recomputed[0]
    raw = sent[2:] * norms[0], recomputed[2:] * norms[1]
    gap = abs(float(norms[0]) - float(norms[1])) / float(norms[1]) if float(norms[1]) > 0 \
        else (0.0 if float(norms[0]) == 0 else math.inf)   # two zero gradients agree
    err = max(relative_error(*raw), gap)
    return err if math.isfinite(err) else math.inf


def contribution_error(sent_sketch: torch.Tensor, recomputed: Iterable[torch.Tensor], *, seed: int) -> float:
    """:func:`sketch_error` of a replica's reported contribution sketch (``contributions.sketch`` of its flat
    gradient before its stage's all-reduce) against the sketch of the sum of its step's recomputed parameter
    gradients, one flat tensor per microbatch (every microbatch it ran that step: else the sum is not its
    contribution). inf where none is given or the shapes differ."""
    parts = list(recomputed)
    if not parts or any(p.shape != parts[0].shape for p in parts):
        return math.inf
    total = torch.stack([p.detach().float().reshape(-1) for p in parts]).sum(0) if len(parts) > 1 \
        else parts[0].detach().float().reshape(-1)
    if sent_sketch.shape != (SKETCH_SIZE,):
        return math.inf
    return sketch_error(sent_sketch.detach().to("cpu", torch.float64), sketch(total, seed=seed))


def contribution_event(*, step: int, stage: int, sender: int, error: float,
                       tolerance: float) -> dict[str, Any] | None:
    """The flag of a failed contribution audit (None where it passed): ``sender``'s reported gradient
    contribution to ``stage``'s all-reduce is not the sum of its recomputed microbatches' (proof, as a failed
    audit's); a step-level flag of the stage's gradient, banned at once (``failed_audits``)."""
    if error <= tolerance:
        return None
    return {"type": "flag", "step": int(step), "mb": -1, "boundary": int(stage), "direction": "grad",
            "sender": int(sender), "scope": "step", "scores": {AUDIT_REASON: min(error, 1e9)},
            "fences": {AUDIT_REASON: float(tolerance)}, "reasons": [AUDIT_REASON]}


class AuditLedger:
    """Per sender, the steps its audits vouched for: where a failed audit's recovery must resume from (the
    microbatches since the last vouched step were never checked; a ban's first flagged step may be later).
    A step with a failed audit of the sender vouches for nothing, whatever else of it passed."""

    KEPT = 64   # vouched steps remembered per sender

    def __init__(self) -> None:
        self.passed: dict[int, list[int]] = {}
        self.failed: dict[int, set[int]] = {}

    def record(self, sender: int, step: int, *, passed: bool) -> None:
        if not passed:
            self.failed.setdefault(sender, set()).add(step)
            return
        steps = self.passed.setdefault(sender, [])
        if step not in steps:
            steps.append(step)
            del steps[:max(0, len(steps) - self.KEPT)]

    def suspect_since(self, sender: int, failed_at: int) -> int:
        """The first step a failed audit at ``failed_at`` leaves unvouched for (0 without a vouched step)."""
        bad = self.failed.get(sender, set())
        vouched = [s for s in self.passed.get(sender, []) if s < failed_at and s not in bad]
        return max(vouched) + 1 if vouched else 0


def vouches(error: float, tolerance: float) -> bool:
    """Whether an audit's relative ``error`` is close enough to none to vouch for the tensor (``VOUCH_SHARE``)."""
    return error <= VOUCH_SHARE * tolerance


def audit_event(*, step: int, mb: int, boundary: int, direction: str, sender: int, error: float,
                tolerance: float) -> dict[str, Any] | None:
    """The flag of a failed audit (None where it passed), in the verifiers' exchange format."""
    if error <= tolerance:
        return None
    return {"type": "flag", "step": int(step), "mb": int(mb), "boundary": int(boundary), "direction": direction,
            "sender": int(sender), "scope": "microbatch", "scores": {AUDIT_REASON: min(error, 1e9)},
            "fences": {AUDIT_REASON: float(tolerance)}, "reasons": [AUDIT_REASON]}


def applied_gradient_event(*, step: int, stage: int, sender: int) -> dict[str, Any]:
    """The flag of a replica of ``stage`` that reported applying another gradient than the one its trusted
    twin applied: the replicas step with one all-reduced sum, so it lies about its own state (proof, as a failed
    audit's); a step-level flag of its stage's gradient."""
    return {"type": "flag", "step": int(step), "mb": -1, "boundary": int(stage), "direction": "grad",
            "sender": int(sender), "scope": "step", "scores": {AUDIT_REASON: 1e9}, "fences": {AUDIT_REASON: 0.0},
            "reasons": [AUDIT_REASON]}


def late_audit_event(event: Mapping[str, Any], *, at_step: int) -> dict[str, Any]:
    """A failed audit's flag (``audit_event``) whose verdict came at ``at_step``, after its audited step (the
    runtime recomputes a step's audits during the next one): a step-level flag of ``at_step`` whose evidence began
    at the audited step (``since``), so the ban's first flagged step, where recovery resumes before, is that step."""
    audited = int(event["step"])
    if at_step < audited:
        raise InvalidInputError("late audit verdict", expected=f"a step >= the audited step {audited}",
                                found=str(at_step))
    return {**event, "step": int(at_step), "mb": -1, "scope": "step", "since": audited}


def is_audit(event: Mapping[str, Any]) -> bool:
    return AUDIT_REASON in event.get("reasons", ())


def failed_audits(flags: Iterable[Mapping[str, Any]]) -> set[int]:
    """The senders with a failed audit among ``flags`` (proof alone: ``bans.BanTest`` bans them at once)."""
    return {int(e["sender"]) for e in flags if is_audit(e)}


def flagged_senders(flags: Iterable[Mapping[str, Any]]) -> set[int]:
    """The senders a step's flags name, alerts and unblamed lone microbatch flags included (a flag's sender, and
    its input's where it is laid there, ``upstream``): each is a suspect for the next step's audits
    (``AuditSchedule.audited``'s ``suspected``; the lead verifier names them in the step's verdict, so the ranks
    that copy an auditor its inputs know them too). Such a flag is no evidence for a ban but says where to look, and
    an audit settles it (issue 37, seed 2: the adaptive attacker's activations raised a spectral alert at every
    attacked step from 20, blamed nobody, and went unaudited until the draw reached it at 29)."""
    named: set[int] = set()
    for e in flags:
        if e.get("type", "flag") == "flag":
            named.add(int(e["sender"]))
            if "upstream" in e:
                named.add(int(e["upstream"]))
    return named
