"""Local search over stage sequences around a plan: every neighbour screened by a cheap partition DP.

The incumbent's sequence of stage groups (class, replicas) is changed one
move at a time: a stage's replicas or class, a stage inserted on idle
devices or deleted, two stages swapped, devices moved between two stages of
one class, a stage split in two or two neighbours merged. Each neighbour is
screened by ``seq_partition.screen_step`` (3 of the ~40 kernel calls of an exact
re-partition, often the same figure), in shuffled batches, and only the best
few of a batch are re-partitioned exactly and priced
(``seq_partition.sequence_placement``); the first that improves becomes the incumbent.
At a local optimum the search restarts from the best plan kicked by two
random moves (an iterated local search, which ends better than a plain
descent), until a dozen kicks in a row find nothing or the time ends. Chains
longer than ``SCREEN_BLOCKS`` are screened on their blocks merged (the DPs
cost the square of the blocks, so more screens fit the budget).

Why: the plans met while bounding are repaired relaxed plans, and they
leave devices idle or replicas unbalanced that a single move fixes, within
seconds, where CP-SAT hinted with them finds less, or nothing, in more time
(tuning history: benchmarks/README.md).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from planner.solver.objective import Placement
from planner.solver.problem import Problem
from planner.solver.search.budget import Work, partition_units, screen_units
from planner.solver.search.chain_dp import Group
from planner.solver.search.seq_partition import (
    copy_table,
    screen_step,
    sequence_placement,
)

SCREEN_BATCH = 32  # neighbours screened before the best of them are re-partitioned exactly
SCREEN_TOP = 3  # of a batch, re-partitioned exactly (best screen first)
SCREEN_SLACK = 1.02  # a neighbour screened this much above the incumbent's screen is not re-partitioned
KICK_MOVES = 2  # random moves from the best plan that restart the search at a local optimum
# Longer chains are screened on their blocks merged to at most this many: a screen's DPs cost the square of the
# blocks, and this merge screened best (tuning history: benchmarks/README.md).
SCREEN_BLOCKS = 250
KICK_TRIES = 8  # kicks tried for one that has a plan
KICK_LIMIT = 12  # kicks in a row that find nothing better end the search (small problems: in well under a second)


def coarsened(problem: Problem, factor: int) -> Problem:
    """The problem on blocks merged ``factor`` at a time (cuts only between merged blocks; tied copies left out):
    a screen for long chains, whose partition DPs cost the square of the blocks. Never a bound, nor plans."""
    L = problem.num_blocks
    starts = np.arange(0, L, factor)
    ends = np.minimum(starts + factor, L) - 1

    def summed(a: np.ndarray) -> np.ndarray:
        return np.add.reduceat(a, starts, axis=0)

    return dataclasses.replace(
        problem, block_names=tuple(problem.block_names[i] for i in starts), time_ms=summed(problem.time_ms),
        param_count=summed(problem.param_count), act_bytes=summed(problem.act_bytes),
        out_bytes=problem.out_bytes[ends], out_bytes_int=problem.out_bytes_int[ends], tied=())


def groups_of(problem: Problem, placement: Placement) -> tuple[Group, ...]:
    """A plan's stage groups: each stage's class (its first device's: a stage's devices share one) and replicas."""
    return tuple(Group(cls=problem.class_of(st.devices[0]), replicas=len(st.devices)) for st in placement.stages)


def neighbours(problem: Problem, groups: tuple[Group, ...]) -> list[tuple[Group, ...]]:
    """Every sequence one move away that respects the device counts and trusted endpoints (see the docstring)."""
    count = {c.index: c.count for c in problem.classes if c.stage_capable}
    choices = {c: problem.replica_choices(c) for c in count}
    used = dict.fromkeys(count, 0)
    for g in groups:
        used[g.cls] += g.replicas
    S, out = len(groups), []
    for i, g in enumerate(groups):
        c, spare = g.cls, count[g.cls] - used[g.cls]
        out += [groups[:i] + (Group(cls=o, replicas=r),) + groups[i + 1:]
                for o in count for r in choices[o] if (o, r) != (c, g.replicas)]
        if S > 1:
            out.append(groups[:i] + groups[i + 1:])
        for j in range(i + 1, S):
            out.append(groups[:i] + (groups[j],) + groups[i + 1:j] + (g,) + groups[j + 1:])
            if groups[j].cls == c:  # devices moved between two stages of one class
                both = g.replicas + groups[j].replicas
                for ri in choices[c]:
                    for rj in choices[c]:
                        if (ri, rj) != (g.replicas, groups[j].replicas) and both - 2 <= ri + rj <= both + spare:
                            out.append(groups[:i] + (Group(cls=c, replicas=ri),) + groups[i + 1:j]
                                       + (Group(cls=c, replicas=rj),) + groups[j + 1:])
        out += [groups[:i] + (Group(cls=c, replicas=r1), Group(cls=c, replicas=r2)) + groups[i + 1:]
                for r1 in choices[c] for r2 in choices[c] if r1 + r2 <= g.replicas + spare]
        if i + 1 < S and groups[i + 1].cls == c:
            out += [groups[:i] + (Group(cls=c, replicas=r),) + groups[i + 2:] for r in choices[c]]
    for i in range(S + 1):  # a stage on idle devices
        out += [groups[:i] + (Group(cls=c, replicas=r),) + groups[i:]
                for c in count for r in choices[c] if r <= count[c] - used[c]]
    pol = problem.policy
    seen: set[tuple[Group, ...]] = set()
    valid = []
    for cand in out:
        if cand in seen or not 1 <= len(cand) <= problem.num_blocks:
            continue
        seen.add(cand)
        use = dict.fromkeys(count, 0)
        for g in cand:
            use[g.cls] += g.replicas
        if any(use[c] > count[c] for c in count):
            continue
        if pol.enabled and pol.trusted_endpoints and not (problem.classes[cand[0].cls].trusted
                                                          and problem.classes[cand[-1].cls].trusted):
            continue
        valid.append(cand)
    return valid


def _descend(problem: Problem, groups: tuple[Group, ...], step_ms: float, plan, tried: set, rng, screens,
             work: Work):
    """First-improvement descent from ``groups`` (priced ``step_ms``, placed ``plan``) to a local optimum or
    the deadline: (groups, step, plan, whether the optimum was reached). ``screens``: (problem, copy table)
    to screen on, first choice (merged blocks on long chains) and fallback (the problem itself)."""
    L = problem.num_blocks
    while not work.passed():
        cands = [c for c in neighbours(problem, groups) if c not in tried]
        order = rng.permutation(len(cands))
        moved = False
        screen, table = screens[0]
        ref = screen_step(screen, groups, table)  # the screen of where the search stands
        work.charge(screen_units(screen.num_blocks, len(groups)))
        if not math.isfinite(ref):  # merged blocks can break a memory-tight plan's stages: screen unmerged
            screen, table = screens[1]
            ref = screen_step(screen, groups, table)
            work.charge(screen_units(screen.num_blocks, len(groups)))
        for lo in range(0, len(cands), SCREEN_BATCH):
            screened = []
            for i in order[lo:lo + SCREEN_BATCH]:
                screened.append((screen_step(screen, cands[i], table), int(i)))
                work.charge(screen_units(screen.num_blocks, len(cands[i])))
                if work.passed():
                    break
            screened.sort()
            for value, i in screened[:SCREEN_TOP]:
                if value >= ref * SCREEN_SLACK:  # the screen is close to exact: this one will not improve
                    break
                tried.add(cands[i])
                got = sequence_placement(problem, cands[i], exact=True)
                work.charge(partition_units(L, len(cands[i]), exact=True))
                if got is not None and got[1] < step_ms - 1e-9:
                    plan, step_ms, groups, moved = got[0], got[1], cands[i], True
                    break
            if moved or work.passed():
                break
        if not moved:
            return groups, step_ms, plan, not work.passed()
    return groups, step_ms, plan, False


def improve(problem: Problem, placement: Placement, step_ms: float, *, time_budget_s: float,
            seed: int = 0, target_ms: float = 0.0, within: Work | None = None) -> tuple[Placement, float] | None:
    """A better plan than ``placement`` (priced ``step_ms``) found by the local search, or None; it stops at a
    plan priced ``target_ms`` or less (proven good enough).

    The neighbours are screened in shuffled batches, the best ``SCREEN_TOP`` of each batch re-partitioned
    exactly, and the first that improves moves the search: on long chains screening a whole neighbourhood
    before the first move would spend most of the budget. At a local optimum with time left, the search
    restarts from the best plan kicked by ``KICK_MOVES`` random moves (an iterated local search).
    ``time_budget_s``: nominal seconds of work (``budget``), charged to ``within`` too when given.
    """
    work = Work.of(time_budget_s, within, "local search")
    rng = np.random.default_rng(seed)
    fine = (problem, copy_table(problem))
    if problem.num_blocks <= SCREEN_BLOCKS:
        screens = (fine, fine)
    else:
        merged = coarsened(problem, math.ceil(problem.num_blocks / SCREEN_BLOCKS))
        screens = ((merged, copy_table(merged)), fine)
    groups = groups_of(problem, placement)
    tried = {groups}
    best_groups, best_step, best_plan = groups, step_ms, None
    cur_groups, cur_step, cur_plan = groups, step_ms, placement
    stale = 0  # kicks since the best plan last improved
    while not work.passed() and stale <= KICK_LIMIT and best_step > target_ms:
        cur_groups, cur_step, cur_plan, optimum = _descend(problem, cur_groups, cur_step, cur_plan, tried, rng,
                                                           screens, work)
        stale += 1
        if cur_step < best_step - 1e-9:
            best_groups, best_step, best_plan, stale = cur_groups, cur_step, cur_plan, 0
        if not optimum:
            break
        kicked = None
        for _ in range(KICK_TRIES):
            cand = best_groups
            for _ in range(KICK_MOVES):
                options = neighbours(problem, cand)
                if not options:
                    break
                cand = options[int(rng.integers(len(options)))]
            got = None
            if cand not in tried:
                got = sequence_placement(problem, cand, exact=True)
                work.charge(partition_units(problem.num_blocks, len(cand), exact=True))
            tried.add(cand)
            if got is not None:
                kicked = (cand, got[1], got[0])
                break
        if kicked is None or work.passed():
            break
        cur_groups, cur_step, cur_plan = kicked
    return None if best_plan is None else (best_plan, best_step)
