"""The sequence DP of the Lagrangian bound (``lagrange``): its tables, one DP, and its answers as cuts or plans.

``tau_k`` is a lower bound on stage ``k``'s time ``t_k``: the busiest
replica's share ``ceil(M/r)/M`` times (compute + sends), the sends being the
activation to the next stage's class, the gradient to the previous one's,
and a verifier copy unless the receiver could verify (a trusted neighbour),
priced at the cheapest trusted class to reach. One DP at caps ``(T, A)`` and
device prices ``lambda`` gives ``min sum_k (tau_k + lambda_c r_k) - lambda . n``
over stage sequences with every ``tau_k <= T`` and every replicated stage's
all-reduce ``<= A``: a shortest path over (stage start block, previous class,
own class) per memory layer (``seqdp_kernel``, numba).

The cap is exact: a stage's send depends on the boundary it ends at, and
the boundaries' sizes vary along the chain (on a volunteer's slow link, and
with the verifier's copy, a large boundary costs more than the stage's
compute), so the ends that fit a cap are not a range of blocks. Testing the
cap at the smallest send of the pair of classes instead (a relaxation, and
what the DP did first) lets stages well over the cap into every DP, and so
weakens the bound at every cap pair. ``exact_cap=False`` keeps the looser
test: ``lazy_dp`` runs it first, and chains longer than
``EXACT_CAP_MAX_BLOCKS`` keep it (see there).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import numpy as np

from cost_models import comm
from planner.solver.bound.sequence_dp_kernel import key_tables, sequence_dp
from planner.solver.problem import Problem

INF = math.inf
# Range queries per DP (exact layers x blocks x classes^3 x replica options), ~10 ns each: deeper
# pipelines than the exact layers share one lumped layer whose memory check is weaker.
LAYER_BUDGET = 2_500_000
# Longer chains get the loose cap test: a stage then has enough boundaries near any cut that the loose test
# loses little, while the exact one doubles the cost of a DP, leaving fewer DPs for the bound and its plans
# (tuning history: benchmarks/README.md).
EXACT_CAP_MAX_BLOCKS = 500


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
    stages: tuple[tuple[int, int, int, int], ...] = ()  # the relaxed plan's (see ``Relaxed``)


class SequenceDP:
    """Tables of the relaxation for one problem (see the module docstring)."""

    def __init__(self, problem: Problem) -> None:
        p = self.p = problem
        self.max_layers: int | None = None
        # False: a stage's cap tested at its pair's smallest send (see the docstring).
        self.exact_cap = problem.num_blocks <= EXACT_CAP_MAX_BLOCKS
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
        self.KMIN = np.full((self.LOG, C, C, L + self.pad), INF)
        self.KMAX = np.full((self.LOG, C, C, L + self.pad), INF)
        key_tables(self.cp, self.FWD, self.KMIN, self.KMAX)
        self._work: tuple[np.ndarray, ...] | None = None
        # The cap HI/LV in _work were computed for, in a list that copies sharing _work share (``restricted``).
        self._limits_cap = [math.nan]

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
        self.FWD_MAX = self.FWD.max(axis=2)

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
        other.max_layers, other._work, other._limits_cap = max_layers, None, [math.nan]
        other._memory_tables()
        return other

    def with_loose_cap(self) -> SequenceDP:
        """The same DP testing each stage's cap at its smallest send (a relaxation: 2-3x cheaper)."""
        other = copy.copy(self)
        other.exact_cap, other._work, other._limits_cap = False, None, [math.nan]
        return other

    def restricted(self, allowed: np.ndarray) -> SequenceDP:
        """The same DP over the stage sequences that put every block ``l`` on a class ``c`` with
        ``allowed[c, l]`` (local classes x blocks; ``branching``): stages may neither start on nor reach a
        block their class may not hold. The copy shares this DP's work arrays (run one at a time)."""
        if self._work is None:
            self._allocate()
        nf = np.full((self.C, self.L + 1), self.L, dtype=np.int64)  # first block >= s the class may not hold
        for s in range(self.L - 1, -1, -1):
            nf[:, s] = np.where(allowed[:, s], nf[:, s + 1], s)
        other = copy.copy(self)
        other.EHI_MEM = np.minimum(self.EHI_MEM, (nf[:, :self.L] - 1)[:, None, None, :])
        other.LAST_FITS = self.LAST_FITS & (nf[:, :self.L] >= self.L)[:, None, :]
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
    def _allocate(self) -> None:
        """The kernels' work arrays, allocated once: they rewrite every entry they read."""
        C, R, L, LOG, J = self.C, self.R, self.L, self.LOG, self.J
        self._work = (np.full((LOG, C, R, C, L + self.pad), INF), np.full((LOG, C, R, C, L + self.pad), INF),
                      np.zeros((C, R, C, L, C), np.int64), np.zeros((C, R, C, L, C), np.int64),
                      np.zeros((C, R), np.int64), np.full((J, L + 1, C, C), INF), np.full((J, C), INF),
                      *(np.zeros((J, L, C, C), np.int64) for _ in range(4)))

    def run(self, cap_ms: float, lam: np.ndarray, ar_cap_ms: float = INF) -> Relaxed | None:
        """min over stage sequences of sum (tau_k + lam_c r_k) - lam . n, every tau_k <= cap_ms and
        every replicated stage's all-reduce <= ar_cap_ms."""
        C, L = self.C, self.L
        ar = self._ar_limits(ar_cap_ms)
        ehi = np.minimum(self.EHI_MEM, ar[:, :, None, :])
        last_ok = self.LAST_FITS & (ar >= L - 1)
        price = lam[:, None] * self.RR
        if self._work is None:
            self._allocate()
        SPa, SPb, HI, HS, LV, V, V0, kind, pick_r, pick_n, pick_hi = self._work
        ready = self._limits_cap[0] == cap_ms  # the stage-length limits depend on the cap alone
        sequence_dp(float(cap_ms), price, self.H, self.valid_r, self.cp, self.FWD, self.FWD_MIN,
                    self.FWD_MAX if self.exact_cap else self.FWD_MIN, self.KMIN, self.KMAX, self.BWD, ehi, last_ok,
                    self.trusted, bool(self.ends_trusted), bool(self.lump), SPa, SPb, HI, HS, LV, ready, V, V0,
                    kind, pick_r, pick_n, pick_hi)
        self._limits_cap[0] = cap_ms
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
            h, key = self.H[c, r], self.cp[c, e + 1] + self.FWD[c, n, e]
            room = cap_ms / h - (self.BWD[c, q, s] if s else 0.0) + self.cp[c, s]  # the kernel's cap test
            fits = key <= room if self.exact_cap else True
            q_vals = np.where(fits, h * key + V[nxt, e + 1, c, n], INF)
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

    def fits_cap(self, relaxed: Relaxed, cap_ms: float) -> bool:
        """Whether every stage of the relaxed plan meets the cap by this DP's exact test (a plan of the
        loose-cap DP may not)."""
        st = relaxed.stages
        for k, (s, e, cls, r) in enumerate(st[:-1]):
            i, n = self.SC.index(cls), self.SC.index(st[k + 1][2])
            h = self.H[i, int(np.flatnonzero(self.valid_r[i] & (self.RR[i] == r))[0])]
            bwd = self.BWD[i, self.SC.index(st[k - 1][2]), s] if k else 0.0
            if self.cp[i, e + 1] + self.FWD[i, n, e] > cap_ms / h - bwd + self.cp[i, s]:
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
        return Cut(tau_ms=float(sum(taus)), used=relaxed.used, peak_ms=float(max(taus)), ar_ms=float(max(ars)),
                   stages=st)

    def block_floor_ms(self) -> float:
        """A floor on any plan's largest ``tau``: the slowest block at its best class and smallest share."""
        share = np.where(self.valid_r, self.H, INF).min(axis=1)
        return float(np.max(np.min(self.p.time_ms[:, self.SC] * share[None, :], axis=1)))
