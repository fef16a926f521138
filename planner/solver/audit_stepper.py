"""The audit copies' stepper: the thread on an auditor's device that recomputes the last step's audited
microbatches and steps each copy, sharing that device with the auditor's own program (issue 37). The simulator
and the price both run it."""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from cost_models.audit import AuditCost
from planner.errors import InvalidInputError

# A stepper part's work left below this share of it is float rounding, done (else a queue ends a part short: its
# copy's step never counted, the stepper through its queue 107 ms early on a 48.7 s recompute).
_ROUNDING = 1e-9


# The audit copies' stepper sharing its auditor's device with the auditor's own program (issue 37, review).
# A step's outputs-only audits recompute during the next step on the auditor's copy stepper, a thread of the
# auditor's own rank (``runtime.rank.audit_recompute``), followed by each copy's step: the last step's deferred
# recomputes and copy steps, queued at the step's start, one after another. That thread runs on the auditor's
# device, so it is work there: while the auditor's program idles (its pipeline fill, a wait on a message) the
# stepper runs alone; a pass (a stage's forward or backward, a check, an optimizer step) that starts while the
# stepper still has work shares the device evenly with it (two streams of kernels on one GPU, two threads on one
# core's budget): a pass of ``d`` ms lasts ``d + min(left, d)``, the stepper doing ``min(left, d)`` meanwhile. Once
# the auditor's program is done the stepper runs alone again. The simulator (``planner.simulate``) and the price
# (``drain_schedule``, ``program_cost``) both run this one rule.


@dataclass(frozen=True, slots=True)
class StepperPart:
    """One job on an auditor's copy stepper: stage ``stage``'s recompute of the last step's audited microbatches
    (``recompute``) or its copy's optimizer step, ``ms`` of work on the auditor's device alone."""

    stage: int
    recompute: bool
    ms: float

    def __post_init__(self) -> None:
        if self.ms < 0:
            raise InvalidInputError(f"stage {self.stage}'s audit stepper work", expected=">= 0 ms", found=str(self.ms))

    @property
    def label(self) -> str:
        return f"stage {self.stage} audit: " + ("last step's recompute (stepper)" if self.recompute
                                                else "copy's step (stepper)")


@dataclass(slots=True)
class Stepper:
    """One auditor's stepper: ``parts`` queued at the step's start, in order; ``ends`` the times (from the step's
    start) each part was done, as far as it went."""

    parts: tuple[StepperPart, ...]
    at_ms: float = 0.0          # the time the stepper's progress is accounted to
    part: int = 0               # the part it works on
    part_left_ms: float = 0.0   # that part's work still to do
    ends: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.part_left_ms = self.parts[0].ms if self.parts else 0.0
        self._skip_empty(self.at_ms)

    @property
    def left_ms(self) -> float:
        """The work still queued (ms on the device alone)."""
        return self.part_left_ms + sum(p.ms for p in self.parts[self.part + 1:]) if self.part < len(self.parts) \
            else 0.0

    def idle(self, until_ms: float) -> None:
        """The auditor's program does nothing on the device up to ``until_ms``: the stepper runs alone."""
        if until_ms > self.at_ms:
            self._work(self.at_ms, until_ms - self.at_ms, 1.0)
            self.at_ms = until_ms

    def share(self, start_ms: float, pass_ms: float) -> float:
        """A pass of ``pass_ms`` alone starts at ``start_ms`` (the stepper idles up to then): how long it lasts
        beside the stepper's work."""
        self.idle(start_ms)
        shared = min(self.left_ms, pass_ms)
        if shared > 0:
            self._work(start_ms, 2.0 * shared, 0.5)
        self.at_ms = max(self.at_ms, start_ms + pass_ms + shared)
        return pass_ms + shared

    def done_ms(self) -> float:
        """When the stepper is through its queue, running alone after the last pass it shared the device with."""
        self.idle(self.at_ms + self.left_ms)
        return self.ends[-1] if self.ends else 0.0

    def through_ms(self, stage: int) -> tuple[float, float]:
        """When the stepper is through stage ``stage``'s recompute of the last step, and through its copy's step
        (0: no such part), running alone once the auditor's program is done. What the auditor's step's end waits
        for there (``runtime.rank.audits``): the last step's end queued, for its stages in order, each deferred
        stage's recompute (``audit_first``) right before its copy's step (``step_later``, ``step_when_heard``), on
        one thread for all its copies, first in, first out; this step's end goes through its stages in order, and
        for stage ``k`` waits for ``k``'s verdict (``_collect``: its recompute, so every part queued before it too)
        before it asks for ``k``'s digests, then for its gradient (twins), then for ``k``'s copy's step (``settle``,
        before queuing the next) before it goes on to the next stage. So ``k`` waits for its own parts and those of
        the stages before it, never for a later stage's; the auditor's end, through its last stage, for the whole
        queue (the verifiers' exchange after it). A twin's gradient in before the auditor reaches its stage is
        hashed on a thread of its own (``_hashed_early``). Not run here: a sole replica's copy's step holds the
        stepper until its gradient is in (``step_when_heard``)."""
        self.done_ms()
        return stage_through_ms(self.parts, self.ends, stage)

    def ran_shared(self, end_ms: float) -> None:
        """Its queue done at ``end_ms`` beside passes sharing a machine's cores (``simulate(cores=...)``): each
        part drawn as ending in proportion to the work before it."""
        total, before = self.left_ms, 0.0
        for p in self.parts[self.part:]:
            before += p.ms
            self.ends.append(self.at_ms + (end_ms - self.at_ms) * (before / total if total > 0 else 1.0))
        self.part, self.part_left_ms, self.at_ms = len(self.parts), 0.0, end_ms

    def _work(self, start_ms: float, span_ms: float, rate: float) -> None:
        """Run the queue from ``start_ms`` for ``span_ms`` at ``rate`` of the device, recording the parts done."""
        t, span = start_ms, span_ms
        while self.part < len(self.parts) and span > 0:
            need = self.part_left_ms / rate
            if need - span > _ROUNDING * max(1.0, need):   # a part left a rounding error from done counts as done
                self.part_left_ms -= span * rate
                return
            t += need
            span -= need
            self.ends.append(t)
            self.part += 1
            self.part_left_ms = self.parts[self.part].ms if self.part < len(self.parts) else 0.0
            self._skip_empty(t)

    def _skip_empty(self, t: float) -> None:
        while self.part < len(self.parts) and self.part_left_ms <= 0:
            self.ends.append(t)
            self.part += 1
            self.part_left_ms = self.parts[self.part].ms if self.part < len(self.parts) else 0.0


def stepper_parts(costs: Sequence[tuple[int, Hashable, AuditCost]]) -> dict[Hashable, tuple[StepperPart, ...]]:
    """Auditor -> its stepper's queue at the step's start, from (stage, auditor, its audit's cost) in stage order:
    each deferred audit's recompute of the last step's audited microbatches, then its copy's step
    (``runtime.rank.audits``: the stages in order, each copy's step queued behind its recompute)."""
    out: dict[Hashable, list[StepperPart]] = {}
    for k, auditor, cost in costs:
        if cost.deferred:
            out.setdefault(auditor, []).extend((StepperPart(stage=k, recompute=True, ms=cost.recompute_ms),
                                                StepperPart(stage=k, recompute=False, ms=cost.optim_ms)))
    return {a: tuple(parts) for a, parts in out.items()}


def stage_through_ms(parts: Sequence[StepperPart], ends: Sequence[float], stage: int) -> tuple[float, float]:
    """(through ``stage``'s recompute, through its copy's step) on a stepper whose ``parts`` ended at ``ends``
    (``Stepper.through_ms``; 0: no such part)."""
    recomputed = stepped = 0.0
    for part, end in zip(parts, ends):
        if part.stage == stage:
            recomputed, stepped = (end, end) if part.recompute else (recomputed, end)
    return recomputed, stepped


def through_from_done(parts: Sequence[StepperPart], done_ms: float) -> dict[int, tuple[float, float]]:
    """Stage -> ``Stepper.through_ms`` from when the stepper was through its whole queue (``done_ms``) alone: each
    part ended the work queued after it before that. Exact for a part done after the auditor's last pass (then
    alone); one done before it comes out no later than that pass's end, where the auditor, free only after it,
    waits for nothing (the price's case: its replay reports the stepper's end only)."""
    after, ends = 0.0, []
    for part in reversed(parts):
        ends.append(done_ms - after)
        after += part.ms
    ends.reverse()
    return {part.stage: stage_through_ms(parts, ends, part.stage) for part in parts}
