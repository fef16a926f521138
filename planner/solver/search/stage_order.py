"""The order of a plan's stage groups across regions and trust domains (DT-FM's path search, on our cost).

A plan's stages keep their block ranges; which device group (a stage's replicas) runs which range is
permuted. An exact DP over subsets of groups (``2^S S^2``; up to ``MAX_STAGES`` stages) finds the order whose
bottleneck is least: per position the group's compute for its share of the step, and the wire time of the
boundary before it over the slowest link between the two groups (the messages spread over the replica
pairs). End positions take only all-trusted groups where the policy keeps the ends trusted. The DP's order
is then priced exactly (``objective.price_program``, verifiers placed again) and kept only if ``MARGIN`` cheaper.
"""
from __future__ import annotations

import dataclasses
import math

from planner.solver.objective import Placement, price_program, violations
from planner.solver.problem import Problem
from planner.solver.solution import StagePlacement
from planner.solver.verifiers import assign_verifiers

MAX_STAGES = 12
# A reorder is kept only when it prices this much lower: the cost of a new order is a model too (within a few
# percent of its simulation), so a smaller gain may be none.
MARGIN = 0.02


def _compute_ms(problem: Problem, st: StagePlacement, group: StagePlacement) -> float:
    tables = problem.tables(st.recompute)
    return max(m * tables.range_time_ms(st.first_block, st.last_block, problem.class_of(d))
               for d, m in zip(group.devices, group.microbatches))


def _wire_ms(problem: Problem, nbytes: float, a: StagePlacement, b: StagePlacement, M: int) -> float:
    one_a = {problem.class_of(d): d for d in a.devices}.values()  # the link depends on hosts: sample per class
    one_b = {problem.class_of(d): d for d in b.devices}.values()
    slowest = min(problem.link(x, y).bytes_per_s for x in one_a for y in one_b)
    return 1e3 * M * nbytes / slowest / max(1, min(len(a.devices), len(b.devices)))


def best_order(problem: Problem, stages: tuple[StagePlacement, ...]) -> tuple[int, ...] | None:
    """The group order (``order[k]``: the index of the group that runs range ``k``) of least bottleneck, or
    None when there are too many stages or no order keeps the ends trusted."""
    S, M = len(stages), problem.num_microbatches
    if S < 3 or S > MAX_STAGES:
        return None
    pol = problem.policy
    ends_trusted = pol.enabled and pol.trusted_endpoints
    trusted = [all(problem.classes[problem.class_of(d)].trusted for d in g.devices) for g in stages]
    compute = [[_compute_ms(problem, stages[k], g) for g in stages] for k in range(S)]
    nbytes = [problem.boundary_bytes(stages[k].last_block) for k in range(S - 1)]
    wire = {(k, i, j): _wire_ms(problem, nbytes[k], stages[i], stages[j], M)
            for k in range(S - 1) for i in range(S) for j in range(S) if i != j}
    best: dict[tuple[int, int], tuple[float, float, tuple[int, ...]]] = {}
    for g in range(S):
        if not ends_trusted or trusted[g]:
            best[(1 << g, g)] = (compute[0][g], 0.0, (g,))
    for mask in range(1, 1 << S):
        k = bin(mask).count("1")  # the position the next group takes
        if k >= S:
            continue
        for last in range(S):
            entry = best.get((mask, last))
            if entry is None:
                continue
            peak, total, order = entry
            for g in range(S):
                if mask >> g & 1 or (ends_trusted and k == S - 1 and not trusted[g]):
                    continue
                w = wire[(k - 1, last, g)]
                cand = (max(peak, compute[k][g], w), total + w, order + (g,))
                key = (mask | 1 << g, g)
                if key not in best or cand[:2] < best[key][:2]:
                    best[key] = cand
    full = [v for (mask, _), v in best.items() if mask == (1 << S) - 1]
    return min(full)[2] if full else None


def reorder(problem: Problem, placement: Placement) -> Placement | None:
    """``placement`` with its groups in :func:`best_order`, verifiers placed again, if valid and priced lower."""
    stages = placement.stages
    order = best_order(problem, stages)
    if order is None or order == tuple(range(len(stages))):
        return None
    moved = tuple(dataclasses.replace(st, devices=stages[g].devices, microbatches=stages[g].microbatches,
                                      in_flight=())
                  for st, g in zip(stages, order))
    verifiers = assign_verifiers(problem, moved, placement.num_microbatches)
    if verifiers is None:
        return None
    cand = Placement(stages=moved, verifiers=verifiers, num_microbatches=placement.num_microbatches)
    if violations(problem, cand):
        return None
    old = price_program(problem, placement).step_ms
    return cand if price_program(problem, cand).step_ms < old * (1 - MARGIN) and math.isfinite(old) else None
