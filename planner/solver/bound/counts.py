"""The bound over microbatch counts raised after the search, in a budget of its own (issue 36, item 7).

The solve's bound is the least of its counts' bounds (``api._solve``: each count's bounds every plan of that
count), and a count's fill bound (``bound.fill``) runs only where the count's own work can pay for it: on DT-FM's
regional pool at 60 s the plan's count (M = 64) bounds at 2,189 ms but another count could not afford its test, so
a weaker 1,422 entered the least. Paying it from a count's work takes it from its plan (the mixed-replication
search after it: 2,760 -> 3,125 ms there). Here the counts are raised once every plan is known, from a budget
that is not the search's:

* only the count whose bound is least can raise the least, so the counts are taken in that order, each once, and
  it stops when the least count has been raised already, or sits at the cap;
* the cap is the best plan's cost (``incumbent_ms``): the least over counts is at most the best plan's own count's
  bound, which is at most that plan's cost, so no count's bound need rise above it; a count whose cheap bound is
  already there is never tested, and one whose plans all cost more is dismissed in one test (``fill_bound_ms``'s
  ``cap_ms``);
* each count's raised bound is ``fill_bound_ms`` (every count as before), then, in what those tests leave of the
  budget, ``tail_bound_ms`` above it (``bound.tails``: the pipeline's depth and an early stage's all-reduce behind
  the deepest stream; DT-FM regional at 60 s: 2,188 -> 2,340 ms with fill's terms of 2026-12-07), then, in what
  is left, the Lagrangian bound (``lagrange.program_bound_ms``, as ``count_solve`` runs it where its count's work
  is not spent: the README's main job at 20 s, M = 16, whose climb spends all of it: 635.9 -> 763.8 ms); each
  valid for every plan of its problem, so their maximum is and the least over counts stays valid, bisected to
  ``REL_TOL`` / ``TAIL_REL_TOL`` (the infeasible end: valid at any width), never above its own plan's cost (as
  ``count_solve`` caps it).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from planner.solver.bound.fill import fill_bound_ms
from planner.solver.bound.lagrange import program_bound_ms
from planner.solver.bound.tails import tail_bound_ms
from planner.solver.problem import Problem
from planner.solver.search.budget import Work

# The bisection's width here: a count's bound at most 0.1% under its fill bound, in ~12 tests where 1e-5 takes ~18.
REL_TOL = 1e-3
# The tail bound's (``bound.tails``): ~6 tests from the fill bound to the plan on DT-FM (66 ms of CPU each).
TAIL_REL_TOL = 4e-3
# The Lagrangian bound's target gap (``lagrange.program_bound_ms``), as a count's own solve seeks it.
LAGRANGE_REL_TOL = 1e-3


# What can set a count's bound on the programs' cost, as the report names it (``api._solve``'s notes).
TERMS = {"fluid": "the fluid LP (every device busy at its own speed, links free)",
         "search": "the search's own bound",
         "links": "the links between islands (bound/links)",
         "islands": "compute on the islands of fast links a plan uses (bound/links)",
         "memory": "stage 0's in-flight window across slow links, or no island holding the model (bound/links)",
         "replicas": "each stage's passes against its replicas' all-reduce (bound/replicas)",
         "lagrange": "the Lagrangian bound (each stage's passes and checks, links free)",
         "fill": "each replica's fill at its own speed (bound/fill)",
         "tails": "the pipeline's depth and the all-reduces behind it (bound/tails)",
         "no plan fits": "no plan of this count fits"}


@dataclass(frozen=True, slots=True)
class CountBound:
    """One count's problem, the bound it reached in its own solve, its plan's cost (inf: no plan) and the term
    that set its bound (a key of ``TERMS``)."""

    problem: Problem
    bound_ms: float
    program_ms: float = math.inf
    by: str = ""


def raised_bounds(counts: Sequence[CountBound], incumbent_ms: float, within: Work) -> list[float]:
    """Each count's bound as :func:`raised_with_terms` raises it."""
    return [ms for ms, _ in raised_with_terms(counts, incumbent_ms, within)]


def raised_with_terms(counts: Sequence[CountBound], incumbent_ms: float,
                      within: Work) -> list[tuple[float, str]]:
    """Per count (in order), its bound raised by the fill bound, then by the tail bound, then by the Lagrangian
    bound, where that can raise the least over counts (the module docstring); ``within``: the budget the tests are
    charged to (a test it cannot afford is skipped: that count keeps its bound, and the least is then settled).
    Each takes what the ones before it leave, so they run as they did without it. With each bound, the term that
    set it (a key of ``TERMS``: the count's own where none raised it)."""
    bounds = [min(c.bound_ms, c.program_ms) for c in counts]
    by = [c.by for c in counts]
    for name, raise_by, tol in (("fill", fill_bound_ms, REL_TOL), ("tails", tail_bound_ms, TAIL_REL_TOL),
                                ("lagrange", program_bound_ms, LAGRANGE_REL_TOL)):
        for k in _raise(counts, bounds, incumbent_ms, within, raise_by, tol):
            by[k] = name
    return list(zip(bounds, by))


def _raise(counts: Sequence[CountBound], bounds: list[float], incumbent_ms: float, within: Work,
           raise_by: Callable[..., float], tol: float) -> list[int]:
    """``bounds`` raised in place by ``raise_by`` (a valid bound of a count's problem above a floor, at most a cap),
    the least count first, each once, until the least was tried or sits at the cap; the counts it raised."""
    tried: set[int] = set()
    lifted: list[int] = []
    while bounds:
        k = min(range(len(bounds)), key=lambda i: bounds[i])
        cap = min(incumbent_ms, counts[k].program_ms)
        if k in tried or bounds[k] >= cap * (1 - 1e-9) or within.passed():
            break
        tried.add(k)
        raised = raise_by(counts[k].problem, bounds[k], within=within, cap_ms=cap, rel_tol=tol)
        if raised > bounds[k]:
            lifted.append(k)
        bounds[k] = min(max(bounds[k], raised), counts[k].program_ms)  # not raised: still least, and tried
    return lifted
