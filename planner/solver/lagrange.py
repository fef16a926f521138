"""A lower bound (and plans) from a DP over stage sequences with Lagrangian device prices.

The fluid LP of ``objective`` cannot see communication: on a cluster of
volunteers behind slow links a stage pays hundreds of ms per microbatch to
send its activation and the verifier's copy, and the bound stays far below
every real plan. This module bounds the same search space with a relaxation
that keeps the *per-stage* structure exactly and relaxes only what couples
stages globally.

For a bottleneck cap ``T`` let ``g(T)`` be the smallest ``sum_k tau_k`` over
plans whose every ``tau_k <= T``, where ``tau_k`` is a lower bound on stage
``k``'s time ``t_k``: the busiest replica's share ``ceil(M/r)/M`` times
(compute + sends), sends being the activation to the next stage's class, the
gradient to the previous one's, and a verifier copy unless the receiver could
verify (a trusted neighbour) -- priced at the cheapest trusted class to reach.
Every valid plan with bottleneck ``T*`` has ``F >= g(T*) + (M - 1) T*``, so
over ``T*`` in ``[a, b]``: ``F >= g(b) + (M - 1) a`` (``g`` is
non-increasing). Verifier load, the CPU verifier hosts' load and the
all-reduce are left out (they only add), activation memory counts one
microbatch in flight under 1F1B (the last stage's exact figure, a floor for
the others), and tied copies and send buffers are left out of memory.

``g(T)`` needs at most ``n_c`` devices of each class ``c``; that constraint
is dualised with prices ``lambda_c >= 0`` per device (weak duality:
``g(T) >= min_plans sum (tau_k + lambda_c r_k) - lambda . n``), and what
remains is a shortest path over states (stage start block, previous class,
own class). For each state the next stage's end is a range minimum over a
table kept per (class, replicas, next class): a sparse table updated from the
right as the DP moves left, so one DP costs ``O(L C^3 R)`` array operations.
The prices come from a projected subgradient ascent per cap; caps are
refined where the interval bound is smallest. Every DP's plan that respects
the device counts is priced exactly and kept when valid.
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import numpy as np

from cost_models import comm
from planner.solver.dp import Group, sequence_placement
from planner.solver.objective import Placement, evaluate, even_split, violations
from planner.solver.problem import Problem
from planner.solver.solution import StagePlacement

INF = math.inf


@dataclass(frozen=True, slots=True, kw_only=True)
class Relaxed:
    """One DP's answer: the dual value at ``(T, lambda)`` and its stage sequence."""

    value_ms: float
    stages: tuple[tuple[int, int, int, int], ...]  # (first block, last block, problem class, replicas)
    used: np.ndarray  # devices per local class


@dataclass(frozen=True, slots=True, kw_only=True)
class LagrangeResult:
    bound_ms: float
    placement: Placement | None
    step_ms: float
    dps: int
    caps: int
    seeds: tuple[tuple[Group, ...], ...] = ()  # repaired class sequences met, to seed a local search


class SequenceDP:
    """Tables of the relaxation for one problem (see the module docstring)."""

    def __init__(self, problem: Problem) -> None:
        p = self.p = problem
        self.L, self.M = p.num_blocks, p.num_microbatches
        self.SC = [c.index for c in p.classes if c.stage_capable]
        C, L, M = len(self.SC), self.L, self.M
        self.C = C
        self.count = np.array([p.classes[c].count for c in self.SC], dtype=float)
        self.trusted = np.array([p.classes[c].trusted for c in self.SC])
        opts = [p.replica_choices(c) for c in self.SC]
        self.R = max(len(o) for o in opts)
        self.RR = np.ones((C, self.R))
        self.H = np.ones((C, self.R))
        self.valid_r = np.zeros((C, self.R), dtype=bool)
        for i, o in enumerate(opts):
            for j, r in enumerate(o):
                self.RR[i, j], self.H[i, j], self.valid_r[i, j] = r, math.ceil(M / r) / M, True
        self.cp = np.stack([p._time_prefix[:, c] for c in self.SC])  # (C, L+1)
        pol = p.policy
        self.ends_trusted = pol.enabled and pol.trusted_endpoints
        self._comm_tables()
        self._memory_tables()
        self.LOG = max(1, math.ceil(math.log2(max(L, 2))) + 1)
        self.pad = 1 << self.LOG

    # --- tables -------------------------------------------------------------------
    def _transfer(self, a: int, b: int) -> np.ndarray:
        """Transfer ms of each boundary ``e = 0..L-2`` from class ``a`` to ``b`` (inf: no such link)."""
        lk = self.p.links[a][b]
        if lk is None:
            return np.full(self.L - 1, INF)
        return np.array([comm.transfer_ms(self.p.boundary_bytes(e), lk) for e in range(self.L - 1)])

    def _comm_tables(self) -> None:
        p, C, L, pol = self.p, self.C, self.L, self.p.policy
        sites = [c.index for c in p.classes if c.trusted and (
            (c.stage_capable and pol.verifier_placement in ("any", "stage"))
            or (c.verifier_host and pol.verifier_placement in ("any", "cpu")))]
        xfer = {(a, b): self._transfer(a, b) for a in self.SC for b in self.SC}
        copy = {}
        for a in self.SC:
            rows = [self._transfer(a, v) for v in sites if v != a]
            copy[a] = np.min(rows, axis=0) if rows else np.full(L - 1, INF)
        # FWD[i, n, e]: stage on class i ending at e sends its activation to class n (+ a verifier copy).
        # BWD[i, q, s]: stage on class i starting at s sends its gradient back to class q (+ copy).
        self.FWD = np.full((C, C, max(L - 1, 1)), INF)
        self.BWD = np.zeros((C, C, L))
        for i, a in enumerate(self.SC):
            for n, b in enumerate(self.SC):
                fwd = xfer[(a, b)].copy()
                if pol.enabled and not self.trusted[i] and not self.trusted[n]:
                    fwd = fwd + copy[a]
                bwd = xfer[(a, b)].copy()
                if pol.enabled and pol.check_gradients and not self.trusted[i] and not self.trusted[n]:
                    bwd = bwd + copy[a]
                if L > 1:
                    self.FWD[i, n] = fwd
                    self.BWD[i, n, 1:] = bwd
        self.FWD_MIN = self.FWD.min(axis=2)

    def _memory_tables(self) -> None:
        """``EHI_MEM[i, j, s]``: the last block a stage from ``s`` may end at and still fit (a superset)."""
        p, C, L, M = self.p, self.C, self.L, self.M
        pp = p._param_prefix.astype(float) * p.state_bytes_per_param
        ap = p._act_prefix.astype(float)
        out = p.out_bytes_int.astype(float)
        inbuf = np.concatenate([[float(p.input_bytes)], 2 * out[:-1]])  # activation in + gradient in
        self.EHI_MEM = np.full((C, self.R, L), -1, dtype=np.int64)
        self.LAST_FITS = np.zeros((C, self.R, L), dtype=bool)
        for i, c in enumerate(self.SC):
            cap = float(p.classes[c].mem_bytes)
            for j in range(self.R):
                if not self.valid_r[i, j]:
                    continue
                in_flight = math.ceil(M / self.RR[i, j]) if p.schedule == "gpipe" else 1
                prefix = pp + ap * in_flight
                limit = prefix[:-1] + cap - inbuf
                self.EHI_MEM[i, j] = np.searchsorted(prefix, limit, side="right") - 2
                self.LAST_FITS[i, j] = prefix[L] - prefix[:-1] + inbuf <= cap

    # --- one DP ---------------------------------------------------------------------
    def run(self, cap_ms: float, lam: np.ndarray) -> Relaxed | None:
        """min over stage sequences of sum (tau_k + lam_c r_k) - lam . n, every tau_k <= cap_ms."""
        C, R, L, LOG = self.C, self.R, self.L, self.LOG
        H, RR, cp = self.H, self.RR, self.cp
        price = lam[:, None] * RR  # (C, R)
        V = np.full((L + 1, C, C), INF)  # V[s, q, c]: stages from s on, this one on c, previous on q
        V0 = np.full(C, INF)  # the first stage (no previous class)
        choice = {}
        width = L + self.pad
        SP = np.full((LOG, C, R, C, width), INF)  # sparse table of Q over e, per (c, r, next class)
        cpL = cp[:, L]
        ci = np.arange(C)[None, :, None, None]
        ri = np.arange(R)[None, None, :, None]
        ni = np.arange(C)[None, None, None, :]
        for s in range(L - 1, -1, -1):
            first = s == 0
            bwd = np.zeros((1, C)) if first else self.BWD[:, :, s].T  # (q, c)
            # Option A: the last stage s..L-1.
            tau_last = H[None] * (cpL - cp[:, s])[None, :, None] + H[None] * bwd[:, :, None]  # (q, c, r)
            ok_last = (tau_last <= cap_ms) & self.LAST_FITS[:, :, s][None] & self.valid_r[None]
            if self.ends_trusted:
                ok_last &= self.trusted[None, :, None]
            cost_last = np.where(ok_last, tau_last + price[None], INF)
            best_last_r = cost_last.argmin(axis=2)
            best_last = np.take_along_axis(cost_last, best_last_r[:, :, None], axis=2)[:, :, 0]
            # Option B: a stage s..e (e <= L-2) followed by a stage on class n.
            if s <= L - 2:
                with np.errstate(invalid="ignore"):  # inf - inf: no such link, masked by Q = inf
                    thr = (cp[:, s][None, :, None, None] + cap_ms / H[None, :, :, None]
                           - bwd[:, :, None, None] - self.FWD_MIN[None, :, None, :])  # (q, c, r, n)
                thr = np.nan_to_num(thr, nan=-INF)
                ehi = np.empty(thr.shape, dtype=np.int64)
                for i in range(C):
                    ehi[:, i] = np.searchsorted(cp[i], thr[:, i], side="right") - 2
                ehi = np.minimum(ehi, self.EHI_MEM[:, :, s][None, :, :, None])
                ehi = np.minimum(ehi, L - 2)
                ok = (ehi >= s) & self.valid_r[None, :, :, None]
                if first and self.ends_trusted:
                    ok &= self.trusted[None, :, None, None]
                length = np.maximum(ehi - s + 1, 1)
                lvl = np.floor(np.log2(length)).astype(np.int64)
                right = np.maximum(ehi - (1 << lvl) + 1, s)
                rmq = np.minimum(SP[lvl, ci, ri, ni, s], SP[lvl, ci, ri, ni, right])
                cost_b = np.where(ok, price[None, :, :, None] + H[None, :, :, None]
                                  * (bwd[:, :, None, None] - cp[:, s][None, :, None, None]) + rmq, INF)
                flat = cost_b.reshape(cost_b.shape[0], C, -1)
                arg_b = flat.argmin(axis=2)
                best_b = np.take_along_axis(flat, arg_b[:, :, None], axis=2)[:, :, 0]
            else:
                best_b = np.full_like(best_last, INF)
                arg_b = np.zeros_like(best_last_r)
                ehi = None
            vals = np.minimum(best_last, best_b)
            if first:
                V0 = vals[0]
            else:
                V[s] = vals
            choice[s] = (best_last, best_last_r, best_b, arg_b, ehi)
            if s >= 1:
                # Q[c, r, n][e = s-1] = H (cp_c[s] + FWD[c, n, s-1]) + V[s, c, n]; then the sparse levels.
                e = s - 1
                q = H[:, :, None] * (cp[:, s][:, None, None] + self.FWD[:, :, e][:, None, :]) + vals[:, None, :]
                SP[0, :, :, :, e] = np.where(self.valid_r[:, :, None], q, INF)
                for lv in range(1, LOG):
                    SP[lv, :, :, :, e] = np.minimum(SP[lv - 1, :, :, :, e], SP[lv - 1, :, :, :, e + (1 << (lv - 1))])
        start = int(np.argmin(V0))
        if not math.isfinite(V0[start]):
            return None
        stages = self._backtrack(start, choice, SP)
        used = np.zeros(C)
        for _, _, c, r in stages:
            used[self.SC.index(c)] += r
        return Relaxed(value_ms=float(V0[start] - lam @ self.count), stages=stages, used=used)

    def _backtrack(self, c: int, choice: dict, SP: np.ndarray) -> tuple[tuple[int, int, int, int], ...]:
        C, L = self.C, self.L
        out, s, q = [], 0, 0
        while True:
            best_last, best_last_r, best_b, arg_b, ehi = choice[s]
            if best_last[q, c] <= best_b[q, c]:
                out.append((s, L - 1, self.SC[c], int(self.RR[c, best_last_r[q, c]])))
                return tuple(out)
            j, n = divmod(int(arg_b[q, c]), C)
            hi = int(ehi[q, c, j, n])
            e = s + int(np.argmin(SP[0, c, j, n, s:hi + 1]))
            out.append((s, e, self.SC[c], int(self.RR[c, j])))
            s, q, c = e + 1, c, n

    def block_floor_ms(self) -> float:
        """A floor on any plan's largest ``tau``: the slowest block at its best class and smallest share."""
        share = np.where(self.valid_r, self.H, INF).min(axis=1)
        return float(np.max(np.min(self.p.time_ms[:, self.SC] * share[None, :], axis=1)))

    # --- plans from a relaxed answer -----------------------------------------------
    def placement(self, relaxed: Relaxed) -> Placement | None:
        """The relaxed sequence as a plan (devices from each class's pool, verifiers greedily), or None."""
        from planner.solver.baselines import (
            assign_verifiers,  # baselines builds on the objective
        )

        if (relaxed.used > self.count).any():
            return None
        p, M = self.p, self.M
        pools = {c: list(p.classes[c].device_ids) for c in self.SC}
        stages = []
        for k, (s, e, c, r) in enumerate(relaxed.stages):
            devices = tuple(pools[c][:r])
            del pools[c][:r]
            stages.append(StagePlacement(index=k, first_block=s, last_block=e, devices=devices,
                                         microbatches=even_split(M, r)))
        verifiers = assign_verifiers(p, tuple(stages), M)
        if verifiers is None:
            return None
        placement = Placement(stages=tuple(stages), verifiers=verifiers, num_microbatches=M)
        return None if violations(p, placement) else placement


def repair(problem: Problem, stages: tuple[tuple[int, int, int, int], ...]) -> tuple[Group, ...] | None:
    """The relaxed plan's class sequence made to respect the device counts (None: cannot be done simply).

    Over-used classes first lose replicas (largest first, down to the next
    useful replica count); a stage that still cannot be placed moves to the
    class with the most spare devices that keeps a trusted endpoint trusted.
    """
    groups = [Group(cls=c, replicas=r) for _, _, c, r in stages]
    count = {c.index: c.count for c in problem.classes if c.stage_capable}
    pol = problem.policy

    def used(c: int) -> int:
        return sum(g.replicas for g in groups if g.cls == c)

    for c, n in count.items():
        while used(c) > n:
            mine = [i for i, g in enumerate(groups) if g.cls == c and g.replicas > 1]
            if mine:
                i = max(mine, key=lambda j: groups[j].replicas)
                smaller = [r for r in problem.replica_choices(c) if r < groups[i].replicas]
                groups[i] = Group(cls=c, replicas=max(smaller))
                continue
            i = next(i for i in range(len(groups) - 1, -1, -1) if groups[i].cls == c)
            end = i in (0, len(groups) - 1) and pol.enabled and pol.trusted_endpoints
            spare = [(count[o] - used(o), o) for o in count
                     if o != c and count[o] > used(o) and (problem.classes[o].trusted or not end)]
            if spare:
                groups[i] = Group(cls=max(spare)[1])
            elif len(groups) > 1:
                del groups[i]
            else:
                return None
    return tuple(groups)


def lagrange_bound(problem: Problem, *, incumbent_ms: float, time_budget_s: float,
                   target_gap: float = 1e-3, iterations: int = 12) -> LagrangeResult:
    """A lower bound on ``F`` over every plan (and the best valid plan the DPs met); see the module docstring."""
    start = time.perf_counter()
    dp = SequenceDP(problem)
    M = problem.num_microbatches
    best_plan: Placement | None = None
    best_ms = incumbent_ms
    dps = 0
    seeds: list[tuple[Group, ...]] = []

    def deadline() -> bool:
        return time.perf_counter() - start > time_budget_s

    tried: set[tuple[Group, ...]] = set()

    def consider(relaxed: Relaxed) -> None:
        """Price the relaxed plan as it is, and its repaired class sequence re-partitioned."""
        nonlocal best_plan, best_ms
        cands = []
        plan = dp.placement(relaxed)
        if plan is not None:
            cands.append((plan, evaluate(problem, plan).step_ms))
        groups = repair(problem, relaxed.stages)
        if groups is not None and groups not in tried:
            tried.add(groups)
            seeds.append(groups)
            for exact in (False, True):
                got = sequence_placement(problem, groups, exact=exact)
                if got is not None:
                    cands.append(got)
        for plan, step in cands:
            if step < best_ms - 1e-9:
                best_plan, best_ms = plan, step

    lam_memo: list[tuple[float, np.ndarray]] = []

    def dual(cap: float) -> float:
        """The best dual value found at ``cap`` (a lower bound on g(cap); inf: no plan has tau <= cap)."""
        nonlocal dps
        lam = min(lam_memo, key=lambda tl: abs(tl[0] - cap))[1].copy() if lam_memo else np.zeros(dp.C)
        best, step = -INF, None
        stale = 0
        for _ in range(iterations):
            got = dp.run(cap, lam)
            dps += 1
            if got is None:  # no sequence has every tau <= cap, whatever the prices
                return INF
            consider(got)
            if got.value_ms > best + 1e-9 * abs(best if math.isfinite(best) else 1.0):
                best, stale = got.value_ms, 0
            else:
                stale += 1
            grad = got.used - dp.count
            if (grad <= 0).all() and np.allclose(lam * grad, 0):
                break  # complementary slackness: this is g(cap) exactly
            if step is None:  # a price of the order of one stage's time
                step = 0.5 * (cap if math.isfinite(cap) else got.value_ms / len(got.stages))
            if stale >= 2:
                step, stale = step * 0.5, 0
            lam = np.maximum(0.0, lam + step * grad / max(1.0, float(np.abs(grad).max())))
            if deadline():
                break
        lam_memo.append((cap, lam))
        return best

    lo = dp.block_floor_ms()
    if M == 1:  # no fill term: one unconstrained cap
        g = dual(INF)
        return LagrangeResult(bound_ms=min(g, best_ms), placement=best_plan, step_ms=best_ms, dps=dps, caps=1,
                              seeds=tuple(seeds))
    points: dict[float, float] = {}
    # Caps above incumbent / (M - 1) cannot beat the incumbent; without one, start from a wide range.
    top = best_ms / (M - 1) if math.isfinite(best_ms) else 64 * lo
    for cap in np.geomspace(max(lo, 1e-9), max(top, lo * 1.0001), 5):
        points[float(cap)] = dual(float(cap))
        if deadline():
            break
    while True:
        bound, (a, b) = _interval_bound(points, lo, M, best_ms)
        if deadline() or bound >= best_ms * (1 - target_gap) or b - a <= 1e-6 * b:
            break
        points[0.5 * (a + b)] = dual(0.5 * (a + b))
    return LagrangeResult(bound_ms=bound, placement=best_plan, step_ms=best_ms, dps=dps, caps=len(points),
                          seeds=tuple(seeds))


def _interval_bound(points: dict[float, float], lo: float, M: int, best_ms: float) -> tuple[float, tuple[float, float]]:
    """min over cap intervals ``[a, b]`` of ``(M - 1) a + G(b)``, with the weakest interval.

    ``G(b)`` is the largest dual value at ``b`` or above (``g`` is non-increasing);
    caps above ``best_ms / (M - 1)`` cannot beat the incumbent.
    """
    caps = sorted(points)
    env, run = {}, -INF
    for c in reversed(caps):
        run = max(run, points[c])
        env[c] = run
    edges = [lo] + [c for c in caps if c > lo]
    best: tuple[float, tuple[float, float]] = (best_ms, (lo, lo))
    for a, b in itertools.pairwise(edges):
        if a * (M - 1) >= best_ms:
            break
        val = (M - 1) * a + env[b]
        if val < best[0]:
            best = (val, (a, b))
    top = caps[-1] if caps else lo
    if top * (M - 1) < best_ms and (M - 1) * top < best[0]:  # nothing evaluated above ``top``: g >= 0 there
        best = ((M - 1) * top, (top, best_ms / (M - 1)))
    return best
