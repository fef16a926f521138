"""The CP-SAT model of partition + placement + replication + verification, for pipelines of >= 2 stages.

Search space (the same one ``tests/unit/bruteforce.py`` enumerates), at a
fixed microbatch count ``M``:

* stage slots: slot 0 is the first stage, slot ``K-1`` the last, and slots
  ``1..K-2`` optional middle stages used as a prefix; each slot ends at a
  block ``e_k`` (contiguous ranges covering the chain);
* each used slot runs on ``r`` devices of one device class
  (``Problem.replica_choices``: the smallest ``r`` for each busiest-replica
  share; a larger ``r`` with the same share never helps), at most the class's
  device count over all slots. Classes already merge interchangeable devices,
  which is the symmetry breaking: a plan that only permutes identical devices
  is one assignment here;
* the verifier of a checked boundary sits on one of its two end stages, on
  the first or the last stage (single-replica stages, trusted, outside the
  checked senders' trust domain), or on a CPU verifier host, as the policy's
  ``verifier_placement`` allows, at most ``max_boundaries_per_verifier`` per
  device.

Costs and memory are those of ``planner.solver.objective`` term by term.
Times become integers at :data:`COST_RESOLUTION` of the chain's fastest
one-microbatch time, always rounded *down* (a range's time is a difference of
floored prefix sums, minus one unit), so the model never overprices a plan:
CP-SAT's best bound, divided back, is a valid lower bound on the true
objective over this search space. The plan it returns is re-priced exactly by
``objective.evaluate``. Memory is exact integer bytes.

Formulation choices. Cut positions are order-encoded (``ge[k][l] = [e_k >=
l]``) and every per-position table (time prefixes per class, parameters,
activations, boundary bytes, transfer and verify times per link/class) is a
linear sum over them: no value encoding, and the LP sees fractional cuts.
The stage-time constraints are enforced per (class, replicas) choice, which
the LP relaxes to almost nothing, so unconditional floors carry the bound:
each slot takes at least the best class's time of its blocks at the smallest
share plus its cheapest sends; ``T`` is at least the slowest block's best
time and the fluid bottleneck (``objective.fluid_bottleneck_ms``); and a
class's ``n`` devices hold at most ``n * T`` of work. CP-SAT gets a complete
hint (the caller's plan, completed by a solve with the decisions fixed); on
large models presolve is skipped, since it is slow there and drops the hint.

The verifier-placement part of the model is in ``verifiers``, hinting and
decoding in ``hint`` (mixins of ``_Builder``).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
from ortools.sat.python import cp_model

from cost_models import comm
from cost_models.cluster import Link
from planner.solver.cpsat.hint import HintMixin, complete_hint
from planner.solver.cpsat.verifiers import VerificationMixin
from planner.solver.objective import Placement, fluid_bottleneck_ms
from planner.solver.problem import Problem

# The one scaling constant: one integer time unit is this fraction of the chain's
# per-microbatch time on its fastest device class.
COST_RESOLUTION = 1e-6

# Above this many (block, slot) pairs CP-SAT starts from the hinted plan without presolve.
PRESOLVE_LIMIT = 2000

Progress = Callable[[float | None, float | None, float], None]  # (objective ms, bound ms, seconds)


@dataclass(frozen=True, slots=True, kw_only=True)
class CpsatResult:
    status: str
    placement: Placement | None
    bound_ms: float
    solve_s: float
    num_slots: int


class _Builder(VerificationMixin, HintMixin):
    """Builds the model; one instance per solve (verification and hint/decode come from the mixins)."""

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
    def build(self) -> None:
        self._slots()
        self._tables()
        self._transfers()
        if self.verify:
            self._verification()
        self._times()
        self._memory()
        self._objective()

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

    # --- costs ---------------------------------------------------------------
    def _transfers(self) -> None:
        """x[j]: boundary j's transfer over the link between slot j and the next stage."""
        m, K = self.m, self.K
        hi = max((int(t.max()) for t in self.xtab.values()), default=0)
        self.x = [self.ivar(hi, f"x{j}") for j in range(K - 1)]
        for j in range(K - 1):
            for c, ycj in self.yc[j].items():
                for c2, ncj in self.nc[j].items():
                    lk = self.p.links[c][c2]
                    if lk is not None:
                        m.add(self.x[j] >= self.xfer(j, lk)).only_enforce_if([ycj, ncj])
        self.xa = [0] * (K - 1)  # extra activation copies to a verifier, paid by slot j
        self.xg = [0] * (K - 1)  # extra gradient copies to a verifier, paid by the next stage

    def _times(self) -> None:
        m, K, M = self.m, self.K, self.M
        hi = int(max(self.tprefix[c][-1] for c in self.SC)) + 4 * max(
            (int(t.max()) for t in self.xtab.values()), default=0) + 10 ** 6
        hi += self.verify_hi if self.verify else 0
        self.t_hi = hi * 2
        self.t = [self.ivar(self.t_hi, f"t{k}") for k in range(K)]
        gF = self.ivar(hi, "gF")
        for j in range(K - 1):
            m.add(gF >= self.x[j] + self.xg[j]).only_enforce_if(self.last[j])
        for k in range(K):
            if k == self.F:
                comm_k = gF
            else:
                comm_k = self.x[k] + self.xa[k]
                if k > 0:
                    comm_k += self.x[k - 1] + self.xg[k - 1]
            vload = self.vload[k] if self.verify else 0
            for (c, r), lit in self.y[k].items():
                share = math.ceil(M / r)
                m.add(M * self.t[k] >= share * (self.work(k, c) + comm_k) + M * vload).only_enforce_if(lit)

    # --- memory -------------------------------------------------------------------
    def _memory(self) -> None:
        m, K, F, M, p = self.m, self.K, self.F, self.M, self.p
        for k in range(K):
            if k == 0:
                buffers = p.input_bytes + 2 * self.bytes_at(0)
            elif k == F:
                buffers = 2 * self.bytes_at(K - 2)
            else:
                buffers = 2 * self.bytes_at(k - 1) + 2 * self.bytes_at(k)
            static = self.params(k) * p.state_bytes_per_param + buffers + (self.vstate[k] if self.verify else 0)
            acts = self.acts(k)
            cap = sum(lit * p.classes[c].mem_bytes for (c, r), lit in self.y[k].items())
            if p.schedule == "gpipe":
                for (c, r), lit in self.y[k].items():
                    m.add(static + math.ceil(M / r) * acts <= p.classes[c].mem_bytes).only_enforce_if(lit)
                continue
            if k == F:  # the last stage holds one microbatch under 1F1B
                m.add(static + acts <= cap)
                continue
            for jf in range(1, min(M, K - k) + 1):
                lits = []
                shares = [lit for (c, r), lit in self.y[k].items() if math.ceil(M / r) >= jf]
                if not shares:
                    break
                if len(shares) < len(self.y[k]):
                    sg = self.bool(f"sg{k}_{jf}")
                    m.add(sg == sum(shares))
                    lits.append(sg)
                else:
                    lits.append(self.u[k])
                if k + jf - 2 >= 1:  # S - k >= jf  <=>  middle slot k + jf - 2 is used
                    lits.append(self.u[k + jf - 2])
                m.add(static + jf * acts <= cap).only_enforce_if(lits)

    # --- objective -------------------------------------------------------------------
    def _objective(self) -> None:
        m, K, M, p = self.m, self.K, self.M, self.p
        self.T = self.ivar(self.t_hi, "T")
        for k in range(K):
            m.add(self.T >= self.t[k])
        if self.verify:
            for v in self.cpu:
                m.add(self.T >= self.cpu_load[v])
        # Cut: the devices of a class can hold at most count * T of per-microbatch work.
        for c in self.SC:
            sel = []
            for k in range(K):
                if c in self.yc[k]:
                    w = self.ivar(int(self.tprefix[c][-1]), f"w{k}_{c}")
                    m.add(w >= self.work(k, c)).only_enforce_if(self.yc[k][c])
                    sel.append(w)
            m.add(p.classes[c].count * self.T >= sum(sel))
        self._time_floors()
        # Per-block bound: the slowest block's best time, replicas at the largest allowed share cut.
        per_block = max(min(self.units(p.time_ms[l, c]) * math.ceil(M / max(self.opts[c])) // M
                            for c in self.SC) for l in range(self.L))
        m.add(self.T >= per_block)
        m.add(self.T >= self.units(fluid_bottleneck_ms(p)))
        self.ar = self._allreduce()
        self.obj = sum(self.t) + (M - 1) * self.T + self.ar
        m.minimize(self.obj)

    def _time_floors(self) -> None:
        """Unconditional (LP-strong) floors on slot times: the class-enforced ones relax to nothing.

        Whatever its class and replicas, a slot takes at least the best share
        times the best class's time of each of its blocks, plus its cheapest
        sends (one for an end stage, two for a middle one).
        """
        m, p, M, K = self.m, self.p, self.M, self.K
        share = {c: math.ceil(M / max(self.opts[c])) / M for c in self.SC}
        per_block = np.min([share[c] * p.time_ms[:, c] for c in self.SC], axis=0)
        table = np.floor(np.concatenate([[0.0], np.cumsum(per_block)]) * self.U).astype(np.int64)
        h_min = min(share.values())
        send = min((int(t[:-1].min()) if len(t) > 1 else 0) for t in self.xtab.values()) if self.xtab else 0
        send = int(math.floor(h_min * send))
        for k in range(K):
            if k == self.F:
                floor = int(table[self.L]) - self.element(("amin",), k - 1, table[1:]) - 1 + send
            else:
                here = self.element(("amin",), k, table[1:])
                floor = (here if k == 0 else here - self.element(("amin",), k - 1, table[1:]) - 1)
                floor += send if k == 0 else 2 * send * self.u[k]
            m.add(self.t[k] >= floor)

    def _allreduce(self) -> cp_model.LinearExpr:
        m, p = self.m, self.p
        terms = [(k, c, r, lit) for k in range(self.K) for (c, r), lit in self.y[k].items() if r > 1]
        if not terms:
            return 0
        total_grad = int(p.param_count.sum() + sum(t.param_count for t in p.tied)) * p.grad_bytes_per_param
        ar_hi = max(self.units(comm.allreduce_ms(total_grad, (p.links[c][c],) * r, r)) + 1
                    for _, c, r, _ in terms)
        ar = self.ivar(ar_hi, "AR")
        for k, c, r, lit in terms:
            ring = (p.links[c][c],) * r
            slope_ms = comm.allreduce_ms(1e9, ring, r) - comm.allreduce_ms(0.5e9, ring, r)  # per 0.5e9 bytes
            per_param = slope_ms / 0.5e9 * p.grad_bytes_per_param * self.U
            lat_units = self.units(2 * (r - 1) * ring[0].latency_ms)
            scale = 1 << max(0, math.ceil(math.log2(1.0 / (COST_RESOLUTION * max(per_param, 1e-30))))) \
                if per_param > 0 else 1
            scale = min(scale, max(1, (1 << 60) // (ar_hi + 1)))
            slope = int(math.floor(per_param * scale)) * self.params(k)
            if int(p.param_count.min()) > 0:
                m.add(scale * ar >= slope + scale * lat_units).only_enforce_if(lit)
                continue
            # A stage without parameters all-reduces nothing (no latency either).
            has = self.bool(f"hasp{k}_{c}_{r}")
            m.add(self.params(k) <= 0).only_enforce_if(~has)
            m.add(scale * ar >= slope).only_enforce_if(lit)
            m.add(scale * ar >= slope + scale * lat_units).only_enforce_if([lit, has])
        return ar


class _Progress(cp_model.CpSolverSolutionCallback):
    def __init__(self, units_per_ms: float, report: Progress | None) -> None:
        super().__init__()
        self.U, self.report = units_per_ms, report

    def on_solution_callback(self) -> None:
        if self.report is not None:
            self.report(self.objective_value / self.U, self.best_objective_bound / self.U, self.wall_time)


def num_slots(problem: Problem) -> int:
    """Most stages a plan can have: one block and one device each."""
    devices = sum(c.count for c in problem.classes if c.stage_capable)
    return min(problem.num_blocks, devices)


def solve_cpsat(problem: Problem, *, time_limit_s: float, workers: int = 2, hint: Placement | None = None,
                max_slots: int | None = None, progress: Progress | None = None,
                gap_tolerance: float = 0.0) -> CpsatResult:
    """Solve the model of the module docstring for pipelines of 2 to ``max_slots`` stages.

    ``bound_ms`` is a valid lower bound over those pipelines (``inf`` when
    proven infeasible); the search stops (OPTIMAL) once its plan is within
    ``gap_tolerance`` of it.
    """
    K = min(num_slots(problem), max_slots or num_slots(problem))
    start = time.perf_counter()
    if K < 2:
        return CpsatResult(status="SKIPPED", placement=None, bound_ms=math.inf, solve_s=0.0, num_slots=K)
    b = _Builder(problem, K)
    b.build()
    hinted = False
    if hint is not None:
        b.hint(hint)
        hinted = complete_hint(b.m, min(5.0, 0.2 * time_limit_s), workers)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.05, time_limit_s - (time.perf_counter() - start))
    solver.parameters.num_workers = max(1, workers)
    solver.parameters.random_seed = 0
    solver.parameters.relative_gap_limit = gap_tolerance
    if hinted and problem.num_blocks * K > PRESOLVE_LIMIT:
        # Presolve of a large model is slow and drops the hinted plan; search from the plan instead.
        solver.parameters.cp_model_presolve = False
    if progress is not None:
        solver.best_bound_callback = lambda bound: progress(None, bound / b.U, time.perf_counter() - start)
    status = solver.solve(b.m, _Progress(b.U, progress))
    name = solver.status_name(status)
    placement = b.decode(solver) if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) else None
    if status == cp_model.INFEASIBLE:
        bound = math.inf
    else:
        bound = max(0.0, solver.best_objective_bound / b.U)
    return CpsatResult(status=name, placement=placement, bound_ms=bound,
                       solve_s=time.perf_counter() - start, num_slots=K)
