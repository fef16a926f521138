"""Hill-climbing on the cost of the compiled programs, from the best plan the search found.

The search's DPs and CP-SAT optimise the closed form ``objective.evaluate``;
where it and the programs' cost (``objective.price_program``) disagree, the
plan they return can sit a few steps from a cheaper program (fewer replicas
where the pipeline's fill dominates, a cut moved by a block). Neighbours: a
cut moved by one block either way, a stage's blocks shifted by one (two cuts
moved together: on DT-FM's spot case no single cut move improves a plan 1.6%
dearer than this reaches), two neighbouring stages merged on either's devices
(their boundary's verifier dropped), one replica fewer on a stage, one more
from the free devices of its class. Each valid neighbour is priced; the best
improvement is taken until none improves or the time is up. Where none does,
the verifiers are moved and split on the same price
(``shared_verifiers.place_on_programs``: the greedy placement's closed form
can leave a trusted stage device checking three boundaries while the other
checks one) and the climb goes on from there if that helped.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from planner.solver.objective import Placement, boundary_senders, even_split, price_program, violations
from planner.solver.problem import Problem
from planner.solver.search.budget import Work, program_units
from planner.solver.shared_verifiers import place_on_programs
from planner.solver.solution import StagePlacement


def _with_stages(placement: Placement, stages: list[StagePlacement]) -> Placement:
    return _live(dataclasses.replace(placement, stages=tuple(stages)))


def _live(placement: Placement) -> Placement:
    """``placement`` with each verifier's named senders cut to those its boundary still has (a replica fewer,
    a stage merged onto its neighbour's devices) and a verifier left with none dropped: it would check nothing
    (the default cluster's gpt-medium at 60 s priced such a verifier and failed)."""
    stages, kept = placement.stages, []
    for v in placement.verifiers:
        if v.senders:
            at = set(boundary_senders(stages, v.boundary, v.directions))
            v = dataclasses.replace(v, senders=tuple(d for d in v.senders if d in at))
            if not v.senders:
                continue
        kept.append(v)
    return dataclasses.replace(placement, verifiers=tuple(kept))


def _neighbours(problem: Problem, placement: Placement, cuts_only: bool) -> Iterator[Placement]:
    stages, M = list(placement.stages), placement.num_microbatches
    for k in range(len(stages) - 1):  # a cut moved by one block
        a, b = stages[k], stages[k + 1]
        for shift in (-1, 1):
            cut = a.last_block + shift
            if a.first_block <= cut < b.last_block:
                moved = stages[:k] + [dataclasses.replace(a, last_block=cut),
                                      dataclasses.replace(b, first_block=cut + 1)] + stages[k + 2:]
                yield _with_stages(placement, moved)
    for k in range(1, len(stages) - 1):  # a stage's blocks shifted by one: its two cuts moved together
        a, st, b = stages[k - 1], stages[k], stages[k + 1]
        for shift in (-1, 1):
            if a.first_block <= a.last_block + shift and st.last_block + shift < b.last_block:
                moved = stages[:k - 1] + [dataclasses.replace(a, last_block=a.last_block + shift),
                                          dataclasses.replace(st, first_block=st.first_block + shift,
                                                              last_block=st.last_block + shift),
                                          dataclasses.replace(b, first_block=b.first_block + shift)] + stages[k + 2:]
                yield _with_stages(placement, moved)
    if cuts_only:
        return
    for k in range(len(stages) - 1):  # two stages merged on either's devices
        yield from _merged(placement, k)
    used = {d for st in stages for d in st.devices} | {v.device for v in placement.verifiers}
    for k, st in enumerate(stages):
        r = len(st.devices)
        if r > 1:  # one replica fewer
            fewer = dataclasses.replace(st, devices=st.devices[:-1], microbatches=even_split(M, r - 1), in_flight=())
            yield _with_stages(placement, stages[:k] + [fewer] + stages[k + 1:])
        free = [d for d in problem.classes[problem.class_of(st.devices[0])].device_ids if d not in used]
        if free and r < M:  # one more, of the stage's class
            more = dataclasses.replace(st, devices=st.devices + (free[0],), microbatches=even_split(M, r + 1),
                                       in_flight=())
            yield _with_stages(placement, stages[:k] + [more] + stages[k + 1:])


def _merged(placement: Placement, k: int) -> Iterator[Placement]:
    stages = placement.stages
    a, b = stages[k], stages[k + 1]
    verifiers = tuple(dataclasses.replace(v, boundary=v.boundary - (v.boundary > k))
                      for v in placement.verifiers if v.boundary != k)
    for keep in (a, b):
        merged = dataclasses.replace(keep, first_block=a.first_block, last_block=b.last_block, in_flight=())
        rest = stages[:k] + (merged,) + stages[k + 2:]
        yield _live(dataclasses.replace(placement, verifiers=verifiers,
                                        stages=tuple(dataclasses.replace(st, index=i) for i, st in enumerate(rest))))


def polish(problem: Problem, placement: Placement, *, time_budget_s: float, cuts_only: bool = False,
           within: Work | None = None, units: Callable[[Placement], float] | None = None) -> tuple[Placement, float]:
    """The best plan hill-climbing reaches from ``placement`` within ``time_budget_s`` nominal seconds of work
    (``budget``; charged to ``within`` too), and its program cost (``cuts_only``: keep the stages and their
    devices, move only the cuts; ``units``: a pricing's charge, by default ``program_units``)."""
    work = Work.of(time_budget_s, within, "polish")
    cost = units or (lambda p: program_units(p.num_microbatches, p.num_stages))
    best, best_ms = placement, price_program(problem, placement).step_ms
    work.charge(cost(placement))
    improved = True
    while improved and not work.passed():
        improved = False
        for cand in _neighbours(problem, best, cuts_only):
            if work.passed():
                break
            work.charge(cost(cand))
            if violations(problem, cand):
                continue
            ms = price_program(problem, cand).step_ms
            if ms < best_ms * (1 - 1e-9):
                best, best_ms, improved = cand, ms, True
        if not improved and not cuts_only and not work.passed():
            placed, ms = place_on_programs(problem, best, within=work)
            if ms < best_ms * (1 - 1e-9):
                best, best_ms, improved = placed, ms, True
    return best, best_ms
