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

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from planner.errors import InvalidInputError

__all__ = ["CONTRIB_REASONS", "SKETCH_DIMS", "SKETCH_SIZE", "ContributionMonitor", "sketch", "sketch_seed"]

SKETCH_DIMS = 64     # count-sketch buckets: cosine error ~ 1 / sqrt(64) on unrelated directions
SKETCH_SIZE = SKETCH_DIMS + 2   # [norm, density, buckets...]
WARMUP_STEPS = 5     # steps that teach the spreads and the history before anything is flagged
# Honest replicas are exchangeable: each one's log norm minus its peers' median, and its density minus its
# peers', have mean zero, whatever the stage's gradients do (a loss spike moves every replica). One step says
# little (gpt-tiny, one microbatch a replica: honest norms differ up to 3x), a persistent offset says much: a
# two-sided CUSUM per replica and test of the offset in robust deviations (Page; allowance CUSUM_K, alarm at
# CUSUM_H: ~300 honest steps between false alarms for normal scores, 3-4 steps to alarm at a 3x scale).
CUSUM_K, CUSUM_H, CUSUM_CAP = 0.5, 5.0, 4.0
# After a flag a norm or density CUSUM restarts here: an offset of 3 deviations alarms again the next step,
# a single honest spike does not (3.5, a 2-deviation restart, flags an honest twin whose norm jumps twice).
CUSUM_RESTART = 2.5
# A replica whose norm or density CUSUM reaches this is a suspect: its verifier audits every one of its
# microbatches (``audit``) until it clears, and an audit that vouches for its contribution withdraws the
# alarm (the clean runs' only false blame: honest twins' norm CUSUMs at 5.0-6.0, climbing for several steps).
SUSPECT_H = CUSUM_H / 2
# Density, l1 / (sqrt(n) l2): a gradient is concentrated (gpt-tiny's middle stage: 0.47-0.55, twins within
# 0.03 of each other a step), Gaussian noise is not (0.80): noise as large as the gradient lifts it to 0.72.
# Agreement, the mean cosine of each replica with the sum of the others: honest twins +0.3-0.5 (+-0.2-0.35 a
# step), a sign flip -0.4: a one-sided CUSUM of its drop below its in-control median alarms in 2-4 steps.
# Floors: honest replicas' log norms differ by 0.3-1.1 a step at one microbatch each (gpt-tiny), but agree
# to 0.01-0.05 in the first steps, which would teach a spread that later honest steps alarm against.
SPREAD_WINDOW = {"norm": 64, "dens": 64, "agree": 64, "resp": 64, "resp_level": 64}
SPREAD_FLOOR = {"norm": 0.25, "dens": 0.03, "agree": 0.15, "resp": 0.25, "resp_level": 0.0}
# offsets a spread needs before its CUSUM runs (the agreement has one a step, the others one a replica)
SPREAD_MIN = {"norm": 16, "dens": 16, "agree": 8, "resp": 16, "resp_level": 1}
STAGE_SERIES = -1    # the key of the stage's median in ``_StageHistory.series``
ATTRIBUTION_MARGIN = 2.0   # the replica flagged moved at least this many times as far as the next one
MIN_MOVE = {"norm": 1.0, "dens": 3.0}   # ... and at least this many robust deviations of its test (twins'
# honest density drifts reach 0.04 at a 0.03 spread, noise as large as the gradient moves it by 0.2)
SERIES_STEPS = 64    # each replica's recent values per test, to tell which twin moved when an alarm comes
BEFORE_STEPS = 8     # how many steps before an alarm's onset a replica's level is read from
# A recent step read as an onset though no alarm began there: its move is read over at least this many steps and
# must be RECENT_MOVE times the least move of an alarm's onset, on the side of the mover's own alarmed CUSUM.
RECENT_MIN_STEPS = 3
RECENT_MOVE = 2.0
HISTORY_BETA = 0.9   # the stage's EMAs: of its sent directions (the response test), of its accepted mean (clipping)
# Which of two twins flipped its sign: both agree with each other as little as the other, but after an update
# that took in a flipped contribution, the honest twin's next gradient pushes back against it (curvature: the
# step climbed the attacker's data's loss), the flipped one goes with it. So the flipped twin agrees more with
# the EMA of the stage's sent directions (gpt-tiny: +0.3-0.5 +- 0.5 a step over its twin, honest 0 +- 0.33);
# it is flagged once that lead since the agreement alarm's onset is this many standard errors.
RESPONSE_Z = 2.5
# ... read only where honest twins agreed little with that history before (its in-control median cosine):
# where the stage's gradient keeps its direction from step to step (little feedback from the updates), the
# history still holds the honest past a flip points against, and the honest twin leads instead.
RESPONSE_MAX_LEVEL = 0.5
POST_Z = 1.0   # the lead on the history's part since the onset alone, in standard errors, the same way
# ... unless the lead on the whole history is this many standard errors where honest twins barely agreed with the
# history before (median at most RESPONSE_DECISIVE_LEVEL): no honest past there for a flip to point against, and
# the part since the onset is a step or two of noise (gpt-tiny, 2 replicas, lr 1e-3: lead z 3.5-5 from the third
# step, the post-onset part against it for four steps: banned +14)
RESPONSE_DECISIVE_Z = 4.0
RESPONSE_DECISIVE_LEVEL = 0.25
RESPONSE_MIN_STEPS = 3   # steps since the onset before the response is read (one step is a coin toss)
CONTRIB_REASONS = ("contrib_norm", "contrib_density", "contrib_dir", "contrib_nonfinite")
SKETCH_CHUNK = 1 << 20   # coordinates hashed at a time: the sketch's working memory stays ~8 MB whatever the stage


def sketch_seed(run_seed: int, stage: int) -> int:
    """The count sketch's seed of one stage (the same on every replica and the verifier)."""
    return run_seed * 1_000_003 + 7919 * stage + 17


@functools.lru_cache(maxsize=8)
def _chunk_buckets(seed: int, device: str) -> torch.Tensor:
    """Bucket and sign of a chunk's coordinates (``b`` or ``b + SKETCH_DIMS`` for a minus sign): a multiplicative
    hash of the position, the same on every device, made once a stage (8 MB) and rotated per chunk
    (:func:`_chunk_shift`); hashing every coordinate afresh cost a replica 23-27% of its step at d >= 384."""
    idx = torch.arange(SKETCH_CHUNK, dtype=torch.int64, device=device) + seed
    mixed = torch.remainder(idx * 2654435761, 1 << 32)   # Knuth's multiplicative hash (int64 wraps alike)
    return torch.remainder(mixed >> 13, 2 * SKETCH_DIMS)


def _chunk_shift(seed: int, chunk: int) -> int:
    """How far chunk ``chunk``'s buckets are rotated (the same hash of the chunk's index)."""
    return (((chunk + 1) * 2654435761 + seed) % (1 << 32) >> 13) % (2 * SKETCH_DIMS)


def sketch(flat: torch.Tensor, *, seed: int) -> torch.Tensor:
    """``[norm, density, count sketch of flat / norm]`` (``SKETCH_SIZE`` float64, on the CPU): what a replica
    sends its verifier, density being ``l1 / (sqrt(n) norm)``. Computed where the gradient is, a chunk at a time
    (only the sketch leaves the device)."""
    x = flat.detach().reshape(-1)
    table = _chunk_buckets(seed, str(x.device))
    signed = torch.zeros(2 * SKETCH_DIMS, dtype=torch.float32, device=x.device)
    l1 = torch.zeros((), dtype=torch.float64, device=x.device)
    for chunk, start in enumerate(range(0, x.numel(), SKETCH_CHUNK)):
        part = x[start:start + SKETCH_CHUNK].float()
        sums = torch.zeros_like(signed).index_add_(0, table[:part.numel()], part)
        signed += torch.roll(sums, _chunk_shift(seed, chunk))
        l1 += part.abs().sum().double()
    out = signed[:SKETCH_DIMS] - signed[SKETCH_DIMS:]
    x = x.float()
    out, norm = out.to("cpu", torch.float64), float(x.norm())
    ok = norm > 0 and math.isfinite(norm)
    unit = out / norm if ok else out
    density = float(l1) / (math.sqrt(x.numel()) * norm) if ok else (0.0 if norm == 0 else math.nan)
    return torch.cat([torch.tensor([norm, density], dtype=torch.float64), unit])


@dataclass(slots=True)
class _StageHistory:
    """A stage's replicas' past: the EMA of their sent directions' sum, the window of each test's in-control
    offsets (its robust spread), every CUSUM and its onset, and each replica's recent values per test (to
    tell which twin moved)."""

    response: torch.Tensor | None = None   # EMA of the sum of the replicas' sent unit directions (every step)
    response_before: torch.Tensor | None = None   # ``response`` as the agreement's CUSUM last left 0
    steps: int = 0
    offsets: dict[str, list[float]] = field(default_factory=lambda: {t: [] for t in SPREAD_WINDOW})
    sums: dict[tuple[int, str, int], float] = field(default_factory=dict)   # (rank, test, +1/-1) -> CUSUM
    poisoned: set[int] = field(default_factory=set)   # ranks flagged for a non-finite contribution
    onsets: dict[tuple[int, str, int], int] = field(default_factory=dict)   # CUSUM -> the step it last left 0
    series: dict[tuple[str, int], list[tuple[int, float]]] = field(default_factory=dict)   # (test, rank) -> values


class ContributionMonitor:
    """The verifier's view of every replicated untrusted stage's gradient contributions."""

    def __init__(self, *, seed: int = 0) -> None:
        self.seed = int(seed)
        self._stages: dict[int, _StageHistory] = {}
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
        hist = self._stages.setdefault(stage, _StageHistory())
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
        units = {r: _unit(sketches[r][2:]) for r in ranks}
        if len(ranks) < 2:
            self._learn(hist, units, {})
            return []
        offsets = {t: {r: v[r] - _median([v[o] for o in ranks if o != r]) for r in ranks} for t, v in values.items()}
        values["agree"] = {r: float(units[r] @ _unit(sum(units[o] for o in ranks if o != r))) for r in ranks}
        if hist.response is not None:   # each replica's agreement with the stage's recent sent sums
            values["resp"] = {r: float(units[r] @ _unit(hist.response)) for r in ranks}
            if hist.sums.get((STAGE_SERIES, "agree", 1), 0.0) > 0.0 and hist.response_before is not None:
                # ... and with the part of them sent since the onset only (what the updates since answered)
                gone = HISTORY_BETA ** (step - hist.onsets[(STAGE_SERIES, "agree", 1)])
                since = _unit(hist.response - gone * hist.response_before)
                values["post"] = {r: float(units[r] @ since) for r in ranks}
            offsets["resp"] = {r: values["resp"][r] - _median([values["resp"][o] for o in ranks if o != r])
                               for r in ranks}
        agree = sum(values["agree"].values()) / len(ranks)
        scores: dict[int, dict[str, float]] = {r: {} for r in ranks}
        alarms: set[str] = set()
        running = hist.steps >= WARMUP_STEPS
        for test in ("norm", "dens"):
            spread = self._spread(hist, test)
            for r, value in offsets[test].items():
                scores[r][f"{test}_offset"] = round(value, 6)
                for side in (1, -1) if running and math.isfinite(spread) else ():
                    scores[r][f"{test}_cusum{'+' if side > 0 else '-'}"] = \
                        self._cusum(hist, (r, test, side), side * value / spread, step)
                    if hist.sums[(r, test, side)] >= CUSUM_H:
                        alarms.add(test)
        level, spread = self._level(hist), self._spread(hist, "agree")
        if running and math.isfinite(spread):   # one-sided: twins that agree more are no threat
            if hist.sums.get((STAGE_SERIES, "agree", 1), 0.0) <= 0.0:
                hist.response_before = hist.response   # the history as this run of evidence may begin
            # a flip of one of two mirrors the agreement to -level: the CUSUM's reference is halfway, at level / 2
            # (a level learnt early, when twins agree most, then drifts down without alarming)
            drop = self._cusum(hist, (STAGE_SERIES, "agree", 1), (max(level, 0.0) / 2 - agree) / spread, step)
            for r in ranks:
                scores[r]["agree"], scores[r]["agree_cusum"] = round(values["agree"][r], 6), drop
            if drop >= CUSUM_H:
                alarms.add("agree")
        for test, per_rank in values.items():
            for r, value in [*per_rank.items(), (STAGE_SERIES, _median(list(per_rank.values())))]:
                series = hist.series.setdefault((test, r), [])
                series.append((step, value))
                del series[:max(0, len(series) - SERIES_STEPS)]
        events = []
        culprit = self._culprit(hist, alarms, ranks, step)
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
                learnt["resp_level"] = {STAGE_SERIES: _median(list(values["resp"].values()))}
        self._learn(hist, units, learnt)
        return events

    @staticmethod
    def _cusum(hist: _StageHistory, key: tuple[int, str, int], z: float, step: int) -> float:
        """One step of a one-sided CUSUM of the score ``z`` (in robust deviations); its new value."""
        if hist.sums.get(key, 0.0) <= 0.0:
            hist.onsets[key] = step   # where this run of evidence began
        hist.sums[key] = max(0.0, hist.sums.get(key, 0.0) + min(z, CUSUM_CAP) - CUSUM_K)
        return round(hist.sums[key], 6)

    def _culprit(self, hist: _StageHistory, alarms: set[str], ranks: list[int],
                 step: int) -> tuple[int, str, dict[str, float], int] | None:
        """The replica an alarm points at, the test, its evidence and the step it began (the onset it moved at, or
        the agreement alarm's); None until one stands out clearly (the
        alarm stands). A norm or density alarm: the replica whose level moved off the stage's trend at the
        alarm's onset (of three, an honest one is as far below the others' median as the outlier pulls it)."""
        for test in ("norm", "dens"):
            if test not in alarms:
                continue
            alarmed = {k for k, v in hist.sums.items() if v >= CUSUM_H and k[1] == test}
            # each alarm's own onset, the latest first; then, held to more (``RECENT_MOVE``), each of the last few
            # steps: of three replicas an honest one's offset can stand off its peers' for long without any level
            # moving, and every CUSUM then runs since long before an attacker's jump, which a move measured from
            # the oldest onset dilutes
            onsets = sorted({hist.onsets.get(k, step) for k in alarmed}, reverse=True)
            recent = [step - k for k in range(RECENT_MIN_STEPS - 1, BEFORE_STEPS) if step - k not in onsets]
            for onset, strict in [*((o, False) for o in onsets), *((o, True) for o in recent)]:
                found = self._moved(hist, test, ranks, step, onset)
                if found is None:
                    continue
                rank, move = found
                side = 1 if move > 0 else -1
                if strict and (abs(move) < RECENT_MOVE * MIN_MOVE[test] * self._spread(hist, test)
                               or (rank, test, side) not in alarmed):
                    continue
                return rank, test, {"moved": round(move, 6)}, onset
        if "agree" in alarms and (found := self._disagreeing(hist, ranks, step)) is not None:
            return (*found, hist.onsets.get((STAGE_SERIES, "agree", 1), step))
        return None

    def _moved(self, hist: _StageHistory, test: str, ranks: list[int], step: int,
               onset: int) -> tuple[int, float] | None:
        """The replica whose level moved off the stage's trend at ``onset`` clearly more than any other (at least
        ``MIN_MOVE`` deviations and ``ATTRIBUTION_MARGIN`` times the next), and its move; None if none did."""
        trend = _trend(hist.series.get((test, STAGE_SERIES), []), onset)
        moves = {r: _move(hist.series.get((test, r), []), step, onset, trend) for r in ranks}
        order = sorted(ranks, key=lambda r: -abs(moves[r]))
        big = abs(moves[order[0]]) >= MIN_MOVE[test] * self._spread(hist, test)
        if big and abs(moves[order[0]]) >= ATTRIBUTION_MARGIN * abs(moves[order[1]]):
            return order[0], moves[order[0]]
        return None

    def _disagreeing(self, hist: _StageHistory, ranks: list[int], step: int) -> tuple[int, str, dict] | None:
        """Of three replicas or more, the odd one out: the lowest agreement with the others since the onset,
        clear of the next. Of two, whose agreement is a mirror image, the one ahead in agreement with the
        stage's recent sent sums (:data:`RESPONSE_Z`), where that history is read (:data:`RESPONSE_MAX_LEVEL`)."""
        onset = hist.onsets.get((STAGE_SERIES, "agree", 1), step)

        def since(test: str, r: int, after: int = onset) -> list[float]:
            return [v for t, v in hist.series.get((test, r), []) if t >= after]

        if len(ranks) >= 3:
            mean = {r: sum(since("agree", r)) / max(1, len(since("agree", r))) for r in ranks}
            order = sorted(ranks, key=lambda r: mean[r])
            gap = (mean[order[1]] - mean[order[0]]) / self._spread(hist, "agree")
            return (order[0], "agree", {"agree_gap": round(gap, 6)}) if gap >= ATTRIBUTION_MARGIN else None
        a, b = ranks
        level = hist.offsets["resp_level"]
        if not level or _median(level) > RESPONSE_MAX_LEVEL:
            return None
        # from the step after the onset: at the onset the history still holds the flipped twin's honest past
        lead = [x - y for x, y in zip(since("resp", a, onset + 1), since("resp", b, onset + 1))]
        if len(lead) < RESPONSE_MIN_STEPS:
            return None
        z = sum(lead) / len(lead) / (self._spread(hist, "resp") / math.sqrt(len(lead)))
        if abs(z) < RESPONSE_Z:
            return None
        # the part of the history sent since the onset must lead the same way: early on, the part from before
        # still holds the honest past a flip points against (the honest twin leads on it where the stage's
        # gradient keeps its direction), so the whole history may point at the wrong twin until it fades
        post = [x - y for x, y in zip(since("post", a, onset + 1), since("post", b, onset + 1))]
        z_post = sum(post) / max(1, len(post)) / (self._spread(hist, "resp") / math.sqrt(max(1, len(post))))
        decisive = abs(z) >= RESPONSE_DECISIVE_Z and _median(level) <= RESPONSE_DECISIVE_LEVEL
        if not decisive and (len(post) < len(lead) or z_post * z < 0 or abs(z_post) < POST_Z):
            return None
        return (a if z > 0 else b), "agree", {"response_z": round(abs(z), 6)}

    @staticmethod
    def _level(hist: _StageHistory) -> float:
        """The stage's in-control agreement: the median of its window."""
        window = hist.offsets["agree"]
        return _median(window) if window else 0.0

    @staticmethod
    def _spread(hist: _StageHistory, test: str) -> float:
        """The robust spread of a test's honest offsets (their median absolute deviation / 0.6745, about their
        median for the agreement, about 0 for the others), at least its floor."""
        window = hist.offsets[test]
        if len(window) < SPREAD_MIN[test]:
            return math.inf
        centre = _median(window) if test == "agree" else 0.0
        return max(_median([abs(v - centre) for v in window]) / 0.6745, SPREAD_FLOOR[test])

    @staticmethod
    def _learn(hist: _StageHistory, units: Mapping[int, torch.Tensor],
               offsets: Mapping[str, Mapping[int, float]]) -> None:
        hist.steps += 1
        for test, got in offsets.items():
            window = hist.offsets[test]
            window.extend(got.values())
            del window[:max(0, len(window) - SPREAD_WINDOW[test])]
        # every step, alarm or not: the response test reads how the twins answer the sums the stage took in
        # unnormalised: steps whose twins cancel (a flip) weigh little, as they do in the optimizer's momentum
        total = sum(units.values())
        hist.response = total if hist.response is None else HISTORY_BETA * hist.response + (1 - HISTORY_BETA) * total


def _event(step: int, stage: int, rank: int, scores: Mapping[str, float], reasons: tuple[str, ...],
           since: int | None = None) -> dict[str, Any]:
    """A step-level flag event in the verifiers' exchange format (``blame.FLAG_EVENTS_SCHEMA``); ``since``: the
    step its evidence began, where before ``step`` (recovery resumes from before it: that step's update took it in)."""
    return {"type": "flag", "step": int(step), "mb": -1, "boundary": int(stage), "direction": "grad",
            "sender": int(rank), "scope": "step", "stage": int(stage),
            **({"since": int(since)} if since is not None and since < step else {}),
            "scores": {k: (round(v, 6) if math.isfinite(v) else 1e9) for k, v in scores.items()},
            "fences": {"cusum": CUSUM_H}, "reasons": list(reasons)}


def _trend(series: list[tuple[int, float]], onset: int) -> tuple[float, float]:
    """The stage's trend before ``onset``: a least-squares line (intercept at ``onset``, slope per step)
    through its median log norm over the ``BEFORE_STEPS`` steps before (flat without two of them)."""
    points = [(t - onset, v) for t, v in series if onset - BEFORE_STEPS <= t < onset]
    if len(points) < 2:
        return (points[0][1] if points else 0.0), 0.0
    mt = sum(t for t, _ in points) / len(points)
    mv = sum(v for _, v in points) / len(points)
    var = sum((t - mt) ** 2 for t, _ in points)
    slope = sum((t - mt) * (v - mv) for t, v in points) / var if var > 0 else 0.0
    return mv - slope * mt, slope


def _move(series: list[tuple[int, float]], step: int, onset: int, trend: tuple[float, float]) -> float:
    """How far a replica's value moved at an alarm's onset, off the stage's trend: its mean offset from the
    trend line since then (this step included) minus its mean offset over the ``BEFORE_STEPS`` steps before.
    Twins share the stage's trend; the one that changed is the one whose level jumped off it when the offset
    between them began (0 without a level before)."""
    base, slope = trend

    def off(t: int, v: float) -> float:
        return v - (base + slope * (t - onset))

    since = [off(t, v) for t, v in series if onset <= t <= step]
    before = [off(t, v) for t, v in series if onset - BEFORE_STEPS <= t < onset]
    return sum(since) / len(since) - sum(before) / len(before) if before and since else 0.0


def _median(values: list[float]) -> float:
    ordered, mid = sorted(values), len(values) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def _unit(v: torch.Tensor) -> torch.Tensor:
    n = float(v.norm())
    return v / n if n > 0 else v


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    na, nb = float(a.norm()), float(b.norm())
    return float(a @ b) / (na * nb) if na > 0 and nb > 0 else 0.0

