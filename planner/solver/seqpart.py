"""Stage ranges for a fixed sequence of stage groups that minimise the iteration time, by DP.

``dp.partition_sequence`` balances the bottleneck with a conservative price
for the cut it has not chosen yet; on chains whose boundary sizes vary and
links are slow that leaves a lot on the table. Here, for the groups in
order (class, replicas), every stage's time is exact given its range:
``h (compute + activation out + gradient back + verifier copies)`` with
``h = ceil(M/r)/M``, the copies priced as the cheapest trusted site unless
the receiving stage can verify (one trusted device). Memory uses the stage's
own 1F1B in-flight count. Two DPs over (stage, first block), banded to the
stage lengths a cap allows: the smallest bottleneck ``T*``, then the
smallest sum of stage times under a few caps ``>= T*``; the pick minimises
``sum + (M - 1) max``. The plan is then priced exactly by the objective.
"""
from __future__ import annotations

import math

import numpy as np

from cost_models import comm, memory
from planner.solver.dp import Group, partition_sequence
from planner.solver.problem import Problem

INF = math.inf
CAP_STEPS = (1.0, 1.01, 1.03, 1.06, 1.1, 1.16, 1.25, 1.4)


class _Stage:
    """Per-stage tables: time prefix, sends, memory prefix and budget."""

    def __init__(self, problem: Problem, groups: tuple[Group, ...], k: int, copy_ms) -> None:
        p, L, M, S = problem, problem.num_blocks, problem.num_microbatches, len(groups)
        g = groups[k]
        c = p.classes[g.cls]
        self.h = math.ceil(M / g.replicas) / M
        self.cp = p._time_prefix[:, g.cls]
        self.fwd = np.zeros(L)
        self.bwd = np.zeros(L)
        pol = p.policy
        checked = pol.enabled and not c.trusted

        def sole_verifier(o: Group) -> bool:
            return o.replicas == 1 and p.classes[o.cls].trusted

        if k < S - 1:
            lk = p.links[g.cls][groups[k + 1].cls]
            self.fwd[:L - 1] = [comm.transfer_ms(p.boundary_bytes(e), lk) for e in range(L - 1)] if lk else INF
            if checked and not sole_verifier(groups[k + 1]):
                self.fwd[:L - 1] += copy_ms(g.cls)
        if k > 0:
            lk = p.links[g.cls][groups[k - 1].cls]
            self.bwd[1:] = [comm.transfer_ms(p.boundary_bytes(e), lk) for e in range(L - 1)] if lk else INF
            if checked and pol.check_gradients and not sole_verifier(groups[k - 1]):
                self.bwd[1:] += copy_ms(g.cls)
        in_flight = memory.in_flight_microbatches(p.schedule, S, k, math.ceil(M / g.replicas))
        self.mp = p._param_prefix.astype(float) * p.state_bytes_per_param + p._act_prefix.astype(float) * in_flight
        out = p.out_bytes_int.astype(float)
        self.in_buf = np.concatenate([[float(p.input_bytes)], 2 * out[:-1]])
        self.out_buf = np.concatenate([2 * out[:-1], [0.0]]) if k < S - 1 else np.zeros(L)
        self.mem_cap = float(c.mem_bytes)

    def tau(self, s: int, e: int) -> float:
        return float(self.h * (self.cp[e + 1] - self.cp[s] + self.fwd[e] + self.bwd[s]))

    def width_for(self, cap_ms: float) -> int:
        """Longest stage (+1) whose compute share alone stays under ``cap_ms``."""
        ends = np.searchsorted(self.cp, self.cp[:-1] + cap_ms / self.h, side="right") - 1
        return int(max(1, (ends - np.arange(len(self.cp) - 1)).max()))

    def table(self, width: int) -> tuple[np.ndarray, np.ndarray]:
        """(tau[s, d], fits[s, d]) for the stage ``s..s+d``."""
        L = len(self.cp) - 1
        s = np.arange(L)[:, None]
        e = s + np.arange(width)[None, :]
        inside = e < L
        e = np.minimum(e, L - 1)
        tau = self.h * (self.cp[e + 1] - self.cp[s] + self.fwd[e] + self.bwd[s])
        mem = self.mp[e + 1] - self.mp[s] + self.in_buf[s] + self.out_buf[e]
        return np.where(inside, tau, INF), inside & (mem <= self.mem_cap)


def _copy_table(problem: Problem):
    """ms of a verifier copy of each boundary from a class: the cheapest trusted site allowed."""
    pol = problem.policy
    sites = [c.index for c in problem.classes if c.trusted and (
        (c.stage_capable and pol.verifier_placement in ("any", "stage"))
        or (c.verifier_host and pol.verifier_placement in ("any", "cpu")))]
    cache: dict[int, np.ndarray] = {}

    def copy_ms(cls: int) -> np.ndarray:
        if cls not in cache:
            rows = [[comm.transfer_ms(problem.boundary_bytes(e), problem.links[cls][v])
                     for e in range(problem.num_blocks - 1)] for v in sites if v != cls]
            cache[cls] = np.min(rows, axis=0) if rows else np.full(problem.num_blocks - 1, INF)
        return cache[cls]
    return copy_ms


def partition_min_step(problem: Problem, groups: tuple[Group, ...]) -> tuple[tuple[int, int], ...] | None:
    """Ranges for ``groups`` minimising ``sum tau + (M - 1) max tau`` (None: nothing fits)."""
    L, S, M = problem.num_blocks, len(groups), problem.num_microbatches
    if S > L:
        return None
    copy_ms = _copy_table(problem)
    stages = [_Stage(problem, groups, k, copy_ms) for k in range(S)]
    seed = partition_sequence(problem, groups)
    width = L - S + 1
    if seed is not None:  # a known partition caps T*: only stages short enough for the largest cap matter
        upper = CAP_STEPS[-1] * max(st.tau(a, b) for st, (a, b) in zip(stages, seed))
        width = min(width, max(st.width_for(upper) for st in stages))
    tables = [st.table(width) for st in stages]
    t_star = _min_bottleneck(tables, L)
    if not math.isfinite(t_star):
        return None
    best: tuple[float, tuple[tuple[int, int], ...]] | None = None
    for f in CAP_STEPS if M > 1 else (INF,):
        got = _min_sum(tables, L, t_star * f)
        if got is None:
            continue
        total, ranges, peak = got
        step = total + (M - 1) * peak
        if best is None or step < best[0] - 1e-12:
            best = (step, ranges)
    return None if best is None else best[1]


def _min_bottleneck(tables, L: int) -> float:
    nxt = np.full(L + 1, INF)
    nxt[L] = -INF  # past the last stage: nothing
    for tau, fits in reversed(tables):
        W = tau.shape[1]
        idx = np.minimum(np.arange(L)[:, None] + np.arange(W)[None, :] + 1, L)
        cost = np.where(fits, np.maximum(tau, nxt[idx]), INF)
        row = np.full(L + 1, INF)
        row[:L] = cost.min(axis=1)
        nxt = row
    return float(nxt[0])


def _min_sum(tables, L: int, cap: float):
    """Smallest sum of stage times with every stage <= cap: (sum, ranges, largest stage time) or None."""
    nxt = np.full(L + 1, INF)
    nxt[L] = 0.0
    args = []
    for tau, fits in reversed(tables):
        W = tau.shape[1]
        idx = np.minimum(np.arange(L)[:, None] + np.arange(W)[None, :] + 1, L)
        cost = np.where(fits & (tau <= cap), tau + nxt[idx], INF)
        d = cost.argmin(axis=1)
        row = np.full(L + 1, INF)
        row[:L] = cost[np.arange(L), d]
        args.append(d)
        nxt = row
    if not math.isfinite(nxt[0]):
        return None
    args.reverse()
    ranges, s, peak = [], 0, 0.0
    for k, (tau, _) in enumerate(tables):
        d = int(args[k][s])
        ranges.append((s, s + d))
        peak = max(peak, float(tau[s, d]))
        s += d + 1
    return float(nxt[0]), tuple(ranges), peak
