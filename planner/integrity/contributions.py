"""Replicas check each other: a trusted verifier's monitor of each replica's gradient contribution.

The replicas of one stage run the same function on different data: before their all-reduce, their gradient
contributions are exchangeable, so each one's log norm minus its peers' median (and its cosine with the
stage's history direction minus its peers') has mean zero, whatever the stage's training does. Each replica
sends the verifier a sketch of its flat contribution (:func:`sketch`: its norm and a count sketch of its
direction, ``SKETCH_DIMS + 1`` floats whatever the stage's size); the verifier (:class:`ContributionMonitor`)
keeps a two-sided CUSUM per replica and test of those offsets in robust deviations (their spread learnt from
in-control steps only), and when one alarms flags the replica whose own level jumped at the alarm's onset
(twins share the stage's trend; with two replicas the offsets are mirror images, so only that tells which
twin moved). Flags are step-level flag events of the verifiers' exchange (``blame.FLAG_EVENTS_SCHEMA`` with a
``stage`` key): the replica's own evidence, never outranked by another sender's flags (``blame.blame_weights``).
A non-finite contribution is flagged at once.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from planner.errors import InvalidInputError

__all__ = ["CONTRIB_REASONS", "SKETCH_DIMS", "ContributionMonitor", "sketch", "sketch_seed"]

SKETCH_DIMS = 64     # count-sketch buckets: cosine error ~ 1 / sqrt(64) on unrelated directions
WARMUP_STEPS = 5     # steps that teach the spreads and the history before anything is flagged
# Honest replicas are exchangeable: each one's log norm minus its peers' median, and its cosine with the
# stage's history direction minus its peers', have mean zero, whatever the stage's gradients do (a loss
# spike moves every replica). One step says little (gpt-tiny, one microbatch a replica: honest norms differ
# up to 3x, honest cosines with anything are ~0 +- 0.15), a persistent offset says much: a two-sided CUSUM
# per replica and test of the offset in robust deviations (Page; allowance CUSUM_K, alarm at CUSUM_H:
# ~300 honest steps between false alarms for normal scores, 3-4 steps to alarm at a 3x scale).
CUSUM_K, CUSUM_H, CUSUM_CAP = 0.5, 5.0, 4.0
# The direction test runs only where honest replicas agree with the stage's history at least this much (their
# median cosine): at one microbatch a replica (gpt-tiny) honest cosines are 0.0-0.1 and their offsets drift for
# tens of steps (a history of two replicas holds each one's own past), so there it would only flag the honest;
# a sign flip is then bounded by centered clipping (``robust_reduce``), not detected.
DIR_MIN_COS = 0.3
# Floors: honest replicas' log norms differ by 0.3-1.1 a step at one microbatch each (gpt-tiny), but agree
# to 0.01-0.05 in the first steps, which would teach a spread that later honest steps alarm against.
SPREAD_WINDOW, SPREAD_FLOOR = {"norm": 64, "dir": 64}, {"norm": 0.25, "dir": 0.05}
SPREAD_MIN = 16      # offsets a spread needs before its CUSUM runs
STAGE_SERIES = -1    # the key of the stage's median log norm in ``_StageHistory.series``
ATTRIBUTION_MARGIN = 2.0   # the replica flagged moved at least this many times as far as the next one
SERIES_STEPS = 64    # each replica's recent log norms, to tell which twin moved when an alarm comes
BEFORE_STEPS = 8     # how many steps before an alarm's onset a replica's level is read from
HISTORY_BETA = 0.9   # the stage's slow log-norm history, which tells which twin moved (in-control steps only)
CONTRIB_REASONS = ("contrib_norm", "contrib_dir", "contrib_nonfinite")
SKETCH_CHUNK = 1 << 20   # coordinates hashed at a time: the sketch's working memory stays ~8 MB whatever the stage


def sketch_seed(run_seed: int, stage: int) -> int:
    """The count sketch's seed of one stage (the same on every replica and the verifier)."""
    return run_seed * 1_000_003 + 7919 * stage + 17


def _buckets(start: int, stop: int, seed: int, device: torch.device) -> torch.Tensor:
    """Bucket and sign of coordinates ``start..stop-1`` (``b`` or ``b + SKETCH_DIMS`` for a minus sign): a
    multiplicative hash of the index, the same on every device, stored nowhere (a table would take bytes per
    parameter of the stage)."""
    idx = torch.arange(start, stop, dtype=torch.int64, device=device) + seed
    mixed = torch.remainder(idx * 2654435761, 1 << 32)   # Knuth's multiplicative hash (int64 wraps alike)
    return torch.remainder(mixed >> 13, 2 * SKETCH_DIMS)


def sketch(flat: torch.Tensor, *, seed: int) -> torch.Tensor:
    """``[norm, count sketch of flat / norm]`` (``SKETCH_DIMS + 1`` float64, on the CPU): what a replica sends its
    verifier. Computed where the gradient is, a chunk at a time (only the sketch leaves the device)."""
    x = flat.detach().reshape(-1)
    out = torch.zeros(SKETCH_DIMS, dtype=torch.float32, device=x.device)
    for start in range(0, x.numel(), SKETCH_CHUNK):
        part = x[start:start + SKETCH_CHUNK].float()
        ids = _buckets(start, start + part.numel(), seed, x.device)
        out.index_add_(0, ids % SKETCH_DIMS, torch.where(ids >= SKETCH_DIMS, -part, part))
    x = x.float()
    out, norm = out.to("cpu", torch.float64), float(x.norm())
    unit = out / norm if norm > 0 and math.isfinite(norm) else out
    return torch.cat([torch.tensor([norm], dtype=torch.float64), unit])


@dataclass(slots=True)
class _StageHistory:
    """A stage's replicas' in-control past: the slow EMAs of their median log norm and summed direction, the
    window of each test's honest offsets (its robust spread) and every replica's two-sided CUSUMs."""

    log_norm: float | None = None
    direction: torch.Tensor | None = None
    agreement: dict[int, float] | None = None   # rank -> EMA of its cosine with the history direction
    steps: int = 0
    offsets: dict[str, list[float]] = field(default_factory=lambda: {"norm": [], "dir": []})
    sums: dict[tuple[int, str, int], float] = field(default_factory=dict)   # (rank, test, +1/-1) -> CUSUM
    poisoned: set[int] = field(default_factory=set)   # ranks flagged for a non-finite contribution
    onsets: dict[tuple[int, str, int], int] = field(default_factory=dict)   # CUSUM -> the step it last left 0
    series: dict[int, list[tuple[int, float]]] = field(default_factory=dict)   # rank -> recent (step, log norm)


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
        events = []
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

    def radius(self, stage: int) -> float | None:
        """The EMA of accepted contributions' distance to :meth:`center` (a centered clipping radius)."""
        return self._radii.get(stage)

    def center(self, stage: int) -> torch.Tensor | None:
        """The EMA of the stage's accepted mean contribution (None before one)."""
        return self._centers.get(stage)

    def judge(self, stage: int, sketches: Mapping[int, torch.Tensor], *, step: int) -> list[dict[str, Any]]:
        """Step-level flag events for the replica (at most one a stage and step) whose contribution has
        stood out from its peers' for several steps, the one farthest from the stage's history."""
        for rank, s in sketches.items():
            if s.shape != (SKETCH_DIMS + 1,):
                raise InvalidInputError(f"gradient sketch of rank {rank}", expected=f"{SKETCH_DIMS + 1} floats",
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
        logs = {r: math.log(max(float(sketches[r][0]), 1e-30)) for r in ranks}
        units = {r: _unit(sketches[r][1:]) for r in ranks}
        if len(ranks) < 2:
            self._learn(hist, logs, units, {})
            return []
        offsets = {"norm": {r: logs[r] - _median([logs[o] for o in ranks if o != r]) for r in ranks}}
        if hist.direction is not None:
            cos = {r: float(units[r] @ hist.direction) for r in ranks}
            offsets["dir"] = {r: _median([cos[o] for o in ranks if o != r]) - cos[r] for r in ranks}
            hist.agreement = cos if hist.agreement is None else {r: HISTORY_BETA * hist.agreement.get(r, c) +
                                                                 (1 - HISTORY_BETA) * c for r, c in cos.items()}
        alarms: dict[int, list[str]] = {}
        scores: dict[int, dict[str, float]] = {r: {} for r in ranks}
        for test, values in offsets.items():
            spread = self._spread(hist, test)
            for r, value in values.items():
                z = value / spread
                scores[r][f"{test}_offset"] = round(value, 6)
                for side in (1, -1) if hist.steps >= WARMUP_STEPS and math.isfinite(spread) else ():
                    key = (r, test, side)
                    if hist.sums.get(key, 0.0) <= 0.0:
                        hist.onsets[key] = step   # where this run of evidence began
                    hist.sums[key] = max(0.0, hist.sums.get(key, 0.0) + min(side * z, CUSUM_CAP) - CUSUM_K)
                    scores[r][f"{test}_cusum{'+' if side > 0 else '-'}"] = round(hist.sums[key], 6)
                    informative = test != "dir" or _median(list((hist.agreement or {}).values()) or [0.0]) >= DIR_MIN_COS
                    if hist.sums[key] >= CUSUM_H and informative:
                        alarms.setdefault(r, []).append(test)
        events = []
        if alarms:
            # the alarm says the replicas disagree; the one that moved at its onset is the one to flag (of
            # three, an honest one is as far below the others' median as the outlier pulls it). Until one
            # moved clearly more than the rest, nobody is flagged and the alarm stands.
            onset = min(hist.onsets.get(key, step) for key, v in hist.sums.items() if v >= CUSUM_H)
            trend = _trend(hist.series.get(STAGE_SERIES, []), onset)
            moves = {r: _move(hist.series.get(r, []), logs[r], step, onset, trend) for r in ranks}
            order = sorted(ranks, key=lambda r: -abs(moves[r]))
            moved = order[0]
            if abs(moves[moved]) >= ATTRIBUTION_MARGIN * abs(moves[order[1]]):
                reasons = tuple(sorted({f"contrib_{t}" for tests in alarms.values() for t in tests}))
                events.append(_event(step, stage, moved, {**scores[moved], "moved": round(moves[moved], 6)},
                                     reasons))
                self.flagged += 1
                for key in [k for k, v in hist.sums.items() if v >= CUSUM_H]:
                    hist.sums[key] = CUSUM_H / 2   # a lasting offset alarms again next step, an honest blip decays
        for r, value in [*logs.items(), (STAGE_SERIES, _median(list(logs.values())))]:
            series = hist.series.setdefault(r, [])
            series.append((step, value))
            del series[:max(0, len(series) - SERIES_STEPS)]
        self._learn(hist, logs, units, {} if alarms else offsets)
        return events

    @staticmethod
    def _spread(hist: _StageHistory, test: str) -> float:
        """The robust spread of a test's honest offsets (median |offset| / 0.6745), at least its floor."""
        window = hist.offsets[test]
        if len(window) < SPREAD_MIN:
            return math.inf
        return max(_median([abs(v) for v in window]) / 0.6745, SPREAD_FLOOR[test])

    @staticmethod
    def _learn(hist: _StageHistory, logs: Mapping[int, float], units: Mapping[int, torch.Tensor],
               offsets: Mapping[str, Mapping[int, float]]) -> None:
        hist.steps += 1
        for test, values in offsets.items():
            window = hist.offsets[test]
            window.extend(values.values())
            del window[:max(0, len(window) - SPREAD_WINDOW[test])]
        if offsets or hist.log_norm is None:
            level = _median(list(logs.values()))
            direction = _unit(sum(units.values()))
            hist.log_norm = level if hist.log_norm is None else HISTORY_BETA * hist.log_norm + (1 - HISTORY_BETA) * level
            hist.direction = direction if hist.direction is None else \
                _unit(HISTORY_BETA * hist.direction + (1 - HISTORY_BETA) * direction)


def _event(step: int, stage: int, rank: int, scores: Mapping[str, float], reasons: tuple[str, ...]) -> dict[str, Any]:
    """A step-level flag event in the verifiers' exchange format (``blame.FLAG_EVENTS_SCHEMA``)."""
    return {"type": "flag", "step": int(step), "mb": -1, "boundary": int(stage), "direction": "grad",
            "sender": int(rank), "scope": "step", "stage": int(stage),
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


def _move(series: list[tuple[int, float]], now: float, step: int, onset: int, trend: tuple[float, float]) -> float:
    """How far a replica's log norm moved at an alarm's onset, off the stage's trend: its mean offset from the
    trend line since then (this step included) minus its mean offset over the ``BEFORE_STEPS`` steps before.
    Twins share the stage's trend; the one that changed is the one whose level jumped off it when the offset
    between them began (0 without a level before)."""
    base, slope = trend

    def off(t: int, v: float) -> float:
        return v - (base + slope * (t - onset))

    since = [off(t, v) for t, v in series if onset <= t < step] + [off(step, now)]
    before = [off(t, v) for t, v in series if onset - BEFORE_STEPS <= t < onset]
    return sum(since) / len(since) - sum(before) / len(before) if before else 0.0


def _median(values: list[float]) -> float:
    ordered, mid = sorted(values), len(values) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def _unit(v: torch.Tensor) -> torch.Tensor:
    n = float(v.norm())
    return v / n if n > 0 else v


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    na, nb = float(a.norm()), float(b.norm())
    return float(a @ b) / (na * nb) if na > 0 and nb > 0 else 0.0
