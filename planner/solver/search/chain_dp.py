"""Dynamic programs over the chain: the exact homogeneous DP and the partition of a device sequence.

* :func:`homogeneous_dp`: PipeDream/Alpa-style exact DP for a chain on ``n``
  identical devices joined by one kind of link, one device per stage. It
  minimises the iteration time ``F = sum t_k + (M-1) max t_k`` of
  ``planner.solver.objective`` exactly: first the smallest bottleneck and the
  smallest sum under it ("min bottleneck then min sum"), then every larger
  bottleneck cap at which the smallest sum drops, until a larger cap cannot
  pay off. Memory (1F1B in-flight counts depend on the stage's distance from
  the end, so the DP runs from the end of the chain) is a hard constraint.
* :func:`partition_sequence`: for a fixed sequence of stage groups
  (class, replicas), the contiguous partition with the smallest bottleneck
  (binary search on the cap, greedy furthest-fit probe). A heuristic when
  boundary sizes vary along the chain; exact when they do not.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from cost_models import comm
from cost_models.cluster import Link
from planner.solver.problem import Problem
from planner.solver.search.budget import Work, chain_sum_units
from planner.solver.search.deadline import Deadline

INF = float("inf")


# --- stage tables over a band of stage lengths ---------------------------------
class _Tables:
    """One-device stage costs on class ``cls`` for any range, over bands of stage lengths.

    ``band(w)`` gives arrays indexed ``[s, d]`` for the stage ``s..s+d``
    (``d < w``): time (compute + the boundary transfers it sends), static
    memory (weights, gradients, optimizer state, buffers), saved activations
    per microbatch, and the next stage's start; ranges past the chain are
    infinite. Stages under a time cap are short, so a band of a few times
    ``L / S`` replaces the ``L x L`` tables.
    """

    def __init__(self, problem: Problem, cls: int, link: Link | None) -> None:
        L = problem.num_blocks
        self.problem, self.L = problem, L
        self.tp = problem._time_prefix[:, cls]
        x = np.zeros(L) if link is None else np.array(
            [comm.transfer_ms(problem.boundary_bytes(e), link) for e in range(L)])
        self.x_in = np.concatenate([[0.0], x[:-1]])
        self.x_out = np.concatenate([x[:-1], [0.0]])
        self.pp = problem._param_prefix.astype(float)
        self.ap = problem._act_prefix.astype(float)
        self.cap_mem = problem.classes[cls].mem_bytes
        self._bands: dict[int, tuple[np.ndarray, ...]] = {}

    def band(self, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        width = max(1, min(width, self.L))
        if width not in self._bands:
            self._bands[width] = self._build(width)
        return self._bands[width]

    def _build(self, width: int) -> tuple[np.ndarray, ...]:
        p, L = self.problem, self.L
        s = np.arange(L)[:, None]
        e_raw = s + np.arange(width)[None, :]
        valid = e_raw < L
        e = np.minimum(e_raw, L - 1)
        t = np.where(valid, self.tp[e + 1] - self.tp[s] + self.x_in[s] + self.x_out[e], INF)
        params = self.pp[e + 1] - self.pp[s]
        for tie in p.tied:  # a stage reading a tied parameter without its first block keeps a copy
            holds = (s <= tie.first_block) & (tie.first_block <= e)
            reads = np.zeros(e.shape, dtype=bool)
            for r in tie.readers:
                reads |= (s <= r) & (r <= e)
            params = params + np.where(reads & ~holds, tie.param_count, 0)
        out_int = p.out_bytes_int.astype(float)
        in_act = np.where(s == 0, float(p.input_bytes), out_int[np.maximum(s - 1, 0)])
        in_grad = np.where(s == 0, 0.0, in_act)
        out_act = np.where(e < L - 1, out_int[e], 0.0)
        static = np.where(valid, params * p.state_bytes_per_param + in_act + in_grad + 2 * out_act, INF)
        act = np.where(valid, self.ap[e + 1] - self.ap[s], INF)
        return t, static, act, np.minimum(e_raw + 1, L)

    def width_for(self, cap_ms: float) -> int:
        """Longest stage whose compute alone fits under ``cap_ms`` (+1), over all starts."""
        ends = np.searchsorted(self.tp, self.tp[:-1] + cap_ms, side="right") - 1
        return int(max(1, (ends - np.arange(self.L)).max()))


def _in_flight(problem: Problem, from_end: int, share: int) -> int:
    """1F1B: min(m, S - k) where S - k = stages from the end, this one included; GPipe: m."""
    return share if problem.schedule == "gpipe" else min(share, from_end)


# --- exact homogeneous DP ---------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class ChainPartition:
    """Stage ranges ``(first, last)`` and the DP's own figures for them."""

    ranges: tuple[tuple[int, int], ...]
    bottleneck_ms: float
    sum_ms: float
    step_ms: float


def _fits(tab: _Tables, static: np.ndarray, act: np.ndarray, j: int) -> np.ndarray:
    M = tab.problem.num_microbatches
    return static + act * _in_flight(tab.problem, j, M) <= tab.cap_mem


def _bottleneck(tab: _Tables, width: int, max_stages: int) -> float:
    """Smallest bottleneck over partitions into at most ``max_stages`` stages no longer than ``width``."""
    t, static, act, nxt_i = tab.band(width)
    nxt = np.full(tab.L + 1, INF)
    nxt[tab.L] = 0.0
    best = INF
    for j in range(1, max_stages + 1):
        cost = np.maximum(np.where(_fits(tab, static, act, j), t, INF), nxt[nxt_i])
        row = np.full(tab.L + 1, INF)
        row[:tab.L] = cost.min(axis=1)
        nxt = row
        best = min(best, row[0])
    return best


def _best_sum(tab: _Tables, max_stages: int, cap_ms: float) -> tuple[float, tuple[tuple[int, int], ...]]:
    """Smallest sum of stage times with every stage <= ``cap_ms``, and its ranges."""
    width = tab.width_for(cap_ms)
    t, static, act, nxt_i = tab.band(width)
    L = tab.L
    layer = np.full(L + 1, INF)
    layer[L] = 0.0
    choices, firsts = [], []
    for j in range(1, max_stages + 1):
        cost = np.where(_fits(tab, static, act, j) & (t <= cap_ms), t, INF) + layer[nxt_i]
        d = cost.argmin(axis=1)
        row = np.full(L + 1, INF)
        row[:L] = cost[np.arange(L), d]
        choices.append(d)
        firsts.append(row[0])
        layer = row
    j = int(np.argmin(firsts)) + 1
    total = float(firsts[j - 1])
    if not math.isfinite(total):
        return INF, ()
    ranges, s = [], 0
    while j > 0:
        e = s + int(choices[j - 1][s])
        ranges.append((s, e))
        s, j = e + 1, j - 1
    return total, tuple(ranges)


def homogeneous_dp(problem: Problem, cls: int, num_devices: int,
                   deadline: Deadline | Work | None = None) -> ChainPartition | None:
    """Exact min of ``F`` over partitions into at most ``num_devices`` one-device stages on class ``cls``.

    Assumes what a homogeneous cluster gives: every stage on a device of
    ``cls``, every boundary over ``problem.links[cls][cls]``, no verification
    load (trusted devices). Returns None when no partition fits in memory.
    Once ``deadline`` has passed, the best partition of the caps tried so far
    (the smallest bottleneck's at least; on hundreds of devices and few
    microbatches the larger caps take seconds).
    """
    L, M = problem.num_blocks, problem.num_microbatches
    S_max = min(num_devices, L)
    tab = _Tables(problem, cls, problem.links[cls][cls] if S_max > 1 else None)
    width = max(2, 2 * math.ceil(L / S_max))
    while True:  # widen the band until no longer stage could beat the bottleneck found
        t_star = _bottleneck(tab, width, S_max)
        if width >= L or (math.isfinite(t_star) and tab.width_for(t_star) <= width):
            break
        width *= 2
    if not math.isfinite(t_star):
        return None
    floor_sum = float(tab.tp[-1])  # every partition computes the whole chain once
    best: ChainPartition | None = None

    def best_sum(cap: float) -> tuple[float, tuple[tuple[int, int], ...]]:
        if deadline is not None:
            deadline.charge(chain_sum_units(L, S_max))
        return _best_sum(tab, S_max, cap)

    def take(cap: float) -> float:
        nonlocal best
        total, ranges = best_sum(cap)
        if ranges:
            bott = max(_stage_ms(tab, s, e) for s, e in ranges)
            step = total + (M - 1) * bott
            if best is None or step < best.step_ms - 1e-12:
                best = ChainPartition(ranges=ranges, bottleneck_ms=bott, sum_ms=total, step_ms=step)
        return total

    total = take(t_star)
    if M == 1:
        return best
    # Larger caps only pay off while (M - 1) * cap + floor_sum < best: collect those candidate caps.
    limit = (best.step_ms - floor_sum) / (M - 1)
    cands = _candidate_caps(tab, t_star, limit)
    i = 0
    late = deadline.passed if deadline is not None else lambda: False
    while i < len(cands) and total > floor_sum + 1e-12 and not late():
        # Gallop to the first cap whose best sum drops below ``total``, then bisect.
        step, lo, hi = 1, i, None
        while lo + step < len(cands) and cands[lo + step] <= limit and not late():
            if best_sum(float(cands[lo + step]))[0] < total - 1e-12:
                hi = lo + step
                break
            lo, step = lo + step, step * 2
        if hi is None or late():
            break
        while hi - lo > 1 and not late():
            mid = (lo + hi) // 2
            if best_sum(float(cands[mid]))[0] < total - 1e-12:
                hi = mid
            else:
                lo = mid
        total = take(float(cands[hi]))
        limit = (best.step_ms - floor_sum) / (M - 1)
        i = hi
    return best


def _stage_ms(tab: _Tables, s: int, e: int) -> float:
    return float(tab.tp[e + 1] - tab.tp[s] + tab.x_in[s] + tab.x_out[e])


def _candidate_caps(tab: _Tables, lo: float, hi: float) -> np.ndarray:
    """Distinct stage times in ``[lo, hi]``: the only caps at which the best sum can change."""
    t = tab.band(tab.width_for(hi))[0]
    vals = t[(t >= lo) & (t <= hi)]
    return np.unique(vals)


# --- partition of a fixed device sequence -----------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class Group:
    """A stage's devices in a sequence: ``replicas`` devices of class ``cls``."""

    cls: int
    replicas: int = 1


def partition_sequence(problem: Problem, groups: tuple[Group, ...]) -> tuple[tuple[int, int], ...] | None:
    """Smallest-bottleneck contiguous ranges for stages on ``groups`` in order (None: nothing fits).

    Stage times here are compute plus the worst boundary transfer to each
    neighbour (verification is priced afterwards by the objective).
    """
    L, S = problem.num_blocks, len(groups)
    if S > L:
        return None
    stage = [_StageCosts(problem, groups, k) for k in range(S)]
    lo, hi = 0.0, max(sc.upper() for sc in stage)
    if _probe(stage, hi, L) is None:
        return None
    for _ in range(48):
        mid = 0.5 * (lo + hi)
        if _probe(stage, mid, L) is None:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-9 * max(hi, 1e-9):
            break
    return _probe(stage, hi, L)


class _StageCosts:
    """Prefix tables of one stage of a sequence, for the furthest-fit probe."""

    def __init__(self, problem: Problem, groups: tuple[Group, ...], k: int) -> None:
        g, S, M = groups[k], len(groups), problem.num_microbatches
        L = problem.num_blocks
        self.k, self.S, self.L = k, S, L
        self.share = math.ceil(M / g.replicas) / M
        self.time_prefix = problem._time_prefix[:, g.cls]
        self.x_in = np.zeros(L)
        self.x_out = 0.0
        if k > 0:
            lk = _group_link(problem, g, groups[k - 1])
            self.x_in = np.concatenate(([0.0], problem.boundary_transfer_ms(lk)))
        if k < S - 1:
            lk = _group_link(problem, g, groups[k + 1])
            # The cut after this stage is not known yet: price the largest boundary (conservative).
            self.x_out = comm.transfer_ms(float(problem.out_bytes[:-1].max()) if L > 1 else 0.0, lk)
        m_share = math.ceil(M / g.replicas)
        in_flight = _in_flight(problem, S - k, m_share)
        pp = problem._param_prefix.astype(float)
        ap = problem._act_prefix.astype(float)
        self.mem_prefix = pp * problem.state_bytes_per_param + ap * in_flight
        self.mem_slack = problem.classes[g.cls].mem_bytes - 4 * float(problem.out_bytes_int.max()) \
            - problem.input_bytes - sum(t.param_count for t in problem.tied) * problem.state_bytes_per_param

    def upper(self) -> float:
        return self.share * (float(self.time_prefix[-1]) + float(self.x_in.max()) + self.x_out) + 1.0

    def furthest(self, s: int, cap_ms: float) -> int:
        """Largest end e >= s - 1 with the stage s..e within the cap and the memory (s - 1: nothing fits)."""
        budget = cap_ms / self.share - self.x_in[s] - (self.x_out if self.k < self.S - 1 else 0.0)
        e_time = int(np.searchsorted(self.time_prefix, self.time_prefix[s] + budget, side="right")) - 2
        e_mem = int(np.searchsorted(self.mem_prefix, self.mem_prefix[s] + self.mem_slack, side="right")) - 2
        return min(e_time, e_mem, self.L - 1)


def _group_link(problem: Problem, a: Group, b: Group) -> Link:
    lk = problem.links[a.cls][b.cls]
    assert lk is not None, "two stages on one device"
    return lk


def _probe(stage: list[_StageCosts], cap_ms: float, L: int) -> tuple[tuple[int, int], ...] | None:
    ranges, s, S = [], 0, len(stage)
    for k, sc in enumerate(stage):
        if k == S - 1:
            if sc.furthest(s, cap_ms) < L - 1:
                return None
            ranges.append((s, L - 1))
            return tuple(ranges)
        e = min(sc.furthest(s, cap_ms), L - 1 - (S - 1 - k))  # leave a block for every later stage
        if e < s:
            return None
        ranges.append((s, e))
        s = e + 1
    return None



