"""A search over stage-group sequences (class, replicas per stage), each partitioned and priced.

Seeds are the uniform sequences of each device class; neighbours change one
group's class or replica count, or split and merge groups. Each sequence is
partitioned by ``chain_dp.partition_sequence`` and priced by ``seq_partition.sequence_placement``.
"""
from __future__ import annotations

import numpy as np

from planner.solver.problem import Problem
from planner.solver.search.budget import Work, partition_units
from planner.solver.search.chain_dp import Group
from planner.solver.search.seq_partition import sequence_placement


def _fits_counts(problem: Problem, groups: tuple[Group, ...]) -> bool:
    used: dict[int, int] = {}
    for g in groups:
        used[g.cls] = used.get(g.cls, 0) + g.replicas
    return all(n <= problem.classes[c].count for c, n in used.items())


def _endpoint_ok(problem: Problem, groups: tuple[Group, ...]) -> bool:
    pol = problem.policy
    if not (pol.enabled and pol.trusted_endpoints):
        return True
    return problem.classes[groups[0].cls].trusted and problem.classes[groups[-1].cls].trusted


def _seed_sequences(problem: Problem, max_stages: int) -> list[tuple[Group, ...]]:
    """Fastest-devices-first sequences of every length, trusted devices at the ends, classes kept together."""
    stage = [c for c in problem.classes if c.stage_capable]
    speed = {c.index: 1.0 / max(problem.range_time_ms(0, problem.num_blocks - 1, c.index), 1e-12) for c in stage}
    devices = sorted(((c.index, i) for c in stage for i in range(c.count)), key=lambda ci: -speed[ci[0]])
    pol = problem.policy
    need_trust = pol.enabled and pol.trusted_endpoints
    out = []
    max_s = min(problem.num_blocks, len(devices), max_stages)
    lengths = sorted(set(range(2, min(max_s, 24) + 1)) | {int(x) for x in np.geomspace(2, max(max_s, 2), 12)})
    for S in lengths:
        chosen = devices[:S]
        trusted = [d for d in devices if problem.classes[d[0]].trusted]
        if need_trust:
            if len(trusted) < 2:
                break
            ends = trusted[:2]
            rest = [d for d in devices if d not in ends][:S - 2]
            chosen = [ends[0]] + sorted(rest, key=lambda d: (problem.classes[d[0]].trusted, d[0])) + [ends[1]]
        else:
            chosen = sorted(chosen, key=lambda d: d[0])
        if len(chosen) == S:
            out.append(tuple(Group(cls=c) for c, _ in chosen))
    return out


def _neighbours(problem: Problem, groups: tuple[Group, ...], rng: np.random.Generator,
                max_stages: int) -> list[tuple[Group, ...]]:
    """Swap two stages, drop one, add a device of some class, or change one stage's replica count."""
    S, out = len(groups), []
    classes = [c.index for c in problem.classes if c.stage_capable]
    for _ in range(6):
        g = list(groups)
        move = rng.integers(4)
        if move == 0 and S >= 2:
            i, j = rng.choice(S, 2, replace=False)
            g[i], g[j] = g[j], g[i]
        elif move == 1 and S > 2:
            del g[rng.integers(S)]
        elif move == 2 and S >= 2:
            g.insert(int(rng.integers(1, S)), Group(cls=int(rng.choice(classes))))
        else:
            i = int(rng.integers(S))
            choices = problem.replica_choices(g[i].cls)
            g[i] = Group(cls=g[i].cls, replicas=int(rng.choice(choices)))
        cand = tuple(g)
        if 2 <= len(cand) <= min(problem.num_blocks, max_stages) and _fits_counts(problem, cand) \
                and _endpoint_ok(problem, cand):
            out.append(cand)
    return out


def search_sequences(problem: Problem, *, time_budget_s: float, seed: int = 0, max_stages: int | None = None,
                     within: Work | None = None):
    """Best (placement, step_ms) of at most ``max_stages`` stages found over seeded sequences and a
    short randomised local search (None if no sequence fits), in ``time_budget_s`` nominal seconds of work
    (``budget``; charged to ``within`` too)."""
    work = Work.of(time_budget_s, within, "sequence search")
    seeds = work.sub(time_budget_s / 2)
    cap = max_stages or problem.num_blocks
    best = None
    best_groups: tuple[Group, ...] | None = None
    for groups in _seed_sequences(problem, cap):
        if not _fits_counts(problem, groups):
            continue
        got = sequence_placement(problem, groups)
        seeds.charge(partition_units(problem.num_blocks, len(groups), exact=False))
        if got is not None and (best is None or got[1] < best[1]):
            best, best_groups = got, groups
        if seeds.passed():
            break
    rng = np.random.default_rng(seed)
    tried: set[tuple[Group, ...]] = set()
    stale = 0  # rounds without a new candidate: the neighbourhood is exhausted
    while best_groups is not None and not work.passed() and stale < 30:
        stale += 1
        for cand in _neighbours(problem, best_groups, rng, cap):
            if cand in tried:
                continue
            tried.add(cand)
            stale = 0
            got = sequence_placement(problem, cand)
            work.charge(partition_units(problem.num_blocks, len(cand), exact=False))
            if got is not None and got[1] < best[1] - 1e-9:
                best, best_groups = got, cand
                break
    return best
