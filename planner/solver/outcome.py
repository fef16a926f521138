"""One microbatch count's result (:class:`Outcome`), and the :class:`Solution` a chosen one becomes."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

from planner.solver.audits import audit_notes, choose_audits
from planner.solver.codec_choice import choose_codecs
from planner.solver.idle import idle_reasons
from planner.solver.link_tests import keep_link_tests, lost_link_tests
from planner.solver.objective import Placement, price_program, program_memory
from planner.solver.problem import Problem
from planner.solver.search.stage_order import reorder
from planner.solver.shared_verifiers import split_shared
from planner.solver.solution import Solution, SolveReport, gap_of

# (label, objective ms or None, bound ms or None, elapsed s): called while solving.
Progress = Callable[[str, float | None, float | None, float], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """One M's result: the best plan found (or None), bounds, and what produced them.

    ``step_ms`` and ``bound_ms``: the search's closed form (``objective.evaluate``) of the plan and a bound on
    it; ``program_ms``: the cost of the plan's compiled programs (``objective.price_program``), the plan
    chosen among every valid plan the search met by it; ``valid_bound_ms``: a bound on that cost of any plan;
    ``bound_by``: the bound that set it (a key of ``bound.counts.TERMS``; empty: none ran).
    """

    problem: Problem
    placement: Placement | None
    step_ms: float
    bound_ms: float
    method: str
    cpsat_status: str
    solve_s: float
    program_ms: float = math.inf
    valid_bound_ms: float = 0.0
    bound_by: str = ""


def reordered(problem: Problem, solution: Solution) -> Solution | None:
    """``solution`` with its stage groups in the order that prices least (``search.stage_order``), or None
    when that is the order it has: a rival for the caller to simulate (a new order's price is a model too)."""
    stages = tuple(dataclasses.replace(st, in_flight=()) for st in solution.stages)
    placement = reorder(problem, Placement(stages=stages, verifiers=solution.verifiers,
                                           num_microbatches=solution.num_microbatches))
    if placement is None:
        return None
    r = solution.report
    outcome = Outcome(problem=problem, placement=placement, step_ms=math.inf, bound_ms=math.inf,
                      method="stage order", cpsat_status="-", solve_s=r.solve_s)
    return to_solution(outcome, r.bound_ms, r.notes, r.solve_s, f"{r.method}, stage groups reordered", r.status)


def shared(problem: Problem, solution: Solution) -> Solution | None:
    """``solution`` with the boundaries whose replicas pay to split over several verifiers split
    (``shared_verifiers``), or None where none pays: a rival for the caller to simulate (a price is a model)."""
    stages = tuple(dataclasses.replace(st, in_flight=()) for st in solution.stages)
    placement = Placement(stages=stages, verifiers=solution.verifiers, num_microbatches=solution.num_microbatches)
    split = split_shared(problem, placement)
    if split is placement:
        return None
    priced = price_program(problem, split)
    r = solution.report
    report = dataclasses.replace(r, method=f"{r.method}, boundaries' replicas split over verifiers",
                                 objective_ms=priced.step_ms, gap=gap_of(priced.step_ms, r.bound_ms),
                                 notes=r.notes + lost_link_tests(problem, split)[len(lost_link_tests(problem,
                                                                                                     placement)):])
    return dataclasses.replace(solution, stages=tuple(dataclasses.replace(st, in_flight=n) for st, n in
                                                      zip(stages, priced.in_flight)),
                               verifiers=split.verifiers, predicted_step_ms=priced.step_ms,
                               memory_bytes=program_memory(problem, split, priced.in_flight), report=report)


def ruled_out(problem: Problem) -> Outcome:
    return Outcome(problem=problem, placement=None, step_ms=math.inf, bound_ms=math.inf, method="precheck",
                   cpsat_status="INFEASIBLE", solve_s=0.0, valid_bound_ms=math.inf, bound_by="no plan fits")


def to_solution(outcome: Outcome, bound_ms: float | None, notes: tuple[str, ...], solve_s: float,
                method: str, status: str) -> Solution:
    assert outcome.placement is not None
    placement = choose_audits(outcome.problem,
                              choose_codecs(outcome.problem, keep_link_tests(outcome.problem, outcome.placement)))
    priced = price_program(outcome.problem, placement)
    notes = notes + idle_reasons(outcome.problem, placement, priced.step_ms) + \
        lost_link_tests(outcome.problem, placement) + audit_notes(outcome.problem, placement)
    report = SolveReport(method=method, status=status, objective_ms=priced.step_ms, bound_ms=bound_ms,
                         gap=gap_of(priced.step_ms, bound_ms),
                         solve_s=solve_s, notes=notes)
    stages = tuple(dataclasses.replace(st, in_flight=n, recompute=outcome.problem.tables(st.recompute).recompute)
                   for st, n in zip(placement.stages, priced.in_flight))
    return Solution(stages=stages, verifiers=placement.verifiers,
                    num_microbatches=placement.num_microbatches, schedule=outcome.problem.schedule,
                    predicted_step_ms=priced.step_ms,
                    memory_bytes=program_memory(outcome.problem, placement, priced.in_flight), report=report)
