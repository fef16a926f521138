"""The search for one microbatch count's best plan under the closed form (``objective.evaluate``).

Steps 2-5 of the solve (``planner.solver.api``): the exact DP where it covers the whole space, else the
incumbents (one-stage plans, baselines, grids, the sequence search), the Lagrangian bound and its plans,
the local search, then CP-SAT hinted with the best plan so far.
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence

from planner.errors import InfeasiblePlanError
from planner.solver.bound.lagrange import lagrange_bound
from planner.solver.bound.relax import merged_for_bound
from planner.solver.cpsat.model import num_slots, solve_cpsat
from planner.solver.explain import precheck
from planner.solver.objective import (
    Placement,
    evaluate,
    simple_lower_bound_ms,
    violations,
)
from planner.solver.outcome import Outcome, Progress
from planner.solver.problem import Problem
from planner.solver.search import baselines as base
from planner.solver.search.budget import Work
from planner.solver.search.chain_dp import homogeneous_dp
from planner.solver.search.grid import grid_candidates
from planner.solver.search.local import improve
from planner.solver.search.sequences import search_sequences
from planner.solver.solution import StagePlacement
from planner.solver.warm import WarmStart, warm_placements

# Of each M's time budget, for the sequence search that seeds the bound and CP-SAT: small, as the bound's first
# DPs soon find far better plans than it does (tuning history: benchmarks/README.md).
HEURISTIC_SHARE = 0.05
# The uniform grids that seed the search get twice the sequence search's time, beside the count's budget (as their
# pricing): what they cost (by shape count, ~1 us to 8 ms a grid) never changes what the later steps get. On the
# count's budget, their honest charge (2026-12-06) left test_monotone_pools seed 13's "trusted + A100" part 0.049 s
# for its mixed-replication step where it needs 0.05 (2,122.1 ms against the smaller pool's 2,074.5).
GRID_BUDGET_FACTOR = 2.0
MODEL_SIZE_LIMIT = 4_000  # blocks x stage slots up to which the CP-SAT model covers every stage count
SLOT_CAP = 20  # slots of the smaller model beyond that: CP-SAT improves plans far better there
LAGRANGE_SHARE = 0.75  # of each M's time budget on large models, for the sequence-DP bound and its plans
# At most, for the local search from the best plan after it (``search.local``), before CP-SAT: per second the
# most productive step there (tuning history: benchmarks/README.md).
LOCAL_SHARE = 0.1
LAGRANGE_SMALL_S = 1.0  # at most this on models small enough for CP-SAT to prove optimality alone
CPSAT_PROVES_LIMIT = 600  # blocks x stage slots up to which CP-SAT proves optimality within a solve's budget
# Blocks x stage slots above which CP-SAT's last seconds go to the local search: at that size CP-SAT finds no
# plan within a solve's budget, where the local search keeps improving.
CPSAT_HOPELESS = 10_000


def _best(cands: Sequence[tuple[Placement, float, str]]) -> tuple[Placement | None, float, str]:
    best: tuple[Placement | None, float, str] = (None, math.inf, "none")
    for placement, step, how in cands:
        if step < best[1] - 1e-12:
            best = (placement, step, how)
    return best


def _incumbents(problem: Problem, budget_s: float, work: Work, seed: int) -> list[tuple[Placement, float, str]]:
    """One-stage plans, the baselines and the sequence search: valid plans with their step times. The ``dp``
    baseline's DP stops after ``budget_s`` nominal seconds of work, charged to ``work``; the grids after
    ``GRID_BUDGET_FACTOR`` times it (the best found by then), beside it."""
    deadline = work.sub(budget_s, "baselines")
    out = []
    for placement in base.single_stage_placements(problem):
        ev = evaluate(problem, placement)
        if not violations(problem, placement, ev):
            out.append((placement, ev.step_ms, "data-parallel"))
    for name in base.BASELINES:
        try:
            placement = base.baseline_placement(name, problem, deadline)
        except InfeasiblePlanError:
            continue
        ev = evaluate(problem, placement)
        if not violations(problem, placement, ev):
            out.append((placement, ev.step_ms, f"baseline:{name}"))
    # Every uniform pp x dp grid, the cheapest few also with their blocks split for their devices: the
    # search starts no worse than ppdp or a fixed shape would.
    for placement in grid_candidates(problem, deadline=work.side(GRID_BUDGET_FACTOR * budget_s, "grids"),
                                     priced=work.side(GRID_BUDGET_FACTOR * budget_s, "grids priced")):
        out.append((placement, evaluate(problem, placement).step_ms, "baseline:ppdp"))
    found = search_sequences(problem, time_budget_s=budget_s, seed=seed, within=work)
    if found is not None:
        out.append((found[0], found[1], "sequence-search"))
    return out


def _homogeneous_exact(problem: Problem) -> Placement | None:
    """The exact DP's plan when it covers the whole search space, else None.

    That is: one class of stage devices, nothing to verify, and no replication
    allowed (one replica choice). The DP then minimises ``F`` over every plan.
    """
    stage = [c for c in problem.classes if c.stage_capable]
    if len(stage) != 1:
        return None
    c, pol = stage[0], problem.policy
    if problem.replica_choices(c.index) != (1,) or (pol.enabled and not c.trusted):
        return None
    part = homogeneous_dp(problem, c.index, c.count)
    if part is None:
        return None
    M = problem.num_microbatches
    stages = tuple(StagePlacement(index=k, first_block=a, last_block=b, devices=(c.device_ids[k],),
                                  microbatches=(M,)) for k, (a, b) in enumerate(part.ranges))
    return Placement(stages=stages, verifiers=(), num_microbatches=M)


def search_count(problem: Problem, time_limit_s: float, workers: int, label: str, progress: Progress | None,
                 gap_tolerance: float, seen: list[Placement], warm: WarmStart | None = None, *,
                 within: Work | None = None, seed: int = 0, rivals: list[Placement] | None = None) -> Outcome:
    """The search for ``problem`` under the closed form, adding every valid plan it meets to ``seen`` and the
    grids it met (uniform and tapered, ``grid.grid_candidates``) to ``rivals`` too: the closed form misranks
    them, so the caller prices them all. A ``warm`` start (an old plan repaired, ``solver.warm``) joins the
    first incumbents. ``time_limit_s``: nominal seconds of work (``search.budget``), charged to ``within`` too;
    ``seed``: the randomised steps' seed."""
    start = time.perf_counter()
    work = Work.of(time_limit_s, within, "search")
    precheck(problem)
    exact = _homogeneous_exact(problem)
    if exact is not None:
        ev = evaluate(problem, exact)
        assert not violations(problem, exact, ev), "the homogeneous DP returned an invalid plan"
        if progress is not None:
            progress(label, ev.step_ms, ev.step_ms, time.perf_counter() - start)
        seen.append(exact)
        return Outcome(problem=problem, placement=exact, step_ms=ev.step_ms, bound_ms=ev.step_ms,
                       method="dp-exact", cpsat_status="SKIPPED", solve_s=time.perf_counter() - start)
    cands = _incumbents(problem, max(0.2, HEURISTIC_SHARE * time_limit_s), work, seed)
    cands += warm_placements(problem, warm) if warm is not None else []
    seen.extend(p for p, _, _ in cands)
    if rivals is not None:
        rivals.extend(p for p, _, how in cands if how == "baseline:ppdp")
    one_stage = min((s for p, s, _ in cands if p.num_stages == 1), default=math.inf)
    placement, step, how = _best(cands)
    if progress is not None and placement is not None:
        progress(label, step, None, time.perf_counter() - start)

    def report(obj: float | None, bound: float | None, elapsed: float) -> None:
        if progress is not None:
            progress(label, obj, None if bound is None else min(bound, one_stage), time.perf_counter() - start)

    lb_all = simple_lower_bound_ms(problem)  # valid for every plan of this M
    K_full = num_slots(problem)
    large = problem.num_blocks * K_full > MODEL_SIZE_LIMIT
    exhaustive = problem.num_blocks * K_full <= CPSAT_PROVES_LIMIT
    # The sequence DP's Lagrangian bound sees communication, which the fluid LP cannot; on small
    # models CP-SAT usually proves optimality by itself, so the DP gets only a short look there.
    lag_budget = min(LAGRANGE_SMALL_S, 0.1 * time_limit_s) if exhaustive else LAGRANGE_SHARE * time_limit_s
    # Many hosts of one device type make many classes, and the DP cubic in them: half of the time then
    # goes to the bound of the problem with like classes merged (a relaxation, valid for bounds only).
    coarse = None if exhaustive else merged_for_bound(problem)
    if coarse is not None:
        lb_all = max(lb_all, lagrange_bound(coarse, incumbent_ms=step, time_budget_s=lag_budget / 2,
                                            target_gap=gap_tolerance, plans=False, within=work).bound_ms)
        lag_budget /= 2
    lag = lagrange_bound(problem, incumbent_ms=step, time_budget_s=lag_budget, target_gap=gap_tolerance,
                         workers=workers, within=work)
    lb_all = max(lb_all, lag.bound_ms)
    if lag.placement is not None:
        seen.append(lag.placement)
    if lag.placement is not None and lag.step_ms < step - 1e-12:
        placement, step, how = lag.placement, lag.step_ms, "sequence-dp"
        report(step, None, 0.0)
    # Decomposition by stage count: the full model when it is small enough to build and search;
    # else a model with fewer slots that can still improve the incumbent (then its bound only
    # covers pipelines of at most K stages, so the reported bound falls back to the fluid LP).
    K = min(K_full, SLOT_CAP) if large else K_full
    hopeless = problem.num_blocks * K > CPSAT_HOPELESS  # CP-SAT's time goes to the local search instead

    def proven(step_ms: float) -> bool:  # within the tolerance of the bound: nothing left to search
        return step_ms - lb_all <= gap_tolerance * step_ms

    if placement is not None and not exhaustive and not proven(step):  # small models: CP-SAT proves it alone
        better = improve(problem, placement, step,
                         time_budget_s=work.left_s() if hopeless else LOCAL_SHARE * time_limit_s,
                         target_ms=lb_all / (1 - gap_tolerance), seed=seed, within=work)
        if better is not None:
            seen.append(better[0])
            placement, step, how = better[0], better[1], "local-search"
            report(step, None, 0.0)
        if hopeless and not proven(step):
            return Outcome(problem=problem, placement=placement, step_ms=step, bound_ms=min(lb_all, step),
                           method=how, cpsat_status="SKIPPED (model too large to improve the plan)",
                           solve_s=time.perf_counter() - start)
    hint = placement if placement is not None and placement.num_stages > 1 else None
    if K < K_full and (hint is None or hint.num_stages > K):
        # The slot model cannot hold the incumbent: seed it with the best plan that fits.
        found = search_sequences(problem, time_budget_s=max(0.2, HEURISTIC_SHARE * time_limit_s), max_stages=K,
                                 seed=seed, within=work)
        hint = found[0] if found is not None else None
    left = work.left_s()
    status, cp_bound = "SKIPPED", math.inf if K_full < 2 else 0.0
    if placement is not None and proven(step):
        return Outcome(problem=problem, placement=placement, step_ms=step, bound_ms=min(lb_all, step),
                       method=how, cpsat_status="SKIPPED (within the gap tolerance)",
                       solve_s=time.perf_counter() - start)
    if K >= 2 and left > 0.5 and (K == K_full or hint is not None):
        res = solve_cpsat(problem, time_limit_s=left, workers=workers, hint=hint, max_slots=K, progress=report,
                          gap_tolerance=gap_tolerance, seed=seed, within=work)
        status = res.status if K == K_full else f"{res.status} (<= {K} stages)"
        if K == K_full:
            cp_bound = res.bound_ms
        if res.placement is not None:
            ev = evaluate(problem, res.placement)
            bad = violations(problem, res.placement, ev)
            assert not bad, f"CP-SAT returned an invalid plan: {bad}"
            seen.append(res.placement)
            if ev.step_ms < step - 1e-12:
                placement, step, how = res.placement, ev.step_ms, "cpsat"
    bound = max(min(one_stage, cp_bound), lb_all)
    return Outcome(problem=problem, placement=placement, step_ms=step, bound_ms=min(bound, step),
                   method=how, cpsat_status=status, solve_s=time.perf_counter() - start)
