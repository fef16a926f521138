"""Which replica a contribution alarm points at: the one whose level moved at its onset, or the odd direction out."""
from __future__ import annotations

import math

from planner.integrity.contribution_history import StageHistory, median, spread_of
from planner.integrity.contribution_tuning import (
    ATTRIBUTION_MARGIN,
    BEFORE_STEPS,
    CUSUM_H,
    MIN_MOVE,
    POST_Z,
    RECENT_MIN_STEPS,
    RECENT_MOVE,
    RESPONSE_DECISIVE_LEVEL,
    RESPONSE_DECISIVE_Z,
    RESPONSE_MAX_LEVEL,
    RESPONSE_MIN_STEPS,
    RESPONSE_Z,
    STAGE_SERIES,
)

__all__ = ["culprit_of"]


def culprit_of(hist: StageHistory, alarms: set[str], ranks: list[int],
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
            found = _moved(hist, test, ranks, step, onset)
            if found is None:
                continue
            rank, move = found
            side = 1 if move > 0 else -1
            if strict and (abs(move) < RECENT_MOVE * MIN_MOVE[test] * spread_of(hist, test)
                           or (rank, test, side) not in alarmed):
                continue
            return rank, test, {"moved": round(move, 6)}, onset
    if "agree" in alarms and (found := _disagreeing(hist, ranks, step)) is not None:
        return (*found, hist.onsets.get((STAGE_SERIES, "agree", 1), step))
    return None


def _moved(hist: StageHistory, test: str, ranks: list[int], step: int,
           onset: int) -> tuple[int, float] | None:
    """The replica whose level moved off the stage's trend at ``onset`` clearly more than any other (at least
    ``MIN_MOVE`` deviations and ``ATTRIBUTION_MARGIN`` times the next), and its move; None if none did."""
    trend = _trend(hist.series.get((test, STAGE_SERIES), []), onset)
    moves = {r: _move(hist.series.get((test, r), []), step, onset, trend) for r in ranks}
    order = sorted(ranks, key=lambda r: -abs(moves[r]))
    big = abs(moves[order[0]]) >= MIN_MOVE[test] * spread_of(hist, test)
    if big and abs(moves[order[0]]) >= ATTRIBUTION_MARGIN * abs(moves[order[1]]):
        return order[0], moves[order[0]]
    return None


def _disagreeing(hist: StageHistory, ranks: list[int], step: int) -> tuple[int, str, dict] | None:
    """Of three replicas or more, the odd one out: the lowest agreement with the others since the onset,
    clear of the next. Of two, whose agreement is a mirror image, the one ahead in agreement with the
    stage's recent sent sums (:data:`RESPONSE_Z`), where that history is read (:data:`RESPONSE_MAX_LEVEL`)."""
    onset = hist.onsets.get((STAGE_SERIES, "agree", 1), step)

    def since(test: str, r: int, after: int = onset) -> list[float]:
        return [v for t, v in hist.series.get((test, r), []) if t >= after]

    if len(ranks) >= 3:
        mean = {r: sum(since("agree", r)) / max(1, len(since("agree", r))) for r in ranks}
        order = sorted(ranks, key=lambda r: mean[r])
        gap = (mean[order[1]] - mean[order[0]]) / spread_of(hist, "agree")
        return (order[0], "agree", {"agree_gap": round(gap, 6)}) if gap >= ATTRIBUTION_MARGIN else None
    a, b = ranks
    level = hist.offsets["resp_level"]
    if not level or median(level) > RESPONSE_MAX_LEVEL:
        return None
    # from the step after the onset: at the onset the history still holds the flipped twin's honest past
    lead = [x - y for x, y in zip(since("resp", a, onset + 1), since("resp", b, onset + 1))]
    if len(lead) < RESPONSE_MIN_STEPS:
        return None
    z = sum(lead) / len(lead) / (spread_of(hist, "resp") / math.sqrt(len(lead)))
    if abs(z) < RESPONSE_Z:
        return None
    # the part of the history sent since the onset must lead the same way: early on, the part from before
    # still holds the honest past a flip points against (the honest twin leads on it where the stage's
    # gradient keeps its direction), so the whole history may point at the wrong twin until it fades
    post = [x - y for x, y in zip(since("post", a, onset + 1), since("post", b, onset + 1))]
    z_post = sum(post) / max(1, len(post)) / (spread_of(hist, "resp") / math.sqrt(max(1, len(post))))
    decisive = abs(z) >= RESPONSE_DECISIVE_Z and median(level) <= RESPONSE_DECISIVE_LEVEL
    if not decisive and (len(post) < len(lead) or z_post * z < 0 or abs(z_post) < POST_Z):
        return None
    return (a if z > 0 else b), "agree", {"response_z": round(abs(z), 6)}


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
