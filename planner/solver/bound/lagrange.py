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
layer (``sequence_dp``, with the exact cap; ``lazy_dp`` runs a looser DP first). The
prices at each pair of caps come from Kelley's cutting planes (a small LP
over the plans met so far, whose stage times and device use bound the dual
function from above at every pair of caps they meet), warm started from the
nearest pair; they reach the relaxation's LP value in tens of DPs, where a
subgradient ascent stalls far below it. Every relaxed plan met goes to the search
wing (``search.relaxed_plans``: repaired to the device counts, re-partitioned,
priced exactly, then a local search), whose best valid plan is the incumbent
that prunes the boxes and is returned with the bound.

Where a box is too narrow for splits to lift it and its prices have
converged, what holds it down is the relaxation itself (mixtures of
sequences that meet the device counts only on average); the box's caps then
get a tree that branches on the class holding one block (``branching``),
whose weakest leaf's dual value is the box's.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from ortools.linear_solver import pywraplp

from planner.solver.bound.boxes import CapBoxes
from planner.solver.bound.branching import (
    ClassTree,
    child_masks,
    most_split_block,
    satisfies,
)
from planner.solver.bound.lazy_dp import LazyDP, layered_dp
from planner.solver.bound.relax import merged_for_bound
from planner.solver.bound.sequence_dp import Cut, Relaxed, SequenceDP
from planner.solver.objective import Placement
from planner.solver.problem import Problem, bound_problem, comm_free_for_bound
from planner.solver.search.budget import Work, dp_units
from planner.solver.search.relaxed_plans import LOCAL_TAIL, RelaxedPlans, repair

__all__ = ["LagrangeBound", "LagrangeResult", "LazyDP", "Relaxed", "SequenceDP", "lagrange_bound", "layered_dp",
           "program_bound_ms", "repair"]

INF = math.inf
MIN_WORK_S = 0.05  # work left under which ``program_bound_ms`` seeks nothing (its first DPs alone cost about this)
FEASIBILITY_STEPS = 12  # bisection steps for the smallest bottleneck any relaxed plan meets
KELLEY_TOL = 1e-4  # relative gap between the cutting-plane model and the best dual value that ends a cap
# A box's prices are refined until it is this share of the incumbent above the next weakest box, and resumed
# when it is the weakest again (None: until it reaches the target, or the prices converge). Off: a lift gives a
# better bound per DP but changes which relaxed plans are met, and where pricing cannot keep up with them the
# best plan gets worse (tuning history: benchmarks/README.md).
LAZY_LIFT: float | None = None
# Boxes narrower than this share of the incumbent (what splitting them can still add) branch on block
# classes instead (``branching``); wider ones split first, branching costing tens of DPs per child. This width
# lifts a stalled bound most and is no worse on short solves (tuning history: benchmarks/README.md).
BRANCH_WIDTH = 5e-3


@dataclass(frozen=True, slots=True, kw_only=True)
class LagrangeResult:
    bound_ms: float
    placement: Placement | None
    step_ms: float
    dps: int
    caps: int


class LagrangeBound:
    """The bound's search over cap boxes; see the module docstring. ``plans`` (the search wing's
    ``RelaxedPlans``) receives every relaxed answer met and holds the incumbent that prunes the boxes;
    without it the incumbent stays ``incumbent_ms``."""

    def __init__(self, problem: Problem, *, incumbent_ms: float, work: Work, target_gap: float = 1e-3,
                 iterations: int = 25, max_dps: int | None = None, plans: RelaxedPlans | None = None) -> None:
        self.problem, self.plans = problem, plans
        self.work, self.target_gap, self.iterations, self.max_dps = work, target_gap, iterations, max_dps
        self._incumbent_ms = incumbent_ms
        self.dp = layered_dp(problem)
        self.full_dp = self.dp.base if isinstance(self.dp, LazyDP) else self.dp
        base = self.full_dp
        self._dp_units = dp_units(base.L, base.C, base.R, base.J)
        self.dps = 0
        self.lam_memo: list[tuple[tuple[float, float], np.ndarray]] = []
        self.pool: list[Cut] = []  # every relaxed plan met: cutting planes at every pair of caps it meets
        self.points: dict[tuple[float, float], _Point] = {}
        self.trees: dict[tuple[float, float], ClassTree] = {}
        self.lam_max = 0.0
        self.boxes: CapBoxes | None = None

    @property
    def best_ms(self) -> float:
        return self.plans.best_ms if self.plans is not None else self._incumbent_ms

    def deadline(self) -> bool:
        """The work budget (``budget``: each DP charged), or a DP count (for tests and tuning)."""
        return self.work.passed() or (self.max_dps is not None and self.dps >= self.max_dps)

    def _bisect_late(self) -> bool:
        """``deadline`` for the feasibility bisection, which runs one DP per step."""
        self.work.charge(self._dp_units)
        return self.deadline()

    def _met(self, relaxed: Relaxed) -> None:
        if self.plans is not None:
            self.plans.consider(relaxed)

    def price(self, pt: _Point, enough: float) -> None:
        """Kelley's cutting planes at the point's caps, resumed where they stopped, until the best dual value
        reaches ``enough``, the model and the best value meet (the LP value of the relaxation) or the time ends.

        The prices maximise the piecewise-linear model that the plans met so far give of the dual function;
        the DP at those prices adds a plan.
        """
        dp = self.dp
        run = dp if pt.allowed is None else dp.restricted(pt.allowed)  # a branch's leaf: its classes only
        while not pt.done:
            got = run.run(pt.cap, pt.lam, pt.ar_cap)
            self.dps += 1
            self.work.charge(self._dp_units)
            pt.runs += 1
            if got is None:  # no sequence meets the caps, whatever the prices
                pt.best, pt.done = INF, True
                break
            self._met(got)
            for looser in getattr(run, "missed", ()):  # the looser DPs' plans: seeds for the incumbent too
                self._met(looser)
            if got.value_ms > pt.best:
                pt.best, pt.best_lam = got.value_ms, pt.lam
            over = got.used - dp.count
            if (over <= 0).all() and abs(float(pt.lam @ over)) <= 1e-9 * max(1.0, abs(pt.best)):
                pt.done = True  # complementary slackness: g at these caps exactly
                break
            if pt.master is None:  # the plans met so far that meet these caps, then this DP's (one of its candidates)
                cuts = [c for c in self.pool if c.peak_ms <= pt.cap * (1 + 1e-12) and c.ar_ms <= pt.ar_cap * (1 + 1e-12)
                        and satisfies(c, pt.allowed, self.full_dp.SC)]
                pt.master = _KelleyMaster(cuts, dp.count, self.lam_max)
            cut = dp.cut(got)
            self.pool.append(cut)
            pt.master.add(cut)
            pt.model, pt.lam = pt.master.solve()
            pt.done = pt.model - pt.best <= KELLEY_TOL * max(1.0, abs(pt.best)) or pt.runs >= self.iterations
            if pt.best >= enough or self.deadline():
                break
        if pt.best_lam is not None and pt.allowed is None:
            self.lam_memo.append(((pt.cap, pt.ar_cap), pt.best_lam))

    def branch(self, pt: _Point, box: tuple[float, float, float, float], level: float) -> bool:
        """Grow the class tree at the box's upper caps by one step (False: its weakest leaf cannot branch)."""
        boxes, full_dp = self.boxes, self.full_dp
        tree = self.trees.setdefault((pt.cap, pt.ar_cap), ClassTree(pt))
        leaf = tree.weakest()
        enough = level - boxes.floor(box)
        if not leaf.done and leaf.model >= enough:
            self.price(leaf, enough)
        else:
            weighted = leaf.master.weighted() if leaf.master is not None else []
            block = most_split_block(weighted, full_dp.L, full_dp.SC)
            if block is None:
                return False
            lam = leaf.lam if leaf.best_lam is None else leaf.best_lam
            kids = [_Point(cap=pt.cap, ar_cap=pt.ar_cap, lam=lam.copy(), allowed=mask)
                    for mask in child_masks(leaf.allowed, block, full_dp.C, full_dp.L)]
            tree.replace(leaf, kids)
            for kid in kids:
                if self.deadline():
                    kid.best = -INF  # unpriced: bounds nothing
                    continue
                self.price(kid, enough)
        # Every box this point bounds has a floor of at least the lowest box's: leaves above the incumbent
        # less that floor bound nothing that could beat it.
        boxes.add_point(pt.cap, pt.ar_cap, tree.value(self.best_ms - boxes.least_floor()))
        return True

    def new_point(self, cap: float, ar_cap: float) -> _Point:
        lam = np.zeros(self.dp.C)
        if self.lam_memo:  # warm start from the nearest caps already priced
            fill = max(self.problem.num_microbatches - 1, 1)
            lam = min(self.lam_memo, key=lambda m: abs(m[0][0] - cap) + abs(m[0][1] - ar_cap) / fill)[1].copy()
        pt = self.points[(cap, ar_cap)] = _Point(cap=cap, ar_cap=ar_cap, lam=lam)
        return pt

    def run(self) -> float:
        """The bound: boxes of caps lifted (prices refined, boxes split or branched) until the target gap to the
        incumbent, no box left, or the time ends."""
        dp, M, best_ms = self.dp, self.problem.num_microbatches, self.best_ms
        # Bottleneck caps above incumbent / (M - 1) cannot beat the incumbent (M = 1: no fill term, one cap).
        top = INF if M == 1 else best_ms / (M - 1) if math.isfinite(best_ms) else 64 * dp.block_floor_ms()
        ar_top = dp.max_allreduce_ms()
        lo = dp.block_floor_ms() if M == 1 else _smallest_feasible_cap(dp, dp.block_floor_ms(), top, ar_top,
                                                                             self._bisect_late)
        # Without an incumbent nothing rules out plans above ``top``: they stay bounded by fill x top only.
        boxes = self.boxes = CapBoxes(lo=lo, top=max(top, lo), ar_top=ar_top, fill=M - 1,
                                      open_top=math.isfinite(top) and not math.isfinite(best_ms))
        self.lam_max = best_ms if math.isfinite(best_ms) else 1e3 * max(top, 1.0)  # a price that settles any box
        first = self.new_point(top, boxes.ar_top)
        self.price(first, INF)  # converged: its DPs' plans are the first incumbents that shrink every box
        boxes.add_point(top, boxes.ar_top, first.best)
        while True:
            bound, box, runner_up = boxes.weakest_two(self.best_ms)
            target = self.best_ms * (1 - self.target_gap)
            if box is None or self.deadline() or bound >= target:
                return bound
            # Lift the weakest box just past the next one: its point's prices are refined only while that can
            # still pay (the cutting-plane model bounds what they can reach); else the box is split.
            level = target if LAZY_LIFT is None else min(target, runner_up + LAZY_LIFT * self.best_ms)
            pt = self.points.get((box[1], box[3]))
            if pt is not None and not pt.done and pt.model + boxes.floor(box) >= level:
                self.price(pt, level - boxes.floor(box))
                boxes.add_point(pt.cap, pt.ar_cap, pt.best)
                continue
            # A box too narrow for splits to lift it further: only a higher value at its caps can.
            if pt is not None and boxes.width(box) < min(BRANCH_WIDTH * self.best_ms, level - bound) \
                    and self.branch(pt, box, level):
                continue
            point = boxes.split(box)
            if point is None:
                return bound
            # The new point bounds the lower half of the split box: settled once it lifts that above the level.
            pt = self.new_point(*point)
            self.price(pt, level - boxes.floor(box))
            boxes.add_point(*point, pt.best)


def lagrange_bound(problem: Problem, *, incumbent_ms: float, time_budget_s: float,
                   target_gap: float = 1e-3, iterations: int = 25, max_dps: int | None = None,
                   plans: bool = True, workers: int = 1, within: Work | None = None) -> LagrangeResult:
    """A lower bound on ``F`` over every plan, and the best valid plan its relaxed answers gave.

    ``plans=False``: the bound alone (for a relaxed problem, e.g. ``bound.relax.merged_for_bound``, whose plans are
    not plans of the real one and must not become the incumbent that prunes the boxes). ``workers >= 2``:
    the last ``LOCAL_TAIL`` of the work goes to the local search from the best plan (``search.local``).
    ``time_budget_s``: nominal seconds of work (``search.budget``: each DP and each pricing charged), charged to
    ``within`` too when given.
    """
    work = Work.of(time_budget_s, within, "bound")
    local_s = LOCAL_TAIL * time_budget_s if plans and workers > 1 else 0.0
    dp_work = work.sub(time_budget_s - local_s)
    sink = RelaxedPlans(problem, incumbent_ms=incumbent_ms, work=dp_work, local_s=local_s) if plans else None
    search = LagrangeBound(problem, incumbent_ms=incumbent_ms, work=dp_work, target_gap=target_gap,
                           iterations=iterations, max_dps=max_dps, plans=sink)
    try:
        bound = search.run()
    finally:
        if sink is not None:
            sink.finish()
    return LagrangeResult(bound_ms=bound, placement=sink.best_plan if sink else None, step_ms=search.best_ms,
                          dps=search.dps, caps=len(search.boxes.points) if search.boxes else 0)


def program_bound_ms(problem: Problem, floor_ms: float = 0.0, *, cap_ms: float, within: Work,
                     rel_tol: float) -> float:
    """A bound on the cost of ``problem``'s compiled programs from :func:`lagrange_bound`, at least ``floor_ms``:
    bounded on a relaxation (``bound_problem``: every recomputation mix; like classes merged,
    ``relax.merged_for_bound``; links free, ``comm_free_for_bound``: the programs send without blocking), sought up
    to ``cap_ms`` (a plan of that cost is known) in what ``within`` has left: nothing sought, nothing charged, where
    that is under ``MIN_WORK_S``."""
    if within.left_s() < MIN_WORK_S:
        return floor_ms
    relaxed = bound_problem(problem)
    free = comm_free_for_bound(merged_for_bound(relaxed) or relaxed)
    found = lagrange_bound(free, incumbent_ms=cap_ms, time_budget_s=within.left_s(), target_gap=rel_tol,
                           plans=False, within=within)
    return max(floor_ms, found.bound_ms)


@dataclass(slots=True, kw_only=True)
class _Point:
    """A pair of caps being priced: the cutting-plane state kept so that pricing can resume there."""

    cap: float
    ar_cap: float
    lam: np.ndarray  # the prices of the next DP
    best: float = -INF  # the best dual value met (a lower bound on g at the caps)
    best_lam: np.ndarray | None = None
    model: float = INF  # the cutting-plane model's maximum: what the prices can still reach at most
    master: _KelleyMaster | None = None
    runs: int = 0
    done: bool = False
    allowed: np.ndarray | None = None  # a branch's leaf (``branching``): its classes (local classes x blocks)


class _KelleyMaster:
    """max_lam min_cuts (tau + lam . (used - n)) over ``0 <= lam <= lam_max``, one cut added at a time.

    One LP per box, grown by a row per DP: GLOP re-solves from its last basis, where rebuilding the model
    from every cut met cost more per iteration than a DP once the pool held hundreds of plans.
    """

    def __init__(self, cuts: list[Cut], count: np.ndarray, lam_max: float) -> None:
        self.count = count
        self.cuts: list[Cut] = []
        self.rows: list[pywraplp.Constraint] = []
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
        self.cuts.append(cut)
        self.rows.append(row)

    def weighted(self) -> list[tuple[float, Cut]]:
        """The cuts with their weights in the LP's dual: the mixture of sequences the prices balance."""
        if self.solver.Solve() != pywraplp.Solver.OPTIMAL:
            return []
        return [(abs(row.dual_value()), cut) for row, cut in zip(self.rows, self.cuts) if abs(row.dual_value()) > 1e-9]

    def solve(self) -> tuple[float, np.ndarray]:
        """(model value, prices); (-inf, zeros) when the LP is numerically stuck."""
        if self.solver.Solve() != pywraplp.Solver.OPTIMAL:
            return -INF, np.zeros(len(self.count))
        return self.z.solution_value(), np.array([v.solution_value() for v in self.lam])


def _smallest_feasible_cap(dp: SequenceDP | LazyDP, lo: float, hi: float, ar_cap: float,
                           late: Callable[[], bool] = lambda: False) -> float:
    """A cap below which no relaxed plan exists (so no plan at all): bisection, feasibility needs no prices;
    stopped once ``late()`` (a lower cap, still valid: a DP takes a fraction of a second on hundreds of devices)."""
    if not math.isfinite(hi) or dp.run(hi, np.zeros(dp.C), ar_cap) is None:
        return lo
    for _ in range(FEASIBILITY_STEPS):
        if late():
            break
        mid = 0.5 * (lo + hi)
        if dp.run(mid, np.zeros(dp.C), ar_cap) is None:
            lo = mid
        else:
            hi = mid
    return lo
