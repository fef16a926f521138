"""Replicas check each other: a trusted verifier's monitor of each replica's gradient contribution.

The replicas of one stage run the same function on different data: before their all-reduce, their gradient
contributions are exchangeable, so each one's log norm minus its peers' median (and its density, minus its
peers') has mean zero, whatever the stage's training does, and twins' directions agree (a positive cosine:
they descend the same loss). Each replica sends the verifier a sketch of its flat contribution
(:func:`sketch`: its norm, its density and a count sketch of its direction, ``SKETCH_SIZE`` floats whatever
the stage's size); the verifier (:class:`ContributionMonitor`) keeps a CUSUM per replica and test of those
offsets in robust deviations (their spread learnt from in-control steps only), and one of the stage's
agreement. When a norm or density CUSUM alarms it flags the replica whose own level jumped at the alarm's
onset (twins share the stage's trend; with two replicas the offsets are mirror images, so only that tells
which twin moved). When the agreement alarms (a sign flip) it flags the odd one out of three or more; of
two, the one whose direction agrees more with the stage's recent sum (:data:`RESPONSE_Z`). Flags are
step-level flag events of the verifiers' exchange (``blame.FLAG_EVENTS_SCHEMA`` with a ``stage`` key): the
replica's own evidence, never outranked by another sender's flags (``blame.blame_weights``). A non-finite contribution is flagged at once.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from planner.errors import InvalidInputError
from planner.integrity.contribution_blame import culprit_of
from planner.integrity.contribution_history import (
    StageHistory,
    cusum_step,
    learn,
    level_of,
    median,
    spread_of,
    unit,
)
from planner.integrity.contribution_sketch import (
    SKETCH_DIMS,
    SKETCH_SIZE,
    sketch,
    sketch_seed,
)
from planner.integrity.contribution_tuning import (
    BEFORE_STEPS,
    CONTRIB_REASONS,
    CUSUM_H,
    CUSUM_RESTART,
    HISTORY_BETA,
    SERIES_STEPS,
    STAGE_SERIES,
    SUSPECT_H,
    WARMUP_STEPS,
)

__all__ = ["BEFORE_STEPS", "CONTRIB_REASONS", "SKETCH_DIMS", "SKETCH_SIZE", "SUSPECT_H", "WARMUP_STEPS",
           "ContributionMonitor", "sketch", "sketch_seed"]


class ContributionMonitor:
    """The verifier's view of every replicated untrusted stage's gradient contributions."""

    def __init__(self, *, seed: int = 0) -> None:
        self.seed = int(seed)
        self._stages: dict[int, StageHistory] = {}
        self._centers: dict[int, torch.Tensor] = {}
        self._radii: dict[int, float] = {}
        self.flagged = 0
        self.checked = 0

    def check(self, stage: int, contributions: Mapping[int, torch.Tensor], *, step: int) -> list[dict[str, Any]]:
        """Sketch full contributions (rank -> flat gradient) here and :meth:`judge` them (the emulation's
        path; the runtime sends sketches). Also keeps the EMA of their mean (a centered clipping reference)."""
        seed = sketch_seed(self.seed, stage)
        events = self.judge(stage, {r: sketch(c, seed=seed) for r, c in contributions.items()}, step=step)
        flagged = {e["sender"] for e in events}
        kept = [c.detach().reshape(-1).float() for r, c in contributions.items() if r not in flagged]
        if kept:
            mean = torch.stack(kept).mean(dim=0)
            old = self._centers.get(stage)
            if old is not None:   # distances clipped to the radius: an outlier grows it 5% a step at most
                was = self._radii.get(stage)
                cap = math.inf if was is None else 1.5 * was
                radius = sum(min(float((c - old).norm()), cap) for c in kept) / len(kept)
                self._radii[stage] = radius if was is None else HISTORY_BETA * was + (1 - HISTORY_BETA) * radius
            self._centers[stage] = mean if old is None else HISTORY_BETA * old + (1 - HISTORY_BETA) * mean
        return events

    def suspects(self, stage: int) -> set[int]:
        """The replicas of ``stage`` whose norm or density CUSUM is at :data:`SUSPECT_H` or more."""
        hist = self._stages.get(stage)
        return set() if hist is None else {r for (r, test, _), v in hist.sums.items()
                                           if r != STAGE_SERIES and test in ("norm", "dens") and v >= SUSPECT_H}

    def vouch(self, stage: int, rank: int) -> None:
        """An audit proved ``rank``'s contribution the stage's gradient on its own data: its offsets were honest
        variation, its norm and density CUSUMs restart from zero."""
        hist = self._stages.get(stage)
        for key in [] if hist is None else [k for k in hist.sums if k[0] == rank and k[1] in ("norm", "dens")]:
            hist.sums[key] = 0.0

    def radius(self, stage: int) -> float | None:
        """The EMA of accepted contributions' distance to :meth:`center` (a centered clipping radius)."""
        return self._radii.get(stage)

    def center(self, stage: int) -> torch.Tensor | None:
        """The EMA of the stage's accepted mean contribution (None before one)."""
        return self._centers.get(stage)

    def judge(self, stage: int, sketches: Mapping[int, torch.Tensor], *, step: int) -> list[dict[str, Any]]:
        """Step-level flag events for the replica (at most one a stage and step) whose contribution has
        stood out from its peers' for several steps."""
        for rank, s in sketches.items():
            if s.shape != (SKETCH_SIZE,):
                raise InvalidInputError(f"gradient sketch of rank {rank}", expected=f"{SKETCH_SIZE} floats",
                                        found=str(tuple(s.shape)))
        hist = self._stages.setdefault(stage, StageHistory())
        ranks = sorted(sketches)
        self.checked += len(ranks)
        broken = [r for r in ranks if not torch.isfinite(sketches[r]).all()]
        if broken:   # not a number: no honest gradient is, and it would poison the sum
            # once one did, the sum put it into every replica's weights: the first to send one stays the culprit
            first = [r for r in broken if r in hist.poisoned] or broken
            hist.poisoned.update(first)
            self.flagged += len(first)
            return [_event(step, stage, r, {"norm": math.inf}, ("contrib_nonfinite",)) for r in first]
        values = {"norm": {r: math.log(max(float(sketches[r][0]), 1e-30)) for r in ranks},
                  "dens": {r: float(sketches[r][1]) for r in ranks}}
        units = {r: unit(sketches[r][2:]) for r in ranks}
        if len(ranks) < 2:
            learn(hist, units, {})
            return []
        offsets = {t: {r: v[r] - median([v[o] for o in ranks if o != r]) for r in ranks} for t, v in values.items()}
        values["agree"] = {r: float(units[r] @ unit(sum(units[o] for o in ranks if o != r))) for r in ranks}
        if hist.response is not None:   # each replica's agreement with the stage's recent sent sums
            values["resp"] = {r: float(units[r] @ unit(hist.response)) for r in ranks}
            if hist.sums.get((STAGE_SERIES, "agree", 1), 0.0) > 0.0 and hist.response_before is not None:
                # ... and with the part of them sent since the onset only (what the updates since answered)
                gone = HISTORY_BETA ** (step - hist.onsets[(STAGE_SERIES, "agree", 1)])
                since = unit(hist.response - gone * hist.response_before)
                values["post"] = {r: float(units[r] @ since) for r in ranks}
            offsets["resp"] = {r: values["resp"][r] - median([values["resp"][o] for o in ranks if o != r])
                               for r in ranks}
        agree = sum(values["agree"].values()) / len(ranks)
        scores: dict[int, dict[str, float]] = {r: {} for r in ranks}
        alarms: set[str] = set()
        running = hist.steps >= WARMUP_STEPS
        for test in ("norm", "dens"):
            spread = spread_of(hist, test)
            for r, value in offsets[test].items():
                scores[r][f"{test}_offset"] = round(value, 6)
                for side in (1, -1) if running and math.isfinite(spread) else ():
                    scores[r][f"{test}_cusum{'+' if side > 0 else '-'}"] = \
                        cusum_step(hist, (r, test, side), side * value / spread, step)
                    if hist.sums[(r, test, side)] >= CUSUM_H:
                        alarms.add(test)
        level, spread = level_of(hist), spread_of(hist, "agree")
        if running and math.isfinite(spread):   # one-sided: twins that agree more are no threat
            if hist.sums.get((STAGE_SERIES, "agree", 1), 0.0) <= 0.0:
                hist.response_before = hist.response   # the history as this run of evidence may begin
            # a flip of one of two mirrors the agreement to -level: the CUSUM's reference is halfway, at level / 2
            # (a level learnt early, when twins agree most, then drifts down without alarming)
            drop = cusum_step(hist, (STAGE_SERIES, "agree", 1), (max(level, 0.0) / 2 - agree) / spread, step)
            for r in ranks:
                scores[r]["agree"], scores[r]["agree_cusum"] = round(values["agree"][r], 6), drop
            if drop >= CUSUM_H:
                alarms.add("agree")
        for test, per_rank in values.items():
            for r, value in [*per_rank.items(), (STAGE_SERIES, median(list(per_rank.values())))]:
                series = hist.series.setdefault((test, r), [])
                series.append((step, value))
                del series[:max(0, len(series) - SERIES_STEPS)]
        events = []
        culprit = culprit_of(hist, alarms, ranks, step)
        if culprit is not None:
            rank, test, evidence, onset = culprit
            reason = {"norm": "contrib_norm", "dens": "contrib_density", "agree": "contrib_dir"}[test]
            events.append(_event(step, stage, rank, {**scores[rank], **evidence}, (reason,), since=onset))
            self.flagged += 1
            for key in [k for k, v in hist.sums.items() if v >= CUSUM_H and k[1] != "agree"]:
                hist.sums[key] = CUSUM_RESTART   # a lasting offset alarms again next step, an honest blip decays
        # the agreement's alarm is not reset (its culprit is re-judged every step), only kept within reach of
        # coming back: a lasting flip is flagged every step
        agreement = (STAGE_SERIES, "agree", 1)
        hist.sums[agreement] = min(hist.sums.get(agreement, 0.0), 2 * CUSUM_H)
        # each test learns from its own in-control steps: a flip that stands unattributed for long does not
        # freeze what the norm test knows of honest norms
        learnt = {t: v for t, v in offsets.items() if t not in alarms and (t != "resp" or "agree" not in alarms)}
        if "agree" not in alarms:
            learnt["agree"] = {STAGE_SERIES: agree}
            if "resp" in values:
                learnt["resp_level"] = {STAGE_SERIES: median(list(values["resp"].values()))}
        learn(hist, units, learnt)
        return events


def _event(step: int, stage: int, rank: int, scores: Mapping[str, float], reasons: tuple[str, ...],
           since: int | None = None) -> dict[str, Any]:
    """A step-level flag event in the verifiers' exchange format (``blame.FLAG_EVENTS_SCHEMA``); ``since``: the
    step its evidence began, where before ``step`` (recovery resumes from before it: that step's update took it in)."""
    return {"type": "flag", "step": int(step), "mb": -1, "boundary": int(stage), "direction": "grad",
            "sender": int(rank), "scope": "step", "stage": int(stage),
            **({"since": int(since)} if since is not None and since < step else {}),
            "scores": {k: (round(v, 6) if math.isfinite(v) else 1e9) for k, v in scores.items()},
            "fences": {"cusum": CUSUM_H}, "reasons": list(reasons)}
