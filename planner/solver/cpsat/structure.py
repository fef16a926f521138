"""The variables of the CP-SAT model of ``planner.solver.cpsat.model``: stage slots, cuts, classes, tables.

``Structure`` is the base of ``cpsat._Builder``: the slots ``u``, the order-encoded cuts ``ge``/``e``, the
(class, replicas) choice per slot ``y``/``yc``/``r1``, the next stage's class per boundary ``nc``, the
per-position tables (floored time prefixes, parameters, activations, boundary bytes, transfer times) and
the linear expressions read from them (``work``, ``params``, ``acts``, ``bytes_at``, ``xfer``).
"""
from __future__ import annotations

import math

import numpy as np
from ortools.sat.python import cp_model

from cost_models import comm
from cost_models.cluster import Link
from planner.solver.problem import Problem

# The one scaling constant: one integer time unit is this fraction of the chain's
# per-microbatch time on its fastest device class.
COST_RESOLUTION = 1e-6


class Structure:
    """The model's variables and tables: the base of ``cpsat._Builder`` (its costs, verification and
    hint/decode come from the mixins)."""

    def __init__(self, problem: Problem, num_slots: int) -> None:
        self.p, self.K, self.m = problem, num_slots, cp_model.CpModel()
        p, M = problem, problem.num_microbatches
        self.L, self.M = p.num_blocks, M
        self.SC = [c.index for c in p.classes if c.stage_capable]
        ref = float(sum(p.time_ms[:, self.SC].min(axis=1))) or 1.0
        self.U = 1.0 / (COST_RESOLUTION * ref)  # integer units per ms
        self.opts = {c: p.replica_choices(c) for c in self.SC}
        pol = p.policy
        self.verify = pol.enabled and any(not p.classes[c].trusted for c in self.SC)
        self.cpu = [d for c in p.classes if c.verifier_host for d in c.device_ids] \
            if pol.verifier_placement in ("any", "cpu") else []
        self.stage_sites = pol.verifier_placement in ("any", "stage")
        self.F = num_slots - 1
        self._elem_cache: dict[tuple, cp_model.IntVar] = {}

    # --- helpers ----------------------------------------------------------
    def units(self, ms: float) -> int:
        return int(math.floor(ms * self.U))

    def bool(self, name: str) -> cp_model.IntVar:
        return self.m.new_bool_var(name)

    def ivar(self, hi: int, name: str, lo: int = 0) -> cp_model.IntVar:
        return self.m.new_int_var(lo, max(lo, int(hi)), name)

    def element(self, key: tuple, k: int, table: np.ndarray) -> cp_model.LinearExpr:
        """table[e_k] as a linear expression over the order encoding of e_k (memoised per key and slot).

        ``table[e] = table[0] + sum_{l <= e} (table[l] - table[l-1])`` and ``ge[k][l] = [e_k >= l]``:
        no value encoding of the result, and the LP relaxation sees fractional cuts.
        """
        ck = key + (k,)
        if ck not in self._elem_cache:
            vals = np.asarray(table, dtype=np.int64)[:self.L - 1]
            diffs = np.diff(vals)
            terms = [(int(d), self.ge[k][l]) for l, d in enumerate(diffs, start=1) if d != 0]
            if not terms:
                self._elem_cache[ck] = int(vals[0])
            else:
                var = self.m.new_int_var(int(vals.min()), int(vals.max()), f"{key[0]}_{k}")
                self.m.add(var == int(vals[0]) + cp_model.LinearExpr.weighted_sum(
                    [v for _, v in terms], [c for c, _ in terms]))
                self._elem_cache[ck] = var
        return self._elem_cache[ck]

    # --- structure ----------------------------------------------------------
    def _slots(self) -> None:
        m, K, L, F = self.m, self.K, self.L, self.F
        pol = self.p.policy
        self.u = [self.bool(f"u{k}") for k in range(K)]
        m.add(self.u[0] == 1)
        m.add(self.u[F] == 1)
        for k in range(1, K - 2):
            m.add(self.u[k] >= self.u[k + 1])
        # e[k]: last block of slot k (k < K-1); unused middle slots repeat the previous end.
        self.e = [m.new_int_var(0, L - 2, f"e{k}") for k in range(K - 1)]
        # Order encoding of the cuts: ge[k][l] = [e_k >= l], l = 1..L-2.
        self.ge = [[None] + [self.bool(f"ge{k}_{l}") for l in range(1, L - 1)] for k in range(K - 1)]
        for k in range(K - 1):
            row = self.ge[k][1:]
            for a, b in zip(row, row[1:]):
                m.add_implication(b, a)
            m.add(self.e[k] == sum(row))
        for k in range(1, K - 1):
            m.add(self.e[k] >= self.e[k - 1] + 1).only_enforce_if(self.u[k])
            m.add(self.e[k] == self.e[k - 1]).only_enforce_if(~self.u[k])
        self.last = [self.bool(f"last{j}") for j in range(K - 1)]  # slot j is the last before slot F
        for j in range(K - 1):
            m.add(self.last[j] == (self.u[j] - self.u[j + 1] if j + 1 < F else self.u[j]))
        endpoint_trust = pol.enabled and pol.trusted_endpoints
        self.y: list[dict[tuple[int, int], cp_model.IntVar]] = []
        self.yc: list[dict[int, cp_model.IntVar]] = []
        self.r1: list[cp_model.IntVar] = []
        for k in range(K):
            ys, ycs = {}, {}
            for c in self.SC:
                if endpoint_trust and k in (0, F) and not self.p.classes[c].trusted:
                    continue
                for r in self.opts[c]:
                    ys[(c, r)] = self.bool(f"y{k}_{c}_{r}")
                ycs[c] = self.bool(f"yc{k}_{c}")
                m.add(ycs[c] == sum(ys[(c, r)] for r in self.opts[c]))
            m.add(sum(ys.values()) == self.u[k])
            r1 = self.bool(f"r1_{k}")
            m.add(r1 == sum(v for (c, r), v in ys.items() if r == 1))
            self.y.append(ys)
            self.yc.append(ycs)
            self.r1.append(r1)
        for c in self.SC:
            m.add(sum(r * self.y[k][(c, r)] for k in range(K) for r in self.opts[c] if (c, r) in self.y[k])
                  <= self.p.classes[c].count)
        # nc[j][c]: the stage after boundary j (slot j+1 if used, else slot F) is on class c.
        self.nc: list[dict[int, cp_model.IntVar]] = []
        for j in range(K - 1):
            row = {}
            for c in self.SC:
                parts = []
                if j + 1 < F and c in self.yc[j + 1]:
                    parts.append(self.yc[j + 1][c])
                if c in self.yc[F]:
                    a = self.bool(f"lastF{j}_{c}")
                    m.add_bool_and([self.last[j], self.yc[F][c]]).only_enforce_if(a)
                    m.add_bool_or([~self.last[j], ~self.yc[F][c], a])
                    parts.append(a)
                if parts:
                    row[c] = self.bool(f"nc{j}_{c}")
                    m.add(row[c] == sum(parts))
            self.nc.append(row)

    def _tables(self) -> None:
        """Per-position tables: floored time prefixes, parameter/activation prefixes, boundary sizes."""
        p, L = self.p, self.L
        tp = p._time_prefix
        self.tprefix = {c: np.floor(tp[:, c] * self.U).astype(np.int64) for c in self.SC}
        self.pprefix = np.asarray(p._param_prefix, dtype=np.int64)
        self.aprefix = np.asarray(p._act_prefix, dtype=np.int64)
        self.bint = np.asarray(p.out_bytes_int, dtype=np.int64)
        self.links: dict[Link, int] = {}
        for a in range(len(p.classes)):
            for b in range(len(p.classes)):
                lk = p.links[a][b]
                if lk is not None:
                    self.links.setdefault(lk, len(self.links))
        self.xtab = {lk: np.array([self.units(comm.transfer_ms(p.boundary_bytes(e), lk)) for e in range(L)])
                     for lk in self.links}

    def work(self, k: int, c: int) -> cp_model.LinearExpr:
        """Floored units of slot k's blocks on class c (never above the true time)."""
        T = self.tprefix[c]
        if k == self.F:
            return int(T[self.L]) - self.element(("a", c), k - 1, T[1:]) - 1
        here = self.element(("a", c), k, T[1:])
        return here if k == 0 else here - self.element(("a", c), k - 1, T[1:]) - 1

    def params(self, k: int) -> cp_model.LinearExpr:
        key = ("params", k)
        if key not in self._elem_cache:
            self._elem_cache[key] = self._params(k)
        return self._elem_cache[key]

    def _params(self, k: int) -> cp_model.LinearExpr:
        P = self.pprefix
        if k == self.F:
            base = int(P[self.L]) - self.element(("p",), k - 1, P[1:])
        else:
            here = self.element(("p",), k, P[1:])
            base = here if k == 0 else here - self.element(("p",), k - 1, P[1:])
        return base + self._tied(k)

    def acts(self, k: int) -> cp_model.LinearExpr:
        A = self.aprefix
        if k == self.F:
            return int(A[self.L]) - self.element(("act",), k - 1, A[1:])
        here = self.element(("act",), k, A[1:])
        return here if k == 0 else here - self.element(("act",), k - 1, A[1:])

    def bytes_at(self, j: int) -> cp_model.IntVar:
        return self.element(("b",), j, self.bint)

    def xfer(self, j: int, lk: Link) -> cp_model.IntVar:
        return self.element(("x", self.links[lk]), j, self.xtab[lk])

    def _tied(self, k: int) -> cp_model.LinearExpr:
        """Parameters of tied copies slot k keeps (reads a tied parameter without its first block)."""
        if not self.p.tied:
            return 0
        total = 0
        for i, tie in enumerate(self.p.tied):
            copy = self.bool(f"tie{k}_{i}")
            holds = self._contains(k, tie.first_block)
            for r in tie.readers:
                self.m.add(copy >= self._contains(k, r) - holds)
            total += tie.param_count * copy
        return total

    def _contains(self, k: int, block: int) -> cp_model.LinearExpr:
        """1 if slot k holds ``block``: e_{k-1} < block <= e_k."""
        def ge(j: int) -> cp_model.LinearExpr:  # e_j >= block
            if j < 0 or block > self.L - 2:
                return 1 if j >= self.K - 1 else 0
            if j >= self.K - 1 or block == 0:
                return 1
            return self.ge[j][block]
        return ge(k) - ge(k - 1)
