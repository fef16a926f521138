"""A lower bound (and plans) from a DP over stage sequences with Lagrangian device prices.

The fluid LP of ``objective`` cannot see communication: on a cluster of
volunteers behind slow links a stage pays hundreds of ms per microbatch to
send its activation and the verifier's copy, and the bound stays far below
every real plan. This module bounds the same search space with a relaxation
that keeps the *per-stage* structure and relaxes only what couples stages
globally.

``tau_k`` is a lower bound on stage ``k``'s time ``t_k``: the busiest
replica's share ``ceil(M/r)/M`` times (compute + sends), the sends being the
activation to the next stage's class, the gradient to the previous one's,
and a verifier copy unless the receiver could verify (a trusted neighbour),
priced at the cheapest trusted class to reach. For caps ``(T, A)`` let
``g(T, A)`` be the smallest ``sum_k tau_k`` over plans with every
``tau_k <= T`` and every replicated stage's all-reduce ``<= A``. A valid
plan whose bottleneck lies in ``[Ta, Tb]`` and all-reduce in ``[Aa, Ab]``
has ``F >= (M - 1) Ta + Aa + g(Tb, Ab)`` (``g`` is non-increasing in both
caps), so boxes of caps covering everything below the incumbent give a bound
(``boxes.CapBoxes``). Verifier load and the CPU verifier hosts' load are left out
(they only add); memory is exact for 1F1B in flight (the DP runs in layers
by the number of stages to the end) but leaves out tied copies, send
buffers and verifier state.

``g`` needs at most ``n_c`` devices of each class ``c``; that constraint is
dualised with prices ``lambda_c >= 0`` per device (weak duality:
``g >= min_plans sum (tau_k + lambda_c r_k) - lambda . n``), and what remains
is a shortest path over (stage start block, previous class, own class) per
layer, with range minima over sparse tables (``seqdp_kernel``, numba). The
prices at each pair of caps come from Kelley's cutting planes (a small LP
over the plans met so far, whose stage times and device use bound the dual
function from above at every pair of caps they meet), warm started from the
nearest pair; they reach the relaxation's LP value in tens of DPs where a
subgradient ascent stalled far below it (48 blocks x 8 devices: within
0.02% of the optimum in 0.3 s, against 20% after 1600 DPs). Every relaxed plan met is repaired to the
device counts, re-partitioned (``seqpart``) and priced exactly; the best
valid one is returned with the bound.
"""
from __future__ import annotations

import copy
import math
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
from ortools.linear_solver import pywraplp

from cost_models import comm
from planner.solver.boxes import CapBoxes
from planner.solver.dp import Group, sequence_placement
from planner.solver.objective import Placement, evaluate, even_split, violations
from planner.solver.pricer import BackgroundPricer
from planner.solver.problem import Problem
from planner.solver.seqdp_kernel import sequence_dp
from planner.solver.solution import StagePlacement

INF = math.inf
# Range queries per DP (exact layers x blocks x classes^3 x replica options), ~10 ns each: deeper
# pipelines than the exact layers share one lumped layer whose memory check is weaker.
LAYER_BUDGET = 2_500_000
FEASIBILITY_STEPS = 12  # bisection steps for the smallest bottleneck any relaxed plan meets
LAST_PLANS = 4  # relaxed plans the time cap skipped that are priced anyway at the end (the latest)
PLAN_SHARE = 0.35  # of the bound's time, at most, spent turning relaxed answers into priced plans
PRICER_BACKLOG = 64  # relaxed plans waiting for the pricing thread (workers >= 2), the oldest dropped past it
# The fewer-layer DP tried before the full one (``LazyLayers``): its layers, the tries before its hit rate
# counts, the hit rate below which it costs more than it saves (it costs ~2/5 of a full DP), and how often
# it is tried anyway while skipped.
COARSE_LAYERS = 8
LAZY_WARMUP = 16
LAZY_MIN_HIT_RATE = 0.35
LAZY_PROBE_EVERY = 8
KELLEY_TOL = 1e-4  # relative gap between the cutting-plane model and the best dual value that ends a cap


@dataclass(frozen=True, slots=True, kw_only=True)
class Relaxed:
    """One DP's answer: the dual value at ``(T, lambda)`` and its stage sequence."""

    value_ms: float
    stages: tuple[tuple[int, int, int, int], ...]  # (first block, last block, problem class, replicas)
    used: np.ndarray  # devices per local class


@dataclass(frozen=True, slots=True, kw_only=True)
class Cut:
    """A relaxed plan as a cutting plane: ``L(lam) <= tau_ms + lam . (used - n)`` at every pair of caps
    ``>= (peak_ms, ar_ms)`` (the plan is one of the DP's candidates there)."""

    tau_ms: float
    used: np.ndarray
    peak_ms: float
    ar_ms: float


@dataclass(frozen=True, slots=True, kw_only=True)
class LagrangeResult:
    bound_ms: float
    placement: Placement | None
    step_ms: float
    dps: int
    caps: int


class SequenceDP:
    """Tables of the relaxation for one problem (see the module docstring)."""

    def __init__(self, problem: Problem) -> None:
        p = self.p = problem
        self.max_layers: int | None = None
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
        self._allreduce_tables()
        self.LOG = max(1, math.ceil(math.log2(max(L, 2))) + 1)
        self.pad = 1 << self.LOG
        self._work: tuple[np.ndarray, ...] | None = None
        self._limits_cap = math.nan  # the cap HI/LV in _work were computed for

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
        """``EHI_MEM[i, j, layer, s]``: the last block a stage from ``s`` may end at and fit (a superset).

        Layer ``l`` holds the stages with ``l + 1`` stages from them to the end
        (the lumped last layer: that many or more), whose 1F1B in-flight count
        is ``min(share, l + 1)``; send buffers and tied copies are left out.
        """
        p, C, L, M = self.p, self.C, self.L, self.M
        devices = sum(p.classes[c].count for c in self.SC)
        deepest = min(L, devices)
        per_layer = L * C ** 3 * self.R  # range queries of one exact layer
        self.J = 1 if p.schedule == "gpipe" else min(deepest, M, max(2, LAYER_BUDGET // per_layer),
                                                     self.max_layers or L)
        self.lump = deepest > self.J
        pp = p._param_prefix.astype(float) * p.state_bytes_per_param
        ap = p._act_prefix.astype(float)
        out = p.out_bytes_int.astype(float)
        inbuf = np.concatenate([[float(p.input_bytes)], 2 * out[:-1]])  # activation in + gradient in
        self.EHI_MEM = np.full((C, self.R, self.J, L), -1, dtype=np.int64)
        self.LAST_FITS = np.zeros((C, self.R, L), dtype=bool)
        for i, c in enumerate(self.SC):
            cap = float(p.classes[c].mem_bytes)
            for j in range(self.R):
                if not self.valid_r[i, j]:
                    continue
                share = math.ceil(M / self.RR[i, j])
                for layer in range(self.J):
                    in_flight = share if p.schedule == "gpipe" else min(share, layer + 1)
                    prefix = pp + ap * in_flight
                    self.EHI_MEM[i, j, layer] = np.searchsorted(prefix, prefix[:-1] + cap - inbuf, side="right") - 2
                    if layer == 0:
                        self.LAST_FITS[i, j] = prefix[L] - prefix[:-1] + inbuf <= cap

    def with_layers(self, max_layers: int) -> SequenceDP:
        """The same DP with at most ``max_layers`` memory layers (the rest lumped), sharing the other tables."""
        other = copy.copy(self)
        other.max_layers, other._work, other._limits_cap = max_layers, None, math.nan
        other._memory_tables()
        return other

    def _allreduce_tables(self) -> None:
        """All-reduce of ``r`` replicas is ``AR0 + AR1 * parameters`` (linear in the bytes, 0 for none)."""
        p = self.p
        self.pp = p._param_prefix.astype(float)
        self.AR0 = np.zeros((self.C, self.R))
        self.AR1 = np.zeros((self.C, self.R))
        for i, c in enumerate(self.SC):
            for j in range(self.R):
                if self.valid_r[i, j]:
                    self.AR0[i, j], self.AR1[i, j] = p.allreduce_line(c, int(self.RR[i, j]))

    def _ar_limits(self, ar_cap_ms: float) -> np.ndarray:
        """``EHI_AR[i, j, s]``: the last block a stage from ``s`` may end at with its all-reduce <= the cap."""
        C, R, L = self.C, self.R, self.L
        out = np.full((C, R, L), L - 1, dtype=np.int64)
        if not math.isfinite(ar_cap_ms):
            return out
        for i in range(C):
            for j in range(R):
                if self.RR[i, j] < 2 or not self.valid_r[i, j]:
                    continue
                if ar_cap_ms < self.AR0[i, j]:  # only parameter-free stages (nothing to all-reduce) qualify
                    most = 0.0
                else:
                    most = (ar_cap_ms - self.AR0[i, j]) / self.AR1[i, j] if self.AR1[i, j] > 0 else INF
                out[i, j] = np.searchsorted(self.pp, self.pp[:-1] + most, side="right") - 2
        return out

    # --- one DP ---------------------------------------------------------------------
    def run(self, cap_ms: float, lam: np.ndarray, ar_cap_ms: float = INF) -> Relaxed | None:
        """min over stage sequences of sum (tau_k + lam_c r_k) - lam . n, every tau_k <= cap_ms and
        every replicated stage's all-reduce <= ar_cap_ms."""
        C, R, L, LOG, J = self.C, self.R, self.L, self.LOG, self.J
        ar = self._ar_limits(ar_cap_ms)
        ehi = np.minimum(self.EHI_MEM, ar[:, :, None, :])
        last_ok = self.LAST_FITS & (ar >= L - 1)
        price = lam[:, None] * self.RR
        if self._work is None:  # allocated once: the kernels rewrite every entry they read
            self._work = (np.full((LOG, C, R, C, L + self.pad), INF), np.full((LOG, C, R, C, L + self.pad), INF),
                          np.zeros((C, R, C, L, C), np.int64), np.zeros((C, R), np.int64),
                          np.full((J, L + 1, C, C), INF), np.full((J, C), INF),
                          *(np.zeros((J, L, C, C), np.int64) for _ in range(4)))
        SPa, SPb, HI, LV, V, V0, kind, pick_r, pick_n, pick_hi = self._work
        ready = self._limits_cap == cap_ms  # the stage-length limits depend on the cap alone
        sequence_dp(float(cap_ms), price, self.H, self.valid_r, self.cp, self.FWD, self.FWD_MIN, self.BWD, ehi,
                    last_ok, self.trusted, bool(self.ends_trusted), bool(self.lump), SPa, SPb, HI, LV, ready, V, V0,
                    kind, pick_r, pick_n, pick_hi)
        self._limits_cap = cap_ms
        layer, c = np.unravel_index(int(np.argmin(V0)), V0.shape)
        value = float(V0[layer, c])
        if not math.isfinite(value):
            return None
        stages, s, q, layer, c = [], 0, 0, int(layer), int(c)
        while True:
            r = int(pick_r[layer, s, q, c])
            if kind[layer, s, q, c] == 1:
                stages.append((s, L - 1, self.SC[c], int(self.RR[c, r])))
                break
            n, hi = int(pick_n[layer, s, q, c]), int(pick_hi[layer, s, q, c])
            nxt = layer - 1 if kind[layer, s, q, c] == 2 else layer
            e = np.arange(s, hi + 1)
            q_vals = self.H[c, r] * (self.cp[c, e + 1] + self.FWD[c, n, e]) + V[nxt, e + 1, c, n]
            end = s + int(np.argmin(q_vals))
            stages.append((s, end, self.SC[c], int(self.RR[c, r])))
            s, q, c, layer = end + 1, c, n, nxt
        used = np.zeros(C)
        for _, _, cls, r in stages:
            used[self.SC.index(cls)] += r
        return Relaxed(value_ms=value - float(lam @ self.count), stages=tuple(stages), used=used)

    def max_allreduce_ms(self) -> float:
        """The largest all-reduce any stage can have (the whole chain on the slowest ring): 0 without replicas."""
        total = float(self.pp[-1]) + sum(t.param_count for t in self.p.tied)
        vals = np.where(self.valid_r & (self.RR >= 2), self.AR0 + self.AR1 * total, 0.0)
        return float(vals.max()) if vals.size else 0.0

    def fits_layers(self, relaxed: Relaxed) -> bool:
        """Whether the relaxed plan meets this DP's memory limits (its layers' in-flight counts): a plan of
        a DP with fewer layers, whose lumped layer checks memory more loosely, may not (nor may a plan
        deeper than this DP's layers when it lumps none: its plans have at most ``J`` stages)."""
        S = len(relaxed.stages)
        if S > self.J and not self.lump:
            return False
        for k, (s, e, cls, r) in enumerate(relaxed.stages):
            i = self.SC.index(cls)
            j = int(np.flatnonzero(self.valid_r[i] & (self.RR[i] == r))[0])
            if k == S - 1:
                if not self.LAST_FITS[i, j, s]:
                    return False
            elif e > self.EHI_MEM[i, j, min(S - 1 - k, self.J - 1), s]:
                return False
        return True

    def cut(self, relaxed: Relaxed) -> Cut:
        """The relaxed plan as a cutting plane of the dual: its stage times, device use and caps it meets."""
        st = relaxed.stages
        loc = [self.SC.index(c) for _, _, c, _ in st]
        taus, ars = [], [0.0]
        for k, (s, e, _, r) in enumerate(st):
            i = loc[k]
            j = int(np.flatnonzero(self.valid_r[i] & (self.RR[i] == r))[0])
            sends = self.FWD[i, loc[k + 1], e] if k + 1 < len(st) else 0.0
            sends += self.BWD[i, loc[k - 1], s] if k else 0.0
            taus.append(self.H[i, j] * (self.cp[i, e + 1] - self.cp[i, s] + sends))
            params = self.pp[e + 1] - self.pp[s]
            if r > 1 and params > 0:
                ars.append(self.AR0[i, j] + self.AR1[i, j] * params)
        return Cut(tau_ms=float(sum(taus)), used=relaxed.used, peak_ms=float(max(taus)), ar_ms=float(max(ars)))

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


class LazyLayers:
    """The sequence DP with its memory layers, run on a DP of fewer layers first.

    The fewer-layer DP relaxes memory (its lumped layer assumes fewer
    microbatches in flight), so its minimum at given prices and caps is at most
    the full DP's; when its plan also meets the full layers' memory it is a plan
    of the full DP too, and so the full DP's minimum: the same dual value,
    several times cheaper (200 blocks x 64 devices: 8 layers 15 ms, all 19 layers 38 ms). Where
    memory binds, its plans miss, and the full DP runs after it; the fewer-layer
    try is then skipped while it misses more than it pays for.
    """

    def __init__(self, full: SequenceDP, coarse: SequenceDP) -> None:
        self.full, self.coarse = full, coarse
        self.C, self.count = full.C, full.count
        self.tries = self.hits = self.calls = 0

    def _worth_trying(self) -> bool:
        self.calls += 1
        probe = self.calls % LAZY_PROBE_EVERY == 0  # keep measuring the hit rate while skipping
        return self.tries < LAZY_WARMUP or self.hits >= LAZY_MIN_HIT_RATE * self.tries or probe

    def run(self, cap_ms: float, lam: np.ndarray, ar_cap_ms: float = INF) -> Relaxed | None:
        if self._worth_trying():
            self.tries += 1
            got = self.coarse.run(cap_ms, lam, ar_cap_ms)
            if got is None:  # the looser relaxation has no plan under the caps: neither has the full one
                return None
            if self.full.fits_layers(got):
                self.hits += 1
                return got
        return self.full.run(cap_ms, lam, ar_cap_ms)

    def cut(self, relaxed: Relaxed) -> Cut:
        return self.full.cut(relaxed)

    def placement(self, relaxed: Relaxed) -> Placement | None:
        return self.full.placement(relaxed)

    def block_floor_ms(self) -> float:
        return self.full.block_floor_ms()

    def max_allreduce_ms(self) -> float:
        return self.full.max_allreduce_ms()


def layered_dp(problem: Problem) -> SequenceDP | LazyLayers:
    """The sequence DP for ``problem``, behind a fewer-layer DP when that has fewer layers."""
    full = SequenceDP(problem)
    if full.J <= COARSE_LAYERS:
        return full
    return LazyLayers(full, full.with_layers(COARSE_LAYERS))


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
                   target_gap: float = 1e-3, iterations: int = 25, max_dps: int | None = None,
                   plans: bool = True, workers: int = 1) -> LagrangeResult:
    """A lower bound on ``F`` over every plan (and the best valid plan the DPs met); see the module docstring.

    ``plans=False``: the bound alone (for a relaxed problem, e.g. ``relax.merged_for_bound``, whose plans are
    not plans of the real one and must not become the incumbent that prunes the boxes). ``workers >= 2``:
    the relaxed plans are priced on a second thread while the DPs go on (``pricer``; the order in which
    plans are priced then depends on timing, so results with a DP count are not repeatable).
    """
    start = time.perf_counter()
    dp = layered_dp(problem)
    M = problem.num_microbatches
    best_plan: Placement | None = None
    best_ms = incumbent_ms
    dps = 0

    def deadline() -> bool:  # the time budget, or a DP count (deterministic, for tests and tuning)
        return time.perf_counter() - start > time_budget_s or (max_dps is not None and dps >= max_dps)

    tried: set[tuple[Group, ...]] = set()

    spent = [0.0]  # seconds pricing plans: capped at PLAN_SHARE of the time so far
    # The latest relaxed plans the cap skipped: the DPs of the tightest boxes come last, and where the
    # bound meets the optimum their plans are the optimal ones, so these are priced before returning.
    skipped: deque[Relaxed] = deque(maxlen=LAST_PLANS)

    pricer = BackgroundPricer(lambda r: _consider(r), backlog=PRICER_BACKLOG) if plans and workers > 1 else None

    def consider(relaxed: Relaxed) -> None:
        """Price the relaxed plan as it is, and its repaired class sequence re-partitioned."""
        if not plans:
            return
        if pricer is not None:
            pricer.submit(relaxed)
            return
        if spent[0] > PLAN_SHARE * (time.perf_counter() - start) + 0.05:
            skipped.append(relaxed)
            return
        t0 = time.perf_counter()
        try:
            _consider(relaxed)
        finally:
            spent[0] += time.perf_counter() - t0

    def _consider(relaxed: Relaxed) -> None:
        nonlocal best_plan, best_ms
        cands = []
        plan = dp.placement(relaxed)
        if plan is not None:
            cands.append((plan, evaluate(problem, plan).step_ms))
        groups = repair(problem, relaxed.stages)
        if groups is not None and groups not in tried:
            tried.add(groups)
            for exact in (False, True):
                got = sequence_placement(problem, groups, exact=exact)
                if got is not None:
                    cands.append(got)
        for plan, step in cands:
            if step < best_ms - 1e-9:
                best_plan, best_ms = plan, step

    lam_memo: list[tuple[tuple[float, float], np.ndarray]] = []
    pool: list[Cut] = []  # every relaxed plan met: cutting planes at every pair of caps it meets

    def dual(cap: float, ar_cap: float, enough: float = INF) -> float:
        """The best dual value at the caps: a lower bound on g(cap, ar_cap) (inf: nothing fits them).

        Kelley's cutting planes: the prices maximise the piecewise-linear model
        that the plans met so far give of the dual function, the DP at those
        prices adds a plan, until the model and the best value meet (the LP
        value of the relaxation) or the value reaches ``enough``.
        """
        nonlocal dps
        lam = np.zeros(dp.C)
        if lam_memo:  # warm start from the nearest caps already priced
            lam = min(lam_memo, key=lambda m: abs(m[0][0] - cap) + abs(m[0][1] - ar_cap) / max(M - 1, 1))[1].copy()
        cuts = [c for c in pool if c.peak_ms <= cap * (1 + 1e-12) and c.ar_ms <= ar_cap * (1 + 1e-12)]
        best, best_lam = -INF, lam
        master: _KelleyMaster | None = None
        for _ in range(iterations):
            got = dp.run(cap, lam, ar_cap)
            dps += 1
            if got is None:  # no sequence meets the caps, whatever the prices
                return INF
            consider(got)
            if got.value_ms > best:
                best, best_lam = got.value_ms, lam
            over = got.used - dp.count
            if best >= enough or ((over <= 0).all() and abs(float(lam @ over)) <= 1e-9 * max(1.0, abs(best))):
                break  # the box is settled, or complementary slackness: g at these caps exactly
            cut = dp.cut(got)
            pool.append(cut)
            if master is None:
                master = _KelleyMaster(cuts, dp.count, lam_max)
            master.add(cut)
            model, lam = master.solve()
            if model - best <= KELLEY_TOL * max(1.0, abs(best)) or deadline():
                break
        lam_memo.append(((cap, ar_cap), best_lam))
        return best

    # Bottleneck caps above incumbent / (M - 1) cannot beat the incumbent (M = 1: no fill term, one cap).
    top = INF if M == 1 else best_ms / (M - 1) if math.isfinite(best_ms) else 64 * dp.block_floor_ms()
    ar_top = dp.max_allreduce_ms()
    lo = dp.block_floor_ms() if M == 1 else _smallest_feasible_cap(dp, dp.block_floor_ms(), top, ar_top)
    # Without an incumbent nothing rules out plans above ``top``: they stay bounded by fill x top only.
    boxes = CapBoxes(lo=lo, top=max(top, lo), ar_top=ar_top, fill=M - 1,
                   open_top=math.isfinite(top) and not math.isfinite(best_ms))
    lam_max = best_ms if math.isfinite(best_ms) else 1e3 * max(top, 1.0)  # a price that settles any box
    boxes.add_point(top, boxes.ar_top, dual(top, boxes.ar_top))
    while True:
        bound, box = boxes.weakest(best_ms)
        if box is None or deadline() or bound >= best_ms * (1 - target_gap):
            break
        point = boxes.split(box)
        if point is None:
            break
        # The new point bounds the lower half of the split box: it is settled once it lifts that above the target.
        boxes.add_point(*point, dual(*point, enough=best_ms * (1 - target_gap) - boxes.floor(box)))
    if pricer is not None:
        pricer.close(drain=LAST_PLANS)
    for relaxed in skipped:
        _consider(relaxed)
    return LagrangeResult(bound_ms=bound, placement=best_plan, step_ms=best_ms, dps=dps, caps=len(boxes.points))


class _KelleyMaster:
    """max_lam min_cuts (tau + lam . (used - n)) over ``0 <= lam <= lam_max``, one cut added at a time.

    One LP per box, grown by a row per DP: GLOP re-solves from its last basis, where rebuilding the model
    from every cut met cost more per iteration than a DP once the pool held hundreds of plans.
    """

    def __init__(self, cuts: list[Cut], count: np.ndarray, lam_max: float) -> None:
        self.count = count
        self.solver = pywraplp.Solver.CreateSolver("GLOP")
        self.lam = [self.solver.NumVar(0.0, lam_max, f"lam{c}") for c in range(len(count))]
        self.z = self.solver.NumVar(-self.solver.infinity(), self.solver.infinity(), "z")
        self.solver.Maximize(self.z)
        for cut in cuts:
            self.add(cut)

    def add(self, cut: Cut) -> None:
        row = self.solver.Constraint(-self.solver.infinity(), float(cut.tau_ms))  # z - lam . (used - n) <= tau
        row.SetCoefficient(self.z, 1.0)
        for c, var in enumerate(self.lam):
            row.SetCoefficient(var, -float(cut.used[c] - self.count[c]))

    def solve(self) -> tuple[float, np.ndarray]:
        """(model value, prices); (-inf, zeros) when the LP is numerically stuck."""
        if self.solver.Solve() != pywraplp.Solver.OPTIMAL:
            return -INF, np.zeros(len(self.count))
        return self.z.solution_value(), np.array([v.solution_value() for v in self.lam])


def _smallest_feasible_cap(dp: SequenceDP | LazyLayers, lo: float, hi: float, ar_cap: float) -> float:
    """A cap below which no relaxed plan exists (so no plan at all): bisection, feasibility needs no prices."""
    if not math.isfinite(hi) or dp.run(hi, np.zeros(dp.C), ar_cap) is None:
        return lo
    for _ in range(FEASIBILITY_STEPS):
        mid = 0.5 * (lo + hi)
        if dp.run(mid, np.zeros(dp.C), ar_cap) is None:
            lo = mid
        else:
            hi = mid
    return lo
