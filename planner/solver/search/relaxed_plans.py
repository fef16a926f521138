"""Plans from a bound's relaxed answers: repaired, re-partitioned, priced; the best kept as the incumbent.

The Lagrangian bound (``bound.lagrange``) meets stage sequences that respect the
device counts only on average. Each is priced as it is where it fits, and its
class sequence, repaired to the counts, is re-partitioned (``seq_partition``)
and priced again, on the bound's thread, in at most a share of its work (``budget``:
counted, not timed, so the same plans are priced on a loaded machine); the latest plans
the share skipped are priced at the end. With two workers the bound's last share of work
goes to the local search (``local``) from the best plan.
"""
from __future__ import annotations

from collections import deque
from typing import Protocol

from planner.solver.objective import Placement, evaluate, even_split, violations
from planner.solver.problem import Problem
from planner.solver.search.budget import UNITS_PER_S, Work, partition_units
from planner.solver.search.chain_dp import Group
from planner.solver.search.local import improve
from planner.solver.search.seq_partition import sequence_placement
from planner.solver.solution import StagePlacement
from planner.solver.verifiers import assign_verifiers

LAST_PLANS = 4  # relaxed plans the time cap skipped that are priced anyway at the end (the latest)
PLAN_SHARE = 0.35  # of the bound's work, at most, spent turning relaxed answers into priced plans
PLAN_HEADSTART_S = 0.05  # nominal seconds of pricing allowed before the share applies (the first DPs' plans)
LOCAL_TAIL = 0.35  # of the bound's work, kept for the local search at the end (workers >= 2)


class RelaxedStages(Protocol):
    """What a relaxed answer must give: its stages as (first block, last block, class, replicas)."""

    stages: tuple[tuple[int, int, int, int], ...]


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


def as_placement(problem: Problem, stages: tuple[tuple[int, int, int, int], ...]) -> Placement | None:
    """The relaxed sequence as it is (devices from each class's pool, verifiers greedily), or None."""
    M = problem.num_microbatches
    pools = {c.index: list(c.device_ids) for c in problem.classes if c.stage_capable}
    placed = []
    for k, (s, e, c, r) in enumerate(stages):
        if len(pools[c]) < r:
            return None  # more devices of the class than there are
        devices = tuple(pools[c][:r])
        del pools[c][:r]
        placed.append(StagePlacement(index=k, first_block=s, last_block=e, devices=devices,
                                     microbatches=even_split(M, r)))
    verifiers = assign_verifiers(problem, tuple(placed), M)
    if verifiers is None:
        return None
    placement = Placement(stages=tuple(placed), verifiers=verifiers, num_microbatches=M)
    return None if violations(problem, placement) else placement


class RelaxedPlans:
    """The incumbent a bound improves as it runs: ``consider`` each relaxed answer, ``finish`` at the end.
    Pricing is charged to ``work`` (the bound's: the whole budget's work, where ``local_s`` of it is kept for the
    local search at the end)."""

    def __init__(self, problem: Problem, *, incumbent_ms: float, work: Work, local_s: float = 0.0) -> None:
        self.problem = problem
        self.best_plan: Placement | None = None
        self.best_ms = incumbent_ms
        self._work = work
        self._local_s = local_s
        self._tried: set[tuple[Group, ...]] = set()
        self._spent = 0.0  # pricing work: capped at PLAN_SHARE of the work spent so far
        # The DPs of the tightest boxes come last, and where the bound meets the optimum their plans are the
        # optimal ones: the latest the cap skipped are priced before the end.
        self._skipped: deque[RelaxedStages] = deque(maxlen=LAST_PLANS)

    def consider(self, relaxed: RelaxedStages) -> None:
        """Price the relaxed plan as it is, and its repaired class sequence re-partitioned (now or later)."""
        if self._spent > PLAN_SHARE * self._work.spent + PLAN_HEADSTART_S * UNITS_PER_S:
            self._skipped.append(relaxed)
            return
        self._price(relaxed)

    def finish(self) -> None:
        """Price the latest plans the cap skipped, then (``local_s``) the local search from the best plan."""
        for relaxed in self._skipped:
            self._price(relaxed)
        self._skipped.clear()
        if self._local_s > 0 and self.best_plan is not None:
            better = improve(self.problem, self.best_plan, self.best_ms, time_budget_s=self._local_s,
                             within=self._work)
            if better is not None and better[1] < self.best_ms - 1e-9:
                self.best_plan, self.best_ms = better

    def _charge(self, units: float) -> None:
        self._spent += units
        self._work.charge(units)

    def _price(self, relaxed: RelaxedStages) -> None:
        cands = []
        L = self.problem.num_blocks
        plan = as_placement(self.problem, relaxed.stages)
        self._charge(partition_units(L, len(relaxed.stages), exact=False))
        if plan is not None:
            cands.append((plan, evaluate(self.problem, plan).step_ms))
        groups = repair(self.problem, relaxed.stages)
        if groups is not None and groups not in self._tried:
            self._tried.add(groups)
            for exact in (False, True):
                got = sequence_placement(self.problem, groups, exact=exact)
                self._charge(partition_units(L, len(groups), exact=exact))
                if got is not None:
                    cands.append(got)
        for plan, step in cands:
            if step < self.best_ms - 1e-9:
                self.best_plan, self.best_ms = plan, step
