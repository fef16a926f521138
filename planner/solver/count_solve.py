"""One microbatch count's plan, and the best count's finished.

:func:`solve_count`: the search (``count_search``) or the grids of a fixed shape, then, of every valid plan
met, the one whose compiled programs cost least (``objective.price_program``), hill-climbed on that cost
(``polish``), its stages' recomputation mixed (``recompute.mix``), and that cost bounded with free links.
:func:`polish_best`: the best count's plan hill-climbed further in the time the other counts left unused.
"""
from __future__ import annotations

import dataclasses
import time

from planner.solver import recompute
from planner.solver.bound.lagrange import lagrange_bound
from planner.solver.bound.relax import comm_free_for_bound, merged_for_bound
from planner.solver.count_search import search_count
from planner.solver.explain import precheck
from planner.solver.objective import evaluate, price_program, simple_lower_bound_ms
from planner.solver.outcome import Outcome, Progress
from planner.solver.problem import Problem
from planner.solver.search.budget import Work
from planner.solver.search.grid import cheapest, shaped
from planner.solver.search.polish import polish
from planner.solver.warm import WarmStart

# Of each M's time budget, held back to hill-climb on the cost of the compiled programs (``polish``: the
# objective itself; on DT-FM's spot case it needs ~2 s of a 7 s share to converge) and bound that cost (the
# search's bounds are on its closed form, which prices sends as busy time: ``bound.relax.comm_free_for_bound``).
VALID_BOUND_SHARE = 0.3
POLISH_SHARE = 2 / 3  # of the time held back


def solve_count(problem: Problem, time_limit_s: float, workers: int, label: str,
                progress: Progress | None, gap_tolerance: float,
                shape: tuple[int | None, int | None] = (None, None), warm: WarmStart | None = None, *,
                within: Work | None = None, seed: int = 0) -> Outcome:
    """Search (``search_count``), then keep the plan whose compiled programs cost least among every valid plan the
    search met, and bound that cost (``bound.relax.comm_free_for_bound``) in the time held back for it. With a
    ``shape`` (stages, replicas per stage) the plans are the grids of that shape (``grid.shaped``).
    ``time_limit_s``: nominal seconds of work (``search.budget``), charged to ``within`` too."""
    start = time.perf_counter()
    work = Work.of(time_limit_s, within, "search")
    relaxed = recompute.bound_problem(problem)  # bounds every mix of stages with and without recompute
    if shape != (None, None):
        precheck(problem)
        placement = shaped(problem, stages=shape[0], replicas=shape[1], time_budget_s=time_limit_s / 2, within=work)
        found = Outcome(problem=problem, placement=placement, step_ms=evaluate(problem, placement).step_ms,
                        bound_ms=0.0, method=f"grid {shape[0] or 'any'} x {shape[1] or 'any'}",
                        cpsat_status="SKIPPED (fixed shape)", solve_s=0.0)
        seen = [placement]
    else:
        seen = []
        found = search_count(problem, (1 - VALID_BOUND_SHARE) * time_limit_s, workers, label, progress, gap_tolerance,
                             seen, warm, within=work, seed=seed)
    if found.placement is None:
        return dataclasses.replace(found, valid_bound_ms=simple_lower_bound_ms(relaxed))
    pick = cheapest(problem, seen + [found.placement])[0]
    program_ms = price_program(problem, pick).step_ms
    placement, polished_ms = polish(problem, pick, time_budget_s=max(0.05, POLISH_SHARE * work.left_s()),
                                    cuts_only=shape != (None, None), within=work)
    how = found.method if pick is found.placement else f"{found.method}, repriced"
    if polished_ms < program_ms:
        program_ms, how = polished_ms, f"{how}, polished"
    placement, program_ms = recompute.mix(problem, placement)
    # The search's own bound holds for its problem; with recomputation, only the relaxation's hold for a mix.
    valid = max(simple_lower_bound_ms(relaxed), found.valid_bound_ms if relaxed is problem else 0.0)
    left = work.left_s()
    if program_ms - valid > gap_tolerance * program_ms and left > 0.05:
        free = comm_free_for_bound(merged_for_bound(relaxed) or relaxed)
        valid = max(valid, lagrange_bound(free, incumbent_ms=program_ms, time_budget_s=left, target_gap=gap_tolerance,
                                          plans=False, within=work).bound_ms)
    return dataclasses.replace(found, placement=placement, method=how, program_ms=program_ms,
                               valid_bound_ms=min(valid, program_ms), solve_s=time.perf_counter() - start)


def polish_best(best: Outcome, left_s: float, *, cuts_only: bool, within: Work | None = None) -> Outcome:
    """``best`` hill-climbed further in the time the microbatch counts left unused (those ruled out or proven
    early): each count's own hill-climb gets a small share, and the best count is where it pays."""
    if left_s <= 0.1:
        return best
    placement, ms = polish(best.problem, best.placement, time_budget_s=left_s, cuts_only=cuts_only, within=within)
    if ms >= best.program_ms:
        return best
    how = best.method if best.method.endswith("polished") else f"{best.method}, polished"
    return dataclasses.replace(best, placement=placement, program_ms=ms, method=how,
                               valid_bound_ms=min(best.valid_bound_ms, ms))
