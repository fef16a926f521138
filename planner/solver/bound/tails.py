"""A lower bound on the compiled programs' cost from the pipeline's depth and the all-reduces behind it.

Where every link is slow (DT-FM's pools: 2 Gb/s at best), a plan's step is its deepest stages' stream, the round
trip of a pipeline of ``S`` stages (``S - 1`` crossings each way), and the all-reduce of an early replicated stage
that waits for the last gradient to come back up to it. The fill bound (``bound.fill``) sees each stage alone and
at least one crossing after it; this one knows the number of stages and couples a deep stage with the all-reduce
of a shallower one. For a plan, its stage ``k`` (depth ``z = k``, ``d = S - 1 - z`` stages after it) over blocks
``j..i-1`` with ``r`` replicas, its busiest replica runs ``m >= ceil(M / r)`` microbatches. With ``F``, ``Bw`` and
``U`` the prefix sums of the blocks' least forward, backward and both, ``t``, ``f``, ``b`` the stage's least pass,
forward and backward, ``h`` the least transfer of one crossing and ``H(n)`` of ``n`` crossings one way
(``route_hops_ms``: each crossing between two distinct devices of a route, ``H(n) >= n h``):

* that replica's first input arrives no sooner than ``A = F(j) + H(z)``; a microbatch's backward there needs its
  forward and its round trip after the stage, ``D = U(L) - U(i) + 2 H(d)`` (every block after it forward and
  back, ``d`` crossings each way, the same device pairs both ways; ``D = 0`` for the last stage); one device runs
  one pass at a time, so its last pass ends no sooner than ``A + W`` with ``W = max(m t, m f + D + b, f + D + m b)``
  (the last forward, its round trip and backward; no backward before the first round trip, then ``m`` of them);
* the stage all-reduces once its last backward ends, then steps its optimizer (``program_cost``: ``step = max_k
  (end_k + AR_k + optim_k)``): ``step >= A + W + AR(r) + optim`` (``AR``: ``replicas.Rings``' floor over ``r``);
* the microbatch of that last pass still has its backward through every stage before, ``z`` crossings and the
  blocks ``0..j-1`` backward: ``X = A + W + Bw(j) + z h`` is no later than any of them ends their backward of it,
  so a shallower stage ``k' < k`` over blocks ``j'..`` has ``end_k' >= X - Bw(j') - z' h`` and ``step >= X + Y_k'``
  with ``Y_k' = AR_k' + optim_k' - Bw(j') - z' h``; with stage 0 (``Y >= `` its least optimizer step) for every
  stage.

The pairs are coupled through a level ``theta``: once a stage with ``Y >= theta`` is placed, every later stage has
``X + theta <= B``. Every plan meets this for every ``theta`` (its own ``Y`` is at least ``theta`` there), so a
step of ``B`` is ruled out where for some ``theta`` no partition meets it with the pool's devices: per number of
stages ``S``, a DP over the blocks whose state is the stages so far and whether such a stage was placed, holding
the fewest devices (each stage's fewest replicas that meet its terms: where a plan's stage has ``r``, that is at
most ``r``). Also every stage's blocks, their weights, optimizer state and one microbatch's activations, fit a
device. ``step >= B`` for the least ``B`` no level rules out (bisected; its infeasible end is returned).

**Regions a route must visit** (``route_hops_ms``). ``H(n)`` is ``replicas.hops_ms`` (at most ``N - Q`` crossings
inside an island) or, where more, this: a microbatch's route over ``n`` crossings has ``n + 1`` distinct devices
(one stage a device). At a partition of the pool into islands (``islands.partitions``) of sizes ``s_1 >= s_2 >=
...``, those devices lie in ``q >= q(n + 1)`` islands, ``q(x)`` the fewest whose sizes sum to ``x`` at least (no
``q - 1`` islands hold more than the ``q - 1`` largest do); the route enters each island but its first over a link
between islands, so ``q(n + 1) - 1`` of its crossings at least are, each no quicker than the partition's fastest
and quickest link between islands carrying the smallest boundary (``slow``), and every crossing is at least
``hops_ms(1)`` (the least of one): ``H(n) >= (n - q(n + 1) + 1) hops_ms(1) + (q(n + 1) - 1) slow``. DT-FM
worldwide (eight regions of eight): a route of 20 stages crosses regions twice at least.

**Slots.** A replica holds at most the microbatches its memory has room for in flight beside its stage's state
(``in_flight.limit``: ``max(least, min(need, cap))``; a valid plan's memory holds the schedule's least, GPipe's
``m`` or 1F1B's ``min(m, d + 1)``, so that least is at most the cap). The room is read on the largest device's
memory, the state and activations as ``bound_problem`` relaxes them (a recomputing stage's inputs only): a row
whose least does not fit is no plan's. Each microbatch holds its slot from its forward's start to its backward's
end, at least ``f + D + b``; at most ``n`` of these intervals overlap, so they split into ``n`` chains of disjoint
ones (interval graphs are perfect) and one chain holds ``ceil(m / n)``: ``W >= ceil(m / n) (f + D + b)``.

The terms hold for exact gradients or compressed (``Rings`` drops the all-reduce where it may be compressed),
with verifiers (their checks only add waits) and without trusted ends (a constraint the bound leaves out only
makes it weaker). Chains longer than ``MAX_BLOCKS`` blocks get no bound (0).
"""
from __future__ import annotations

import math

import numpy as np

from planner.solver.bound.islands import min_wire_bytes, partitions
from planner.solver.bound.replicas import Rings, hops_ms
from planner.solver.problem import Problem, bound_problem
from planner.solver.search.budget import UNITS_PER_S, Work

# Chains up to this many blocks (the tables grow as L^4 / 24 rows of stage, depth and stages after).
MAX_BLOCKS = 40
# Levels ``theta`` tried per test, spread over ``(0, B)``.
LEVELS = 8
# Each row's in-flight slots (module docstring, **Slots**); off: neither the schedule's least nor the cycles (tests).
SLOTS = True
# Relative width the bisection stops at (its infeasible end is returned: valid at any width).
REL_TOL = 1e-3
# Work charged (microseconds of CPU, measured on DT-FM regional: 92 ms to build 306k row options, 66 ms a test):
# building, per row and replica option; a test, per row and option and per DP cell.
BUILD_UNITS, ROW_UNITS, DP_UNITS = 0.3, 0.1, 0.06


def tail_bound_ms(problem: Problem, floor_ms: float = 0.0, *, cap_ms: float | None = None,
                  within: Work | None = None, rel_tol: float = REL_TOL) -> float:
    """The bound of the module docstring (ms); ``floor_ms`` where it is no more (a bound known valid). With
    ``cap_ms`` (a plan of that cost is known) no bound above it is sought. ``within``: the work budget each
    test is charged to; a test it cannot afford ends the bisection (the bound so far: valid)."""
    problem = bound_problem(problem)
    size = _size(problem)
    if not size or (within is not None and within.left_s() * UNITS_PER_S < BUILD_UNITS * size):
        return floor_ms
    if within is not None:
        within.charge(BUILD_UNITS * size)
    tables = _Tables.of(problem)
    if tables is None:
        return floor_ms
    hi = cap_ms if cap_ms is not None and math.isfinite(cap_ms) else None

    def feasible(B: float) -> bool | None:
        if within is not None:
            if within.left_s() * UNITS_PER_S < tables.units:
                return None
            within.charge(tables.units)
        return tables.feasible(B)

    lo = floor_ms
    if hi is None:
        hi = max(2 * lo, 1.0)
        while True:
            ok = feasible(hi)
            if ok is None:
                return lo
            if ok:
                break
            lo, hi = hi, 2 * hi
            if hi > 1e12:
                return lo
    elif hi <= lo:
        return lo
    else:
        ok = feasible(hi)
        if ok is None:
            return lo
        if not ok:
            return hi * (1 - 1e-9)
    ok = feasible(lo)
    if ok is None or ok:
        return lo
    while hi - lo > rel_tol * hi:
        mid = 0.5 * (lo + hi)
        ok = feasible(mid)
        if ok is None:
            break
        lo, hi = (lo, mid) if ok else (mid, hi)
    return lo * (1 - 1e-9)


def route_hops_ms(problem: Problem, stage: list[int], L: int) -> np.ndarray:
    """Per count ``n <= L`` of crossings one way, their least transfer time: ``replicas.hops_ms``, raised by the
    regions a route of ``n + 1`` distinct devices must visit (module docstring, **Regions a route must visit**)."""
    out = hops_ms(problem, stage, L)
    wire = min_wire_bytes(problem)
    if wire <= 0 or L < 1:
        return out
    n, one = np.arange(L + 1), float(out[1])
    for _, isl in partitions(problem, stage):
        held = np.cumsum(sorted((sum(I.values()) for I in isl.members), reverse=True))
        forced = np.minimum(_islands_holding(held, n + 1) - 1, n)  # crossings between islands at least
        slow = isl.between.latency_ms + 1e3 * wire / isl.between.bytes_per_s
        out = np.maximum(out, (n - forced) * one + forced * slow)
    return out


def _islands_holding(held: np.ndarray, devices: np.ndarray) -> np.ndarray:
    """The fewest islands holding ``devices`` devices (``held``: the largest islands' cumulative sizes; all of
    them past the pool: no route has more devices than the pool, so any count is valid there)."""
    return np.minimum(np.searchsorted(held, devices) + 1, len(held))


def _slots(schedule: str, m: np.ndarray, d: np.ndarray, room: np.ndarray, act: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray]:
    """Per row and replica option: the microbatches the busiest replica must hold in flight (the schedule's least:
    GPipe all ``m``, 1F1B ``min(m, d + 1)``), and per row those its memory has room for (``room``: the largest
    device's beside the stage's state; inf: no activations). Module docstring, **Slots**."""
    with np.errstate(divide="ignore", invalid="ignore"):
        slots = np.where(act > 0, np.floor(room / np.where(act > 0, act, 1.0)), np.inf)
    held = np.broadcast_to(m, (len(d), m.shape[1])) if schedule == "gpipe" else np.minimum(m, (d + 1)[:, None])
    return held, slots


def _size(problem: Problem) -> int:
    """Row options ``_Tables.of`` builds at most (0: none, past ``MAX_BLOCKS``): stages ``j..i-1``, depths ``z <= j``,
    stages after ``d`` (one block each at least), replica options (at most ``2 sqrt(M) + 1``)."""
    L, M = problem.num_blocks, problem.num_microbatches
    if L > MAX_BLOCKS:
        return 0
    rows = sum((j + 1) * max(L - i, 1) for j in range(L) for i in range(j + 1, L + 1))
    return rows * int(2 * math.isqrt(M) + 2)


class _Tables:
    """Per row (stage ``j..i-1`` at depth ``z`` with ``d`` stages after it) and replica option ``r``: what a step
    must be at least for that stage (``need``), its ``X`` and ``Y`` (module docstring). None of it depends on
    ``B``; a test compares and runs the DP."""

    def __init__(self, L: int, N: int, rows: np.ndarray, reps: np.ndarray, need: np.ndarray, X: np.ndarray,
                 Y: np.ndarray) -> None:
        self.L, self.N, self.rows, self.reps = L, N, rows, reps
        self.need, self.X, self.Y = need, X, Y
        S = rows[:, 2] + rows[:, 3] + 1
        self.by_stages = [(s, np.flatnonzero(S == s)) for s in range(1, L + 1) if (S == s).any()]
        self.units = ROW_UNITS * need.size + DP_UNITS * LEVELS * L ** 4 / 6  # a test's

    @staticmethod
    def of(problem: Problem) -> _Tables | None:
        L, M = problem.num_blocks, problem.num_microbatches
        stage = [c.index for c in problem.classes if c.stage_capable]
        if not stage or L > MAX_BLOCKS:
            return None
        N = sum(problem.classes[c].count for c in stage)
        bwd = problem.time_ms * (2.0 / 3.0) if problem.bwd_ms is None else problem.bwd_ms
        fwd = problem.time_ms - bwd
        zero = np.zeros(1)
        T = np.concatenate([zero, np.cumsum(problem.time_ms[:, stage].min(axis=1))])
        F = np.concatenate([zero, np.cumsum(fwd[:, stage].min(axis=1))])
        Bw = np.concatenate([zero, np.cumsum(bwd[:, stage].min(axis=1))])
        U = F + Bw
        H = route_hops_ms(problem, stage, L)
        h = float(H[1]) if L >= 1 else 0.0
        state = np.concatenate([zero, np.cumsum(problem.param_count.astype(float) * problem.state_bytes_per_param)])
        act = np.concatenate([zero, np.cumsum(problem.act_bytes.astype(float))])
        need = state + act
        mem = max(problem.classes[c].mem_bytes for c in stage)
        grads = np.concatenate([zero, np.cumsum(problem.param_count.astype(float))]) * problem.grad_bytes_per_param
        opt = np.full((L + 1, L + 1), np.inf)
        for j in range(L):
            for i in range(j + 1, L + 1):
                opt[j, i] = min(problem.range_optim_ms(j, i - 1, c) for c in stage)
        opt_any = float(opt[0, 1:].min())
        # Replica options: the fewest replicas for each busiest count m = ceil(M / r) (more at the same m only
        # raises the all-reduce), at most the devices and M (each replica runs a microbatch at least).
        reps = np.array(sorted({math.ceil(M / m) for m in range(1, M + 1)} & set(range(1, min(M, N) + 1))))
        m = np.ceil(M / reps)
        ring = Rings(problem, stage, min(M, N))
        rows = []
        for j in range(L):
            for i in range(j + 1, L + 1):
                if need[i] - need[j] > mem:
                    continue
                for z in range(j + 1):
                    for d in (range(1, L - i + 1) if i < L else (0,)):
                        rows.append((j, i, z, d))
        if not rows:
            return None
        R = np.array(rows)
        j, i, z, d = R.T
        t, f, b = (P[i] - P[j] for P in (T, F, Bw))
        D = np.where(i < L, U[L] - U[i] + 2 * H[d], 0.0)
        A = F[j] + H[z]
        mm = m[None, :]
        W = np.maximum(np.maximum(mm * t[:, None], mm * f[:, None] + (D + b)[:, None]),
                       (f + D)[:, None] + mm * b[:, None])
        held, slots = _slots(problem.schedule, mm, d, mem - (state[i] - state[j]), act[i] - act[j])
        if SLOTS:
            W = np.maximum(W, np.ceil(mm / np.maximum(slots, 1.0)[:, None]) * (f + D + b)[:, None])
        params = grads[i] - grads[j]
        AR = ring.floor(np.repeat(params, len(reps)), np.tile(reps, len(R))).reshape(len(R), len(reps))
        own = A[:, None] + W + AR + opt[j, i][:, None]
        X = A[:, None] + W + (Bw[j] + z * h)[:, None]
        back = np.where((z >= 1)[:, None], X + opt_any, 0.0)
        Y = AR + (opt[j, i] - Bw[j] - z * h)[:, None]
        fits = held <= slots[:, None] if SLOTS else True
        return _Tables(L, N, R, reps, np.where(fits, np.maximum(own, back), np.inf), X, Y)

    def feasible(self, B: float) -> bool:
        """Whether, at every level, some number of stages has a partition meeting ``B`` with the pool's devices."""
        L, N = self.L, self.N
        levels = B * np.arange(1, LEVELS + 1) / (LEVELS + 1)
        ok = self.need <= B  # (rows, options)
        r = self.reps[None, :].astype(float)
        # per row and level: the fewest replicas keeping the flag clear, setting it, and once it is set
        low = self.Y[:, :, None] < levels[None, None, :]
        keep = np.where(ok[:, :, None] & low, r[:, :, None], np.inf).min(axis=1)
        put = np.where(ok[:, :, None] & ~low, r[:, :, None], np.inf).min(axis=1)
        late = ok[:, :, None] & (self.X[:, :, None] + levels[None, None, :] <= B)
        held = np.where(late, r[:, :, None], np.inf).min(axis=1)
        tables = (keep, put, held)
        reached = np.zeros(LEVELS, dtype=bool)
        for s, at in self.by_stages:
            j, i, z = self.rows[at, 0], self.rows[at, 1], self.rows[at, 2]
            cost = np.full((3, s, L + 1, L + 1, LEVELS), np.inf)  # (kind, z, j, i, level)
            for k, table in enumerate(tables):
                cost[k, z, j, i] = table[at]
            # best[flag, z, i, level]: the fewest devices on blocks 0..i-1 in z stages of this S-stage plan
            best = np.full((2, s + 1, L + 1, LEVELS), np.inf)
            best[0, 0, 0] = 0.0
            for zz in range(s):
                came0, came1 = best[0, zz], best[1, zz]  # (j, level)
                c = cost[:, zz]  # (kind, j, i, level)
                np.minimum(best[0, zz + 1], (came0[:, None, :] + c[0]).min(axis=0), out=best[0, zz + 1])
                np.minimum(best[1, zz + 1], (came0[:, None, :] + c[1]).min(axis=0), out=best[1, zz + 1])
                np.minimum(best[1, zz + 1], (came1[:, None, :] + c[2]).min(axis=0), out=best[1, zz + 1])
            reached |= (best[:, s, L] <= N).any(axis=0)
            if reached.all():
                return True
        return bool(reached.all())
