"""Exhaustive enumeration of the solver's search space for tiny instances (<= 8 blocks, <= 4 devices).

Written from the search-space description in ``planner/solver/cpsat.py``, not
from the model: every stage count, every ordered choice of device groups (a
group = ``r`` devices of one class, any ``r``), every contiguous partition and
every allowed verifier site per checked boundary; each candidate is priced
with ``objective.evaluate`` (the search's closed form) or, with ``program=True``,
``objective.price_program`` (the cost of its compiled programs), and kept if
``objective.violations`` is empty.
"""
from __future__ import annotations

import itertools
import math

from planner.solver.objective import (
    Placement,
    evaluate,
    even_split,
    price_program,
    required_directions,
    violations,
)
from planner.solver.problem import Problem
from planner.solver.solution import StagePlacement, VerifierPlacement


def _sequences(problem: Problem, length: int, left: dict[int, int]):
    if length == 0:
        yield ()
        return
    M = problem.num_microbatches
    for c, n in left.items():
        cap = min(n, M, problem.max_replicas or M)
        for r in range(1, cap + 1):
            left[c] -= r
            for rest in _sequences(problem, length - 1, left):
                yield ((c, r),) + rest
            left[c] += r


def _sites(problem: Problem, stages: tuple[StagePlacement, ...], b: int, need: tuple[str, ...]) -> list[str]:
    pol = problem.policy
    S = len(stages)
    cand: list[str] = []
    if pol.verifier_placement in ("any", "stage"):
        for k in {b, b + 1, 0, S - 1}:
            if len(stages[k].devices) == 1:
                cand.append(stages[k].devices[0])
    if pol.verifier_placement in ("any", "cpu"):
        cand += [d for c in problem.classes if c.verifier_host for d in c.device_ids]
    senders = []
    if "act" in need:
        senders += stages[b].devices
    if "grad" in need:
        senders += stages[b + 1].devices
    sender_domains = {problem.classes[problem.class_of(s)].domain for s in senders}
    out = []
    for d in sorted(set(cand)):
        c = problem.classes[problem.class_of(d)]
        if c.trusted and not (c.domain is not None and c.domain in sender_domains):
            out.append(d)
    return out


def brute_force(problem: Problem, *, program: bool = False) -> tuple[float, Placement | None]:
    """(best iteration time, its placement) over the whole search space; (inf, None) if none is valid."""
    L, M = problem.num_blocks, problem.num_microbatches
    counts = {c.index: c.count for c in problem.classes if c.stage_capable}
    best: tuple[float, Placement | None] = (math.inf, None)
    for S in range(1, min(L, sum(counts.values())) + 1):
        for seq in _sequences(problem, S, dict(counts)):
            free = {c: list(problem.classes[c].device_ids) for c in counts}
            groups = []
            for c, r in seq:
                groups.append((tuple(free[c][:r]), r))
                del free[c][:r]
            for cuts in itertools.combinations(range(1, L), S - 1):
                bounds = (0,) + cuts + (L,)
                stages = tuple(StagePlacement(index=k, first_block=bounds[k], last_block=bounds[k + 1] - 1,
                                              devices=devs, microbatches=even_split(M, r))
                               for k, (devs, r) in enumerate(groups))
                checked = [(b, required_directions(problem, stages, b)) for b in range(S - 1)]
                checked = [(b, need) for b, need in checked if need]
                options = [_sites(problem, stages, b, need) for b, need in checked]
                for picks in itertools.product(*options):
                    verifiers = tuple(VerifierPlacement(boundary=b, device=d, directions=need)
                                      for (b, need), d in zip(checked, picks))
                    placement = Placement(stages=stages, verifiers=verifiers, num_microbatches=M)
                    ev = evaluate(problem, placement)
                    step = price_program(problem, placement).step_ms if program else ev.step_ms
                    if step < best[0] and not violations(problem, placement, ev):
                        best = (step, placement)
    return best
