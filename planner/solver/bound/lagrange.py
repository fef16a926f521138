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
layer (``seqdp``, with the exact cap; ``lazydp`` runs a looser DP first). The
prices at each pair of caps come from Kelley's cutting planes (a small LP
over the plans met so far, whose stage times and device use bound the dual
function from above at every pair of caps they meet), warm started from the
nearest pair; they reach the relaxation's LP value in tens of DPs where a
subgradient ascent stalled far below it (48 blocks x 8 devices: within
0.02% of the optimum in 0.3 s, against 20% after 1600 DPs). Every relaxed plan met is repaired to the
device counts, re-partitioned (``seqpart``) and priced exactly; the best
valid one is returned with the bound.

Where a box is too narrow for splits to lift it and its prices have
converged, what holds it down is the relaxation itself (mixtures of
sequences that meet the device counts only on average); the box's caps then
get a tree that branches on the class holding one block (``branching``),
whose weakest leaf's dual value is the box's.
"""
from __future__ import annotations

import math
import time
from collections import deque
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
from planner.solver.bound.pricer import BackgroundPricer
from planner.solver.bound.sequence_dp import Cut, Relaxed, SequenceDP
from planner.solver.objective import Placement, evaluate
from planner.solver.problem import Problem
from planner.solver.search.chain_dp import Group
from planner.solver.search.local import improve
from planner.solver.search.seq_partition import sequence_placement

__all__ = ["LagrangeResult", "LazyDP", "Relaxed", "SequenceDP", "lagrange_bound", "layered_dp", "repair"]

INF = math.inf
FEASIBILITY_STEPS = 12  # bisection steps for the smallest bottleneck any relaxed plan meets
LAST_PLANS = 4  # relaxed plans the time cap skipped that are priced anyway at the end (the latest)
PLAN_SHARE = 0.35  # of the bound's time, at most, spent turning relaxed answers into priced plans
PRICER_BACKLOG = 64  # relaxed plans waiting for the pricing thread (workers >= 2), the oldest dropped past it
PRICER_DUTY = 0.5  # the share of the time the pricing thread works (it rests the rest, leaving the DPs a core)
# The last share of the bound's time, in which the pricing thread runs the local search (``localsearch``)
# from the best plan instead (workers >= 2).
LOCAL_TAIL = 0.35
KELLEY_TOL = 1e-4  # relative gap between the cutting-plane model and the best dual value that ends a cap
# A box's prices are refined until it is this share of the incumbent above the next weakest box, and resumed
# when it is the weakest again (None: until it reaches the target, or the prices converge). Off: 1e-3 gave a
# better bound per DP (200 blocks x 64 devices, 600 DPs: 8,784 against 8,734 ms), but it changes which
# relaxed plans are met, and at 1000 x 64, where pricing keeps up with about a quarter of them, the best plan
# of 22 s was worse in each of four runs (9,634-10,894 against 9,377-9,506 ms).
LAZY_LIFT: float | None = None
# Boxes narrower than this share of the incumbent (what splitting them can still add) branch on block
# classes instead (``branching``); wider ones split first, branching costing tens of DPs per child. 200 x 64,
# bound alone, 90 s: 8,854 / 8,868 / 8,891 / 8,865 ms at 3e-4 / 1e-3 / 5e-3 / 2e-2 (without: 8,839 at 60 s
# and at 300 s, where the plain relaxation stalls); at 22 s 8,810 at 5e-3, as without (8,830-8,839).
BRANCH_WIDTH = 5e-3


@dataclass(frozen=True, slots=True, kw_only=True)
class LagrangeResult:
    bound_ms: float
    placement: Placement | None
    step_ms: float
    dps: int
    caps: int


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
    full_dp = dp.base if isinstance(dp, LazyDP) else dp

    spent = [0.0]  # seconds pricing plans: capped at PLAN_SHARE of the time so far
    # The latest relaxed plans the cap skipped: the DPs of the tightest boxes come last, and where the
    # bound meets the optimum their plans are the optimal ones, so these are priced before returning.
    skipped: deque[Relaxed] = deque(maxlen=LAST_PLANS)

    pricer = BackgroundPricer(lambda r: _consider(r), backlog=PRICER_BACKLOG,
                              duty=PRICER_DUTY) if plans and workers > 1 else None

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

    def local_search() -> None:
        """The local search from the best plan until the bound's time ends (on the pricing thread, beside the
        DPs: the tail of the bound costs it a core it shares with pricing anyway)."""
        nonlocal best_plan, best_ms
        left = time_budget_s - (time.perf_counter() - start)
        if best_plan is not None and left > 0:
            better = improve(problem, best_plan, best_ms, time_budget_s=left)
            if better is not None and better[1] < best_ms - 1e-9:
                best_plan, best_ms = better

    lam_memo: list[tuple[tuple[float, float], np.ndarray]] = []
    pool: list[Cut] = []  # every relaxed plan met: cutting planes at every pair of caps it meets
    points: dict[tuple[float, float], _Point] = {}

    def price(pt: _Point, enough: float) -> None:
        """Kelley's cutting planes at the point's caps, resumed where they stopped, until the best dual value
        reaches ``enough``, the model and the best value meet (the LP value of the relaxation) or the time ends.

        The prices maximise the piecewise-linear model that the plans met so far give of the dual function;
        the DP at those prices adds a plan.
        """
        nonlocal dps
        run = dp if pt.allowed is None else dp.restricted(pt.allowed)  # a branch's leaf: its classes only
        while not pt.done:
            got = run.run(pt.cap, pt.lam, pt.ar_cap)
            dps += 1
            pt.runs += 1
            if got is None:  # no sequence meets the caps, whatever the prices
                pt.best, pt.done = INF, True
                break
            consider(got)
            for looser in getattr(run, "missed", ()):  # the looser DPs' plans: seeds for the incumbent too
                consider(looser)
            if got.value_ms > pt.best:
                pt.best, pt.best_lam = got.value_ms, pt.lam
            over = got.used - dp.count
            if (over <= 0).all() and abs(float(pt.lam @ over)) <= 1e-9 * max(1.0, abs(pt.best)):
                pt.done = True  # complementary slackness: g at these caps exactly
                break
            if pt.master is None:  # the plans met so far that meet these caps, then this DP's (one of its candidates)
                cuts = [c for c in pool if c.peak_ms <= pt.cap * (1 + 1e-12) and c.ar_ms <= pt.ar_cap * (1 + 1e-12)
                        and satisfies(c, pt.allowed, full_dp.SC)]
                pt.master = _KelleyMaster(cuts, dp.count, lam_max)
            cut = dp.cut(got)
            pool.append(cut)
            pt.master.add(cut)
            pt.model, pt.lam = pt.master.solve()
            pt.done = pt.model - pt.best <= KELLEY_TOL * max(1.0, abs(pt.best)) or pt.runs >= iterations
            if pt.best >= enough or deadline():
                break
        if pt.best_lam is not None and pt.allowed is None:
            lam_memo.append(((pt.cap, pt.ar_cap), pt.best_lam))

    trees: dict[tuple[float, float], ClassTree] = {}

    def branch(pt: _Point, box: tuple[float, float, float, float], level: float) -> bool:
        """Grow the class tree at the box's upper caps by one step (False: its weakest leaf cannot branch)."""
        tree = trees.setdefault((pt.cap, pt.ar_cap), ClassTree(pt))
        leaf = tree.weakest()
        enough = level - boxes.floor(box)
        if not leaf.done and leaf.model >= enough:
            price(leaf, enough)
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
                if deadline():
                    kid.best = -INF  # unpriced: bounds nothing
                    continue
                price(kid, enough)
        # Every box this point bounds has a floor of at least the lowest box's: leaves above the incumbent
        # less that floor bound nothing that could beat it.
        boxes.add_point(pt.cap, pt.ar_cap, tree.value(best_ms - boxes.least_floor()))
        return True

    def new_point(cap: float, ar_cap: float) -> _Point:
        lam = np.zeros(dp.C)
        if lam_memo:  # warm start from the nearest caps already priced
            lam = min(lam_memo, key=lambda m: abs(m[0][0] - cap) + abs(m[0][1] - ar_cap) / max(M - 1, 1))[1].copy()
        pt = points[(cap, ar_cap)] = _Point(cap=cap, ar_cap=ar_cap, lam=lam)
        return pt

    # Bottleneck caps above incumbent / (M - 1) cannot beat the incumbent (M = 1: no fill term, one cap).
    top = INF if M == 1 else best_ms / (M - 1) if math.isfinite(best_ms) else 64 * dp.block_floor_ms()
    ar_top = dp.max_allreduce_ms()
    lo = dp.block_floor_ms() if M == 1 else _smallest_feasible_cap(dp, dp.block_floor_ms(), top, ar_top)
    # Without an incumbent nothing rules out plans above ``top``: they stay bounded by fill x top only.
    boxes = CapBoxes(lo=lo, top=max(top, lo), ar_top=ar_top, fill=M - 1,
                     open_top=math.isfinite(top) and not math.isfinite(best_ms))
    lam_max = best_ms if math.isfinite(best_ms) else 1e3 * max(top, 1.0)  # a price that settles any box
    first = new_point(top, boxes.ar_top)
    price(first, INF)  # converged: its DPs' plans are the first incumbents that shrink every box
    boxes.add_point(top, boxes.ar_top, first.best)
    local_at = time_budget_s * (1 - LOCAL_TAIL)  # when the pricing thread turns to the local search
    while True:
        if pricer is not None and local_at is not None and time.perf_counter() - start > local_at:
            pricer.then(local_search)
            local_at = None
        bound, box, runner_up = boxes.weakest_two(best_ms)
        target = best_ms * (1 - target_gap)
        if box is None or deadline() or bound >= target:
            break
        # Lift the weakest box just past the next one: its point's prices are refined only while that can still
        # pay (the cutting-plane model bounds what they can reach); else the box is split.
        level = target if LAZY_LIFT is None else min(target, runner_up + LAZY_LIFT * best_ms)
        pt = points.get((box[1], box[3]))
        if pt is not None and not pt.done and pt.model + boxes.floor(box) >= level:
            price(pt, level - boxes.floor(box))
            boxes.add_point(pt.cap, pt.ar_cap, pt.best)
            continue
        # A box too narrow for splits to lift it further: only a higher value at its caps can.
        if pt is not None and boxes.width(box) < min(BRANCH_WIDTH * best_ms, level - bound) \
                and branch(pt, box, level):
            continue
        point = boxes.split(box)
        if point is None:
            break
        # The new point bounds the lower half of the split box: it is settled once it lifts that above the level.
        pt = new_point(*point)
        price(pt, level - boxes.floor(box))
        boxes.add_point(*point, pt.best)
    if pricer is not None:
        pricer.close(drain=LAST_PLANS)
    for relaxed in skipped:
        _consider(relaxed)
    return LagrangeResult(bound_ms=bound, placement=best_plan, step_ms=best_ms, dps=dps, caps=len(boxes.points))


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


def _smallest_feasible_cap(dp: SequenceDP | LazyDP, lo: float, hi: float, ar_cap: float) -> float:
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
