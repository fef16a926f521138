"""Islands of a pool for the link-aware bounds (``links``, ``last_stage``): devices joined by links faster than a
threshold, the partitions the pool's link speeds give, and what every plan sends at least."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from cost_models import codecs
from cost_models.cluster import Link
from planner.solver.problem import Problem

# Compressed all-reduces (``codec_choice.ALLREDUCE_OFFERS``): under these the all-reduce term is dropped.
COMPRESSED_ALLREDUCE = ("auto", "int8")
# Island partitions tried at most (each costs a few LPs).
MAX_THRESHOLDS = 6


@dataclass(frozen=True, slots=True, kw_only=True)
class Islands:
    """Per island, devices per stage class; the fastest and quickest link between two islands."""

    members: tuple[Counter, ...]
    between: Link


def partitions(problem: Problem, stage: list[int]) -> list[tuple[float, Islands]]:
    """The distinct ways the pool's link bandwidths split it into islands (a threshold each), at most
    ``MAX_THRESHOLDS`` of them evenly spread, the finest (every slow link cut) always among them."""
    speeds = sorted({lk.bandwidth_gbps for a in stage for b in stage if (lk := problem.links[a][b]) is not None})
    seen: dict[tuple, tuple[float, Islands]] = {}
    for gbps in speeds:
        isl = islands_at(problem, stage, gbps)
        if isl is not None:
            seen.setdefault(tuple(sorted(tuple(sorted(I.items())) for I in isl.members)), (gbps, isl))
    found = list(seen.values())
    if len(found) <= MAX_THRESHOLDS:
        return found
    picks = np.linspace(0, len(found) - 1, MAX_THRESHOLDS).round().astype(int)
    return [found[i] for i in sorted(set(picks.tolist()))]


def islands_at(problem: Problem, stage: list[int], gbps: float) -> Islands | None:
    """Islands of devices joined by links faster than ``gbps`` (None: one island only)."""
    parent: dict[tuple, tuple] = {}

    def find(x: tuple) -> tuple:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    nodes: dict[int, list[tuple]] = {}
    for c in stage:
        own = problem.links[c][c]
        whole = problem.classes[c].count == 1 or (own is not None and own.bandwidth_gbps > gbps)
        nodes[c] = [(c, -1)] if whole else [(c, i) for i in range(problem.classes[c].count)]
        for n in nodes[c]:
            parent[n] = n
    for i, a in enumerate(stage):
        for b in stage[i + 1:]:
            lk = problem.links[a][b]
            if lk is not None and lk.bandwidth_gbps > gbps:
                for n in nodes[a] + nodes[b]:
                    parent[find(n)] = find(nodes[a][0])
    groups: dict[tuple, Counter] = {}
    for c in stage:
        for n in nodes[c]:
            groups.setdefault(find(n), Counter())[c] += problem.classes[c].count if n[1] < 0 else 1
    if len(groups) < 2:
        return None
    slow = [lk for a in stage for b in stage if (lk := problem.links[a][b]) is not None and lk.bandwidth_gbps <= gbps]
    between = Link(bandwidth_gbps=max(lk.bandwidth_gbps for lk in slow), latency_ms=min(lk.latency_ms for lk in slow))
    return Islands(members=tuple(groups.values()), between=between)


def spans(problem: Problem, stage: list[int], first: set[int], second: set[int], Y: int, W: int,
          ) -> list[tuple[np.ndarray, Islands]]:
    """Per partition into islands (``partitions``), which stages no island holds whole, and its islands:
    ``out[p][0][y, w]`` is true where no island holds ``y`` devices of the classes ``first`` and ``w`` of
    ``second`` together (``y < Y``, ``w < W``). A stage of ``y`` and ``w`` such devices then has replicas in two
    islands, so its ring uses a link between them (``replicas.Rings``' line for ``between``). Both rise with ``y``
    and ``w``: more devices fit fewer islands."""
    y, w = np.arange(Y)[:, None, None], np.arange(W)[None, :, None]
    out = []
    for _, isl in partitions(problem, stage):
        own = np.array([[sum(n for c, n in I.items() if c in g) for I in isl.members] for g in (first, second)])
        out.append((~((own[0][None, None, :] >= y) & (own[1][None, None, :] >= w)).any(axis=2), isl))
    return out


def min_wire_bytes(problem: Problem) -> float:
    """The smallest boundary tensor on the wire under any codec a plan of ``problem`` may send it with."""
    raw = problem.out_bytes[:-1] if problem.num_blocks > 1 else problem.out_bytes
    if problem.compress == "auto":
        return min(codecs.wire_bytes(c, float(raw.min()), problem.elem_bytes) for c in codecs.CODECS)
    return float(min(problem.wire_bytes(l, None) for l in range(max(1, problem.num_blocks - 1))))
