"""Kicks from a hill-climbed plan: an iterated local search on the cost of the compiled programs.

``polish`` stops at a plan no single move improves. Where the search leaves time unused (counts the bounds
dismiss, ``count_solve.beyond``), the best plan is kicked by a few random moves the climb does not make (two
stages' device groups swapped or a run of them reversed, with their block counts or without, or a cut moved by up
to ``SHIFT`` blocks) and climbed again; a better plan becomes the one kicked next. Why: on the Sailor-like pool the
plan's node groups in another order, re-cut, price 5% below it, and no single move reaches them (benchmarks/README,
twenty-second session). The draws are seeded: the same inputs and seed kick the same way.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from planner.solver.objective import Placement, violations
from planner.solver.problem import Problem
from planner.solver.search.budget import Work, program_units
from planner.solver.search.polish import polish, with_stages
from planner.solver.solution import StagePlacement

MOVES = 1  # random moves a kick makes
SHIFT = 3  # a kicked cut moves by up to this many blocks
LIMIT = 24  # kicks in a row that find nothing better end the search
ACCEPT = 0.01  # a climbed kick this much dearer than its start is kicked from next (plateaus left)


def kicked(problem: Problem, placement: Placement, ms: float, *, time_budget_s: float, within: Work | None = None,
           seed: int = 0, cuts_only: bool = False) -> tuple[Placement, float]:
    """The best plan kicks and climbs reach from ``placement`` (of program cost ``ms``) in ``time_budget_s``
    nominal seconds of work (charged to ``within`` too); ``cuts_only``: kicks move cuts only (a fixed shape)."""
    work = Work.of(time_budget_s, within, "kicks")
    rng = np.random.default_rng(seed)
    best, best_ms, misses = placement, ms, 0
    at, at_ms = placement, ms  # the plan kicked next: the best, or one within ``ACCEPT`` of where it was kicked from
    while misses < LIMIT and not work.passed():
        cand = at
        for _ in range(MOVES):
            cand = _kick(cand, rng, cuts_only)
        work.charge(program_units(cand.num_microbatches, cand.num_stages))
        if cand is at or violations(problem, cand):
            misses += 1
            continue
        got, got_ms = polish(problem, cand, time_budget_s=work.left_s(), cuts_only=cuts_only, within=work)
        misses += 1
        if got_ms < best_ms * (1 - 1e-9):
            best, best_ms, misses = got, got_ms, 0
        if got_ms < at_ms * (1 + ACCEPT):
            at, at_ms = got, got_ms
    return best, best_ms


def _kick(placement: Placement, rng: np.random.Generator, cuts_only: bool) -> Placement:
    stages = list(placement.stages)
    S = len(stages)
    if S < 2:
        return placement
    if cuts_only or rng.random() < 1 / 3:
        shift = int(rng.integers(1, SHIFT + 1)) * int(rng.choice((-1, 1)))
        return _shifted(placement, stages, int(rng.integers(S - 1)), shift)
    a, b = sorted(int(x) for x in rng.choice(S, size=2, replace=False))
    sizes = [st.last_block - st.first_block + 1 for st in stages]
    groups = [(st.devices, st.microbatches) for st in stages]
    order = list(range(S))
    if rng.random() < 0.5:  # a run of stages reversed
        order[a:b + 1] = order[a:b + 1][::-1]
    else:  # two stages swapped
        order[a], order[b] = b, a
    groups = [groups[i] for i in order]
    if rng.random() < 0.5:  # the block counts go with the device groups
        sizes = [sizes[i] for i in order]
    first, out = 0, []
    for st, n, (devices, shares) in zip(stages, sizes, groups):
        out.append(dataclasses.replace(st, first_block=first, last_block=first + n - 1, devices=devices,
                                       microbatches=shares, in_flight=()))
        first += n
    return with_stages(placement, out)


def _shifted(placement: Placement, stages: list[StagePlacement], k: int, shift: int) -> Placement:
    """Cut ``k`` (after stage ``k``) moved by ``shift`` blocks, where both stages keep a block (else unchanged)."""
    a, b = stages[k], stages[k + 1]
    cut = a.last_block + shift
    if not a.first_block <= cut < b.last_block:
        return placement
    stages[k:k + 2] = [dataclasses.replace(a, last_block=cut, in_flight=()),
                       dataclasses.replace(b, first_block=cut + 1, in_flight=())]
    return with_stages(placement, stages)
