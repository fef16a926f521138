"""Verifier placements that keep the link and residual tests, and what a plan loses without them.

A monitor fits a linear surrogate from an untrusted stage's input to its output (the ``link`` test and the
``residual`` test built on it) only when one verifier sees both: the boundary before the stage and the
boundary after it (for gradients the other way round). They are the tests that catch damping and outputs of
other data; a plan whose two sides of an untrusted stage sit on different verifiers keeps only the weaker
per-tensor tests. Every returned plan, the solver's and each baseline's, passes through
:func:`keep_link_tests`: its verifiers are placed again a window at a time
(``verifiers.assign_verifiers(link=...)``, one verifier per window, then shorter pieces) and the
placement keeping the most link tests is kept unless it costs more than the policy's ``link_test_cost``
share of the step (priced by the program cost, as every plan is).
"""
from __future__ import annotations

import dataclasses

from planner.solver.objective import Placement, evaluate, price_program, violations
from planner.solver.problem import Problem
from planner.solver.verifiers import assign_verifiers, link_windows


def keep_link_tests(problem: Problem, placement: Placement) -> Placement:
    """``placement`` with its verifiers placed to keep every untrusted stage's link tests, where that is
    allowed and costs at most the policy's ``link_test_cost`` share more step time; else ``placement``."""
    lost = len(lost_link_tests(problem, placement))
    if not lost:
        return placement
    limit = (1 + problem.policy.link_test_cost) * price_program(problem, placement).step_ms
    best: tuple[int, float, Placement] | None = None
    longest = max(len(w) for w in link_windows(problem, placement.stages))
    for size in range(longest, 1, -1):  # one verifier per window first, then shorter pieces
        verifiers = assign_verifiers(problem, placement.stages, placement.num_microbatches, link=size)
        if verifiers is None:
            continue
        linked = dataclasses.replace(placement, verifiers=verifiers)
        if violations(problem, linked, evaluate(problem, linked)):
            continue
        ms, left = price_program(problem, linked).step_ms, len(lost_link_tests(problem, linked))
        if ms <= limit and left < lost and (best is None or (left, ms) < best[:2]):
            best = (left, ms, linked)
    return placement if best is None else best[2]


def lost_link_tests(problem: Problem, placement: Placement) -> tuple[str, ...]:
    """One line per untrusted stage whose outputs lose the link and residual tests, saying why."""
    out = []
    for window in link_windows(problem, placement.stages):
        for b in window[1:]:  # stage b sits between boundaries b-1 and b
            before, after = placement.verifier_of(b - 1), placement.verifier_of(b)
            where = f"boundary {b - 1} on {before.device if before else 'no verifier'}, " \
                    f"boundary {b} on {after.device if after else 'no verifier'}"
            if _split(placement, b - 1) or _split(placement, b):
                out.append(f"stage {b}: no link or residual test on some replicas' outputs (the replicas of "
                           f"boundary {b - 1} or {b} are split over several verifiers)")
                continue
            if before is None or after is None or before.device != after.device:
                out.append(f"stage {b}: no link or residual test on its outputs ({where}); a shift of their "
                           "shape is only an alert there, never evidence for a ban, and outputs that keep it (stale, "
                           "adaptive) pass unseen")
                continue
            missing = [d for d, v in (("act", before), ("grad", after)) if d not in v.directions
                       and (d == "act" or problem.policy.check_gradients)]
            if missing:
                out.append(f"stage {b}: no link or residual test on its {' and '.join(missing)} output "
                           f"(its input is not copied to {after.device})")
    return tuple(out)


def _split(placement: Placement, boundary: int) -> bool:
    return sum(v.boundary == boundary for v in placement.verifiers) > 1
