"""Activation recomputation as the solver decides it: per stage, where memory binds.

A stage that recomputes keeps only each block's input per microbatch in flight and runs every block's
forward again in its backward (``torch.utils.checkpoint`` per block at run time). Under ``auto`` the
search runs on a problem whose every stage recomputes (``recompute_problem``) when no plan fits without
(``planner.solver.api``); its plan then stops recomputing on every stage whose devices hold the
activations anyway (``mix``), so only the stages where memory binds pay the second forward. Bounds of
that search use times without recomputation and the memory with it (``problem.bound_problem``): they hold for
every mix. (Both problems searched within one budget would halve each search, and recomputation costs
a second forward: it is searched only where nothing fits without it, and kept only where it must be.)
"""
from __future__ import annotations

import dataclasses

from planner.errors import InvalidInputError
from planner.solver.objective import Placement, price_program, violations
from planner.solver.problem import Problem, recompute_problem

RECOMPUTE_MODES: tuple[str, ...] = ("auto", "never", "always")


def variants(problem: Problem, mode: str) -> list[Problem]:
    """The problems to search first for one microbatch size under ``mode`` (``auto`` adds the recomputing
    one when this finds no plan)."""
    if mode not in RECOMPUTE_MODES:
        raise InvalidInputError(f"recompute mode {mode!r}", expected=" or ".join(RECOMPUTE_MODES),
                                fix="pass --recompute auto (the default), never or always")
    return [recompute_problem(problem)] if mode == "always" else [problem]


def mix(problem: Problem, placement: Placement) -> tuple[Placement, float]:
    """``placement`` (planned with every stage recomputing) with recomputation off on every stage that fits
    without it and gets cheaper, slowest stages first; and its program cost."""
    best = _explicit(problem, placement)
    best_ms = price_program(problem, best).step_ms
    if not problem.recompute:
        return best, best_ms
    base = problem.tables(False)
    order = sorted(range(best.num_stages), key=lambda k: -max(
        base.range_time_ms(best.stages[k].first_block, best.stages[k].last_block, problem.class_of(d))
        for d in best.stages[k].devices))
    for k in order:
        stages = list(best.stages)
        stages[k] = dataclasses.replace(stages[k], recompute=False)
        trial = dataclasses.replace(best, stages=tuple(stages))
        if violations(problem, trial):
            continue
        ms = price_program(problem, trial).step_ms
        if ms <= best_ms:
            best, best_ms = trial, ms
    return best, best_ms


def _explicit(problem: Problem, placement: Placement) -> Placement:
    """Every stage's choice spelt out (a stage planned without one takes the problem's)."""
    stages = tuple(dataclasses.replace(st, recompute=problem.tables(st.recompute).recompute)
                   for st in placement.stages)
    return dataclasses.replace(placement, stages=stages)
