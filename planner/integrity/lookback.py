"""How far before a sender's first flag a recovery resumes, and which checkpoints stay for it, when the
sender's stage is audited on a sampled share of its microbatches (``audit.AuditSchedule``).

An attack the statistical monitors tolerate is first flagged when an audit draws one of its microbatches.
Each of a sender's ``m`` microbatches a step is audited with probability ``1 / every`` by a draw it cannot
predict, so an attack that corrupts every one of them from step ``a`` on goes unaudited for ``n`` steps with
probability ``(1 - 1 / every) ** (m n)``. With ``D`` (:func:`audit_steps`) the fewest steps where that is at
most ``eps``, the attack's first flag ``f`` is, but with probability at most ``eps``, under ``a + D``: the
checkpoint taken after step ``f - D`` holds no attacked update. Without audits (or ``every = 1``) that is the
old rule, the newest checkpoint before ``f``.

The interface assumed of the verdicts (an audit's recompute may come a step later): the step a flag is
reported at (``BanNotice.first_flagged_step``, ``Verifier.unresolved``) is the step of the microbatch whose
check raised it or earlier (a late audit's verdict names its audited step, ``audit.late_audit_event``'s
``since``; a contribution's alarm its onset), and it is known by the end of that step ``+ lag``
(:data:`VERDICT_LAG_STEPS`). Only the knowing is late, so only retention pays for it: a flag reported at
``f`` resumes from ``f - D`` or earlier; a flag not yet known at the end of step ``c`` will be reported at
``c + 1 - lag`` or later, so retention keeps a checkpoint at or before ``c + 1 - lag - D`` (the horizon).
(Until 2026-12-06 the lag was paid twice, ``f - D - lag``: one step more redone a ban.)

Retention (:meth:`Lookback.keep`): the horizon slides one step a step, so the checkpoint it needs next is
one taken after it now: besides the newest ones, the newest checkpoint of each window of ``spacing``
steps (``RUNGS`` windows a lookback) from the one before the horizon's on, and the newest one at or before
each unresolved flag's resume bound. A resume then redoes at most ``spacing`` + the checkpoint interval
steps more than the bound asks, and at most ``keep + RUNGS + 3`` checkpoints (plus one per unresolved
flag) are kept. Everything here is decided from the plan's audit shares and the trusted verdicts alone.

Not covered: an attack on a share ``q < 1`` of its microbatches needs ``D / q`` steps (the audits catch it
in ``q`` of their draws); a sender whose audits are suspended (its copy drifts) has no audit lookback.
"""
from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from planner.errors import InvalidInputError
from planner.solver.audits import MISS_TARGET

VERDICT_LAG_STEPS = 1   # a flag may be known this many steps after its microbatch's step (reported at that step)
RUNGS = 4               # retained windows per lookback: a resume's extra redo is about a quarter of it
EPS = MISS_TARGET       # the chance an attack began before the resume point: the planner's audit miss target


def audit_steps(every: int, per_step: int, eps: float = EPS) -> int:
    """The fewest steps ``n >= 1`` in which ``per_step`` microbatches a step, each audited with probability
    ``1 / every``, all go unaudited with probability at most ``eps``."""
    if not isinstance(every, int) or every < 1 or not isinstance(per_step, int) or per_step < 1:
        raise InvalidInputError("audit lookback", expected="every >= 1 and per_step >= 1 microbatches",
                                found=f"every={every!r}, per_step={per_step!r}")
    if not 0.0 < eps < 1.0:
        raise InvalidInputError("audit lookback", expected="a miss chance eps in (0, 1)", found=repr(eps))
    if every == 1:
        return 1
    return max(1, math.ceil(math.log(eps) / (per_step * math.log(1.0 - 1.0 / every)) - 1e-9))


@dataclass(frozen=True, slots=True, kw_only=True)
class Lookback:
    """Per audited sender, how many steps before its reported first flag a resume may hold (``back``: ``D``);
    every other sender resumes from before its first flag (1 step back). ``lag``: how late a flag may be known."""

    back: Mapping[int, int] = field(default_factory=dict)
    lag: int = VERDICT_LAG_STEPS

    @classmethod
    def of(cls, shares: Mapping[int, tuple[int, int]], *, eps: float = EPS, lag: int = VERDICT_LAG_STEPS) -> Lookback:
        """From ``sender -> (every, microbatches a step)`` of each audited sender."""
        return cls(back={s: audit_steps(every, m, eps) for s, (every, m) in shares.items()}, lag=lag)

    def clean_step(self, sender: int, first_flagged: int) -> int:
        """The newest step a checkpoint to resume from may hold, for ``sender`` first flagged at
        ``first_flagged`` (-1: none, the run starts again)."""
        return max(-1, first_flagged - self.back.get(sender, 1))

    def resume_bound(self, flags: Mapping[int, int]) -> int:
        """The newest step a resumed checkpoint may hold after the bans of ``flags`` (sender -> first flagged
        step): the least of their clean steps."""
        return min((self.clean_step(s, f) for s, f in flags.items()), default=math.inf)  # type: ignore[return-value]

    @property
    def horizon(self) -> int:
        """How far behind the newest completed step the audit horizon lies (0: nothing audited)."""
        return max(self.back.values()) + self.lag - 1 if self.back else 0

    @property
    def spacing(self) -> int:
        return max(1, math.ceil(self.horizon / RUNGS))

    def bounds(self, now: int, unresolved: Mapping[int, int]) -> set[int]:
        """The resume bounds to keep a checkpoint for after step ``now`` is done: each unresolved flag's
        (sender -> first flagged step) and, for an audited sender not flagged yet, the earliest its flag could
        come to (reported at ``now + 1 - lag`` or later)."""
        out = {self.clean_step(s, f) for s, f in unresolved.items()}
        out |= {self.clean_step(s, now + 1 - self.lag) for s in self.back if s not in unresolved}
        return {b for b in out if b >= 0}

    def keep(self, steps: Collection[int], *, now: int, unresolved: Mapping[int, int], newest: int) -> set[int]:
        """Of the complete checkpoints ``steps``, those to keep after step ``now``: the ``newest`` ones, the
        newest at or before each of :meth:`bounds`, and, from the window before the horizon's on, the newest of
        each window of :attr:`spacing` steps (they become the horizon's as it slides)."""
        ordered = sorted(steps)
        kept = set(ordered[-newest:]) if newest > 0 else set()
        for bound in self.bounds(now, unresolved):
            kept.update([s for s in ordered if s <= bound][-1:])
        if self.back:
            g = self.spacing
            first = (now - self.horizon) // g - 1
            windows: dict[int, int] = {}
            for s in ordered:
                if s // g >= first:
                    windows[s // g] = s
            kept.update(windows.values())
        return kept
