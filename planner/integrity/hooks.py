"""The runtime's only contact with the integrity monitors and the attack harness.

The executor calls this adapter, never ``verify.py`` / ``attacks.py``
directly, so the monitors' API can change in one place.

* :class:`VerifyHooks` owns this rank's :class:`~planner.integrity.verifier.Verifier`
  (for the boundaries the plan gives it) and resolves blame at step end. It also
  gives the monitors the microbatch's labels (token ids, class ids) for their
  ``binding`` test: every rank can rebuild any microbatch from ``(step, seed)``
  (``planner.runtime.data``), so the executor needs to send nothing for it.
* :class:`AttackHooks` owns this rank's attackers (``--attack rank=R,...`` specs
  naming it); an attacked rank corrupts what it *sends*, once per microbatch and
  direction, and the same corrupted tensor goes to the consumer and the verifier.

Several tensors may cross one edge; the monitors see them as one flat tensor
(floating-point values only), and an attack corrupts each float tensor.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from models.registry import build_model
from planner.errors import InvalidInputError
from planner.integrity.attacks import Attacker, parse_attack
from planner.integrity.blame import (
    FLAG_EVENTS_SCHEMA as FLAG_EVENTS_SCHEMA,  # the flags exchange, for the executor
)
from planner.integrity.drops import step_drops
from planner.integrity.verifier import Verifier
from planner.plan import Plan
from planner.runtime.data import PlanBatches, make_source

SUMMARY_EVENTS = 256  # verifier events a rank reports at the end of a run (the latest; all are counted)
SUMMARY_DROPS = 4096  # dropped microbatches the lead verifier names in the run summary (the first; all are counted)


def monitor_config(plan: Plan, seed: int, *, lr_warmup: int = 0) -> dict[str, Any]:
    """The monitors' config dict from the plan's ``verifier_config``. Their honest warm-up lasts at
    least the learning-rate warm-up (``lr_warmup`` steps): while the rate climbs, every boundary's
    statistics move with it, and references learnt at a tenth of the rate flag the rest of the climb
    (gpt-tiny's shape at d=256, lr 1e-3 over 20 steps: 22% of honest (step, sender) pairs flagged with
    the plan's 5-step warm-up, 1.9% with 20)."""
    out = plan.verifier_config.to_dict()
    out["warmup"] = max(int(out["warmup"]), lr_warmup)
    out["seed"] = seed
    return out


def direction_name(op_direction: str) -> str:
    """Instruction direction ("F"/"B") -> monitor direction ("act"/"grad")."""
    return "act" if op_direction == "F" else "grad"


def as_checked(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """What a monitor checks for one edge: its only float tensor, or all float values flattened."""
    floats = [t for t in tensors if t.is_floating_point()]
    if not floats:
        raise InvalidInputError("checked stage edge", expected="at least one floating-point tensor",
                                found=", ".join(str(t.dtype) for t in tensors) or "nothing",
                                fix="verify only boundaries that carry activations")
    if len(floats) == 1:
        return floats[0].detach()
    return torch.cat([t.detach().reshape(-1) for t in floats])


class VerifyHooks:
    """This rank's monitors (if the plan makes it a verifier)."""

    def __init__(self, plan: Plan, rank: int, *, seed: int = 0, data: str | None = None, lr_warmup: int = 0) -> None:
        """``data``: the run's data source (``RunOptions.data``), from which the labels are
        rebuilt; None gives the monitors no labels (a guessed source could disagree with
        the one the stages train on, and every honest microbatch would look bound to
        the wrong labels). ``lr_warmup``: the run's learning-rate warm-up steps (see
        :func:`monitor_config`)."""

        self.rank = rank
        mine = [v for v in plan.verifiers if v.rank == rank]
        pairs = [(v.boundary, d) for v in mine for d in v.directions]
        watched = [(v.boundary, d) for v in mine for d in v.watch_only]
        stage_of = {r.rank: r.stage for r in plan.ranks if r.stage is not None}
        microbatches = {r.rank: len(r.microbatches) for r in plan.ranks if r.stage is not None}
        codecs = {i: s.out_codec for i, s in enumerate(plan.stages)}   # boundary i carries stage i's out_codec
        self.verifier = Verifier(monitor_config(plan, seed, lr_warmup=lr_warmup), pairs, watched, stage_of=stage_of,
                                 microbatches=microbatches, codecs=codecs) if pairs else None
        self._labels = _Labels(plan, seed=seed, data=data) if pairs and data is not None else None
        self.banned: set[int] = set()
        self.new_bans: list[tuple[int, int]] = []  # (step, rank) as they happen
        self.logged_bans = 0  # how many of new_bans the worker has announced
        self.drops: list[dict[str, Any]] = []   # the lead verifier's: every dropped microbatch and why
        self.drops_total = 0

    def check(self, boundary: int, op_direction: str, tensors: Sequence[torch.Tensor], *, step: int, mb: int,
              sender: int, tainted: bool) -> tuple[bool, bool]:
        """(flagged, tainted) for one received microbatch tensor."""
        if self.verifier is None:
            raise InvalidInputError(f"rank {self.rank} has a VERIFY instruction for boundary {boundary}",
                                    expected="a plan verifier on this rank", found="none",
                                    fix="regenerate the plan (its programs and verifiers disagree)")
        direction = direction_name(op_direction)
        labels = self._labels.of(step, mb, direction) if self._labels is not None else None
        verdict = self.verifier.check(boundary, direction, as_checked(tensors), step=step, mb=mb, sender=sender,
                                      tainted=tainted, labels=labels)
        if verdict.flagged and sender in self.banned:
            verdict_note = {"type": "flag_after_ban", "step": step, "mb": mb, "boundary": boundary,
                            "sender": sender}
            self.verifier.events.append(verdict_note)
        return bool(verdict.flagged), bool(verdict.tainted)

    def step_flags(self, step: int) -> list[dict[str, Any]]:
        return self.verifier.flag_events(step) if self.verifier is not None else []

    def end_step(self, step: int, all_flags: Sequence[Any]) -> set[int]:
        """Resolve blame from every verifier's flags; returns the ranks banned so far."""
        if self.verifier is None:
            return set(self.banned)
        banned = self.verifier.end_step(step, all_flags)
        for r in sorted(banned - self.banned):
            self.new_bans.append((step, r))
        self.banned = set(banned)
        return set(banned)

    def record_drops(self, step: int, all_flags: Sequence[Any], *, dropped: int) -> None:
        """At the lead verifier: name the step's dropped microbatches from every verifier's flags and the
        trusted count of those that did not train (``drops.step_drops``)."""
        drops = step_drops(step, all_flags, dropped=dropped)
        self.drops_total += len(drops)
        self.drops += drops[:max(0, SUMMARY_DROPS - len(self.drops))]

    def name_drop(self, step: int, mb: int, *, boundary: int, sender: int, reason: str) -> None:
        """At the lead verifier: one of ``step``'s drops recorded with no sender (``TAINTED_BY_SENDER``) named once
        a later verdict found who made it up (an audit recomputed during the next step: ``audit_grads.resolve``)."""
        for i, drop in enumerate(self.drops):
            if drop["step"] == step and drop["sender"] is None:
                self.drops[i] = {**drop, "microbatch": mb, "boundary": boundary, "direction": "grad", "sender": sender,
                                 "reason": reason}
                return

    def summary(self) -> dict[str, Any]:
        if self.verifier is None:
            return {}
        events = self.verifier.events  # the latest only: a long attacked run logs thousands
        return {**self.verifier.summary(), "events": list(events[-SUMMARY_EVENTS:]), "events_total": len(events),
                "drops": list(self.drops), "drops_total": self.drops_total}


class _Labels:
    """The integer labels of a plan's microbatches, rebuilt from ``(step, seed)`` like the
    stage ranks' data: for activations the inputs' ids (a language model's residual
    stream carries its token), for gradients the targets (a cross-entropy gradient
    carries its target); the other one if that is not integer. The monitor uses them
    only when there is one label per row of the checked tensor."""

    def __init__(self, plan: Plan, *, seed: int, data: str) -> None:
        self.plan, self.seed, self.data = plan, seed, data
        self._batches = None

    def of(self, step: int, mb: int, direction: str) -> torch.Tensor | None:
        if self._batches is None:

            ref, config = self.plan.model, self.plan.config
            bundle = build_model(ref.spec, batch=config.microbatch_size, seq=ref.seq, device="meta", seed=self.seed)
            source = make_source(bundle, kind=self.data, seq=ref.seq, seed=self.seed)
            self._batches = PlanBatches(source, global_batch=config.global_batch,
                                        microbatch_size=config.microbatch_size)
        inputs, targets = self._batches.microbatch(step, mb)
        ids = [t for t in (inputs[0] if len(inputs) == 1 else None, targets)
               if t is not None and not t.is_floating_point() and not t.is_complex()]
        if not ids:
            return None
        return ids[-1] if direction == "grad" else ids[0]


class AttackHooks:
    """The attacks this rank carries out on what it sends (none for an honest rank)."""

    def __init__(self, specs: Sequence[str], rank: int, *, seed: int = 0) -> None:

        parsed = [parse_attack(s) for s in specs]
        self.attackers = [Attacker(s, seed) for s in parsed if s.rank == rank]
        self._sent: dict[tuple[str, int, int], list[torch.Tensor]] = {}
        self._tainted: set[tuple[str, int, int]] = set()   # what a ``kind=taint`` attacker marks dropped

    @property
    def active(self) -> bool:
        return bool(self.attackers)

    def apply(self, tensors: Sequence[torch.Tensor], *, op_direction: str, step: int, mb: int) -> list[torch.Tensor]:
        """The tensors to send for (direction, step, mb): corrupted once, then reused for every peer."""
        key = (op_direction, step, mb)
        if key not in self._sent:
            direction = direction_name(op_direction)
            out = list(tensors)
            for attacker in self.attackers:
                logged = len(attacker.log)
                out = [attacker.apply(t, direction=direction, step=step, mb=mb) if t.is_floating_point() else t
                       for t in out]
                if attacker.spec.kind == "taint" and len(attacker.log) > logged:
                    self._tainted.add(key)
            self._sent[key] = out
        return self._sent[key]

    def taints(self, *, op_direction: str, step: int, mb: int) -> bool:
        """Whether a ``kind=taint`` attack sets the taint header of what this rank sends for (direction, step, mb)
        (after ``apply``): it claims the microbatch was dropped, its values honest."""
        return (op_direction, step, mb) in self._tainted

    def poison_contribution(self, flat: torch.Tensor, *, step: int) -> torch.Tensor:
        """This rank's gradient contribution to its stage's replicas' sum, as a ``dir=params`` attack rewrites it."""
        out = flat
        for attacker in self.attackers:
            if attacker.spec.targets("params"):
                out = attacker.apply(out, direction="params", step=step, mb=0)
        return out

    def forge_inputs(self, tensors: Sequence[torch.Tensor], *, step: int, mb: int) -> list[torch.Tensor]:
        """The inputs this replica forwards its auditor for ``mb`` (signed audits), as a ``dir=inputs`` attack forges them."""
        out = list(tensors)
        for attacker in self.attackers:
            if attacker.spec.targets("inputs"):
                out = [attacker.apply(t, direction="inputs", step=step, mb=mb) if t.is_floating_point() else t
                       for t in out]
        return out

    def end_step(self) -> None:
        self._sent.clear()
        self._tainted.clear()

    def log(self) -> list[tuple[int, int, str, str]]:
        return [entry for a in self.attackers for entry in a.log]


def validate_attacks(specs: Sequence[str], num_ranks: int) -> None:
    """Parse every spec and check its rank exists (before any process starts)."""

    for s in specs:
        spec = parse_attack(s)
        if spec.rank >= num_ranks:
            raise InvalidInputError(f"--attack {s!r}", expected=f"rank < {num_ranks} (the plan's ranks)",
                                    found=str(spec.rank))
