"""Boxes of (bottleneck, all-reduce) caps for the sequence DP's bound (``lagrange``).

A plan's iteration time is ``fill x bottleneck + all-reduce + sum of stage
times``; the DP bounds the last term under caps on the first two, so the caps
below the incumbent are covered by boxes, each bounded by its lower corner's
fill and all-reduce plus the DP's value at its upper corner.
"""
from __future__ import annotations

import math

INF = math.inf


class CapBoxes:
    """Boxes of (bottleneck, all-reduce) caps covering every plan that could beat the incumbent.

    A plan whose bottleneck lies in ``[Ta, Tb]`` and all-reduce in ``[Aa, Ab]``
    has ``F >= fill * Ta + Aa + g(Tb, Ab)``, and ``g`` is non-increasing in
    both caps, so any dual value priced at caps ``>= (Tb, Ab)`` bounds it.
    The weakest box is split in the dimension that loosens it most.
    """

    def __init__(self, *, lo: float, top: float, ar_top: float, fill: int, open_top: bool) -> None:
        self.fill, self.ar_top, self.top, self.open_top, self.lo = fill, ar_top, top, open_top, lo
        self.points: dict[tuple[float, float], float] = {}
        self.boxes: list[tuple[float, float, float, float]] = [(lo, max(top, lo), 0.0, ar_top)]

    def add_point(self, t: float, a: float, value: float) -> None:
        """A lower bound on ``g`` at caps ``(t, a)``; the highest met is kept (every one is valid)."""
        self.points[(t, a)] = max(value, self.points.get((t, a), -INF))

    def width(self, box: tuple[float, float, float, float]) -> float:
        """What splitting can add to a box's value at most: its lower corner's floor rising to the upper's."""
        ta, tb, aa, ab = box
        if not self.fill:
            return ab - aa
        return (self.fill * (tb - ta) if math.isfinite(tb) else INF) + (ab - aa)

    def _g(self, t: float, a: float) -> float:
        return max((v for (pt, pa), v in self.points.items() if pt >= t and pa >= a), default=-INF)

    def _value(self, box: tuple[float, float, float, float]) -> float:
        return self.floor(box) + self._g(box[1], box[3])

    def least_floor(self) -> float:
        """The least floor any box can have: every box lies above the lowest bottleneck cap."""
        return self.fill * self.lo if self.fill else 0.0

    def floor(self, box: tuple[float, float, float, float]) -> float:
        """What a box's plans pay before ``g``: the fill at its lowest bottleneck plus its lowest all-reduce."""
        return (self.fill * box[0] if self.fill else 0.0) + box[2]

    def weakest(self, best_ms: float) -> tuple[float, tuple[float, float, float, float] | None]:
        live = [(self._value(b), b) for b in self.boxes if (self.fill * b[0] if self.fill else 0.0) < best_ms]
        if self.open_top:  # no incumbent: plans above the top cap are bounded by it alone
            live.append((self.fill * self.top, None))
        if not live:
            return best_ms, None
        value, box = min(live, key=lambda vb: vb[0])
        return min(value, best_ms), box

    def weakest_two(self, best_ms: float) -> tuple[float, tuple[float, float, float, float] | None, float]:
        """:meth:`weakest`, and the value of the next weakest box (``best_ms`` when there is none)."""
        live = sorted(((self._value(b), i) for i, b in enumerate(self.boxes)
                       if (self.fill * b[0] if self.fill else 0.0) < best_ms), key=lambda vi: vi[0])
        if self.open_top or not live:
            value, box = self.weakest(best_ms)
            return value, box, value
        value, box = live[0][0], self.boxes[live[0][1]]
        runner_up = live[1][0] if len(live) > 1 else best_ms
        return min(value, best_ms), box, min(runner_up, best_ms)

    def split(self, box: tuple[float, float, float, float]) -> tuple[float, float] | None:
        """Split ``box`` in two; return the caps to price for the new lower half (None: too small)."""
        ta, tb, aa, ab = box
        wt = self.fill * (tb - ta) if self.fill and math.isfinite(tb) else 0.0
        wa = ab - aa
        if max(wt, wa) <= 1e-9 * max(tb if math.isfinite(tb) else 0.0, ab, 1e-9):
            return None
        self.boxes.remove(box)
        if wt >= wa:
            mid = 0.5 * (ta + tb)
            self.boxes += [(ta, mid, aa, ab), (mid, tb, aa, ab)]
            return mid, ab
        # All-reduce caps span orders of magnitude (latency-bound to the whole chain): split geometrically.
        mid = math.sqrt(aa * ab) if aa > 0 else ab / 16
        self.boxes += [(ta, tb, aa, mid), (ta, tb, mid, ab)]
        return tb, mid
