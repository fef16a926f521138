"""Mixed replication: plans whose first stages run on one device each and the later ones on replicas, searched on
the programs' cost (issue 36).

The closed form that the search's DPs and CP-SAT optimise (``objective.evaluate``) prices the fill of a pipeline
of single-device stages far above what its compiled programs cost: on DT-FM worldwide a plan of 8 single-device
stages then 9 of 2 replicas prices 9,338 ms there and 3,113 ms as programs, the search's plan 5,516 / 3,854. So
no search stage reaches such plans, and the hill-climbs from the search's plan (``local``, ``polish``) have no move
that turns a uniform plan into one. Here they are built directly and priced as programs:

* seeds (``mixed_groups``): ``head`` single-device stages, then stages of ``r`` replicas, ``stages`` in all, the
  classes' devices taken in an order (the problem's, the incumbent's, paths along the fastest links); per
  (order, r) a pattern search over (head, stages) from a start, the most promising pairs first;
* on a pool of untrusted devices, per order, the pipelines of single-device stages by length (``_pipelines``; a
  volunteer swarm's plan: on slow links replicas' all-reduces cost more than the stages they relieve), the
  cheapest of them hill-climbed, in at most ``PIPELINE_SHARE`` of the work left;
* a descent over the best seed's (unless a pipeline of single devices the step before covered) and the
  incumbent's group sequence (``group_moves``): a prefix unreplicated, a suffix replicated, a replicated stage
  split into two, two single-device neighbours merged into one stage of two replicas, a single-device stage added
  in front or the last stage dropped; then the local search's moves.

Each sequence is re-partitioned by the closed form (``seq_partition.partition_min_step``); on a pool of untrusted
devices (``volunteers``) a pipeline of single devices also by the same DP with every link free (the stages'
compute balanced: on slow links the closed form, which counts each send as busy time, gives the untrusted middle
stages of swarm-t4 one block each, 22,586 ms as programs against 8,515 for 7/5/5/5/4 blocks); its verifiers are
placed greedily then moved on the programs' price
(``shared_verifiers.place_on_programs``), and the cheaper priced (``objective.price_program``); ``polish`` moves
the cuts afterwards. Where the policy wants trusted ends, the seeds keep a trusted device for the last stage.
Deterministic: no randomness, fixed orders, and a work budget (``budget.Work``).
"""
from __future__ import annotations

import math
from collections import Counter

from cost_models import comm
from planner.solver.objective import Placement, price_program, violations
from planner.solver.problem import Problem, comm_free_for_bound
from planner.solver.search.budget import Work, partition_units, program_units
from planner.solver.search.chain_dp import Group
from planner.solver.search.local import neighbours
from planner.solver.search.polish import polish
from planner.solver.search.seq_partition import partition_min_step, placed
from planner.solver.shared_verifiers import place_on_programs

MAX_REPLICAS = 4  # replica counts of the later stages tried (2..this): more leave too few stages on slow links
PATTERN_STEPS = (2, 1)  # the pattern search's steps over (head, stages), coarse to fine
FIRST_PAIRS = 2  # (order, r) pairs searched further, the best-priced starts first; the others keep their start
# The coarse grid each searched pair starts from: stage counts as shares of the most that fit, heads as shares of
# the stage count (the cost is rugged in (head, stages): on DT-FM worldwide a descent from one start stops 25% off).
GRID_STAGES = (0.5, 0.67, 0.83, 1.0)
GRID_HEADS = (0.0, 0.25, 0.5, 0.75)
# A sequence whose greedy verifiers price within this factor of the cheapest plan met has them moved on the
# programs' price (``shared_verifiers.place_on_programs``, a pricing per move tried): swarm-t4's pipelines price
# 1.3-1.6x moved what they price greedy (5 stages 13,369 -> 9,162 ms, 7 stages 14,778 -> 9,179), against an
# incumbent that the climb's own moves already brought to 10,031.
PLACE_WITHIN = 1.6
# The pipelines' cost is rugged in their length (swarm-t4: 5 stages 9,162 ms, 6 11,844, 7 9,179, 8 11,876, 9 14,417):
# the scan stops after this many lengths in a row price above its cheapest.
PIPELINE_PATIENCE = 4
PIPELINE_CLIMB_WITHIN = 1.1  # pipelines priced within this factor of the cheapest plan met are climbed, cheapest first
# Of the mixed search's work left after the pattern search, at most this for the pipelines (scan and climbs); the
# descents get the rest (on swarm-t4 at M=32 the descent from a 4-stage incumbent took all 3.4 s that were left).
PIPELINE_SHARE = 0.5


class Pricer:
    """Group sequences re-partitioned and priced as programs, each once; ``work`` charged for each."""

    def __init__(self, problem: Problem, work: Work, incumbent_ms: float = math.inf) -> None:
        self.problem, self.work = problem, work
        self.free = comm_free_for_bound(problem)  # cut by compute alone
        self.least_ms = incumbent_ms  # the cheapest plan met (the incumbent's, at first)
        self.volunteers = volunteers(problem)
        self.seen: dict[tuple[Group, ...], tuple[Placement, float] | None] = {}

    def __call__(self, groups: tuple[Group, ...] | None) -> float:
        """The programs' cost of ``groups`` (inf: invalid, not placeable, or out of work)."""
        if groups is None or self.work.passed():
            return math.inf
        if groups not in self.seen:
            self.seen[groups] = self._price(groups)
        got = self.seen[groups]
        return math.inf if got is None else got[1]

    def _price(self, groups: tuple[Group, ...]) -> tuple[Placement, float] | None:
        p = self.problem
        if not valid(p, groups):
            return None
        found, tried = [], set()
        # the closed form's cuts, then for a pipeline of single devices the compute's (replicas share the sends the
        # closed form counts as busy time; the second DP on every sequence doubled the descents' work)
        pipeline = self.volunteers and all(g.replicas == 1 for g in groups)
        for cut_by in (p, self.free) if pipeline else (p,):
            self.work.charge(partition_units(p.num_blocks, len(groups), exact=True))
            ranges = partition_min_step(cut_by, groups)
            if ranges is None or ranges in tried:
                continue
            tried.add(ranges)
            placement = placed(p, groups, ranges)
            if placement is None or violations(p, placement):
                continue
            self.work.charge(program_units(p.num_microbatches, len(groups)))
            ms = price_program(p, placement).step_ms
            if ms <= PLACE_WITHIN * self.least_ms:
                placement, ms = place_on_programs(p, placement, within=self.work)
            self.least_ms = min(self.least_ms, ms)
            found.append((placement, ms))
        return min(found, key=lambda f: f[1], default=None)

    def best(self) -> tuple[Placement, float] | None:
        found = [v for v in self.seen.values() if v is not None]
        return min(found, key=lambda v: v[1]) if found else None


def volunteers(problem: Problem) -> bool:
    """Whether the pool has untrusted stage devices to verify: there the pipelines of single devices and the
    compute's cuts are tried (elsewhere, DT-FM's and the Sailor-like pools, the search stays as it was measured)."""
    return problem.policy.enabled and any(c.stage_capable and not c.trusted for c in problem.classes)


def valid(problem: Problem, groups: tuple[Group, ...]) -> bool:
    """Whether ``groups`` fits the device counts, the chain and the policy's trusted ends."""
    if not 1 <= len(groups) <= problem.num_blocks:
        return False
    count = {c.index: c.count for c in problem.classes if c.stage_capable}
    use = Counter()
    for g in groups:
        if g.cls not in count or g.replicas not in problem.replica_choices(g.cls):
            return False
        use[g.cls] += g.replicas
    if any(use[c] > count[c] for c in use):
        return False
    pol = problem.policy
    return not (pol.enabled and pol.trusted_endpoints
                and not (problem.classes[groups[0].cls].trusted and problem.classes[groups[-1].cls].trusted))


def class_orders(problem: Problem, placement: Placement) -> list[tuple[int, ...]]:
    """Orders to take the classes' devices in: the problem's, the incumbent's (its stages' classes first), and
    from each of those two's first class the path that next takes the class of the fastest boundary link."""
    classes = [c.index for c in problem.classes if c.stage_capable]
    first_use = list(dict.fromkeys(problem.class_of(st.devices[0]) for st in placement.stages))
    theirs = tuple(first_use + [c for c in classes if c not in first_use])
    nbytes = max(problem.boundary_bytes(e) for e in range(problem.num_blocks - 1)) if problem.num_blocks > 1 else 0.0

    def path(start: int) -> tuple[int, ...]:
        out, left = [start], [c for c in classes if c != start]
        while left:  # the nearest class next: the one a boundary reaches soonest (latency and bandwidth)
            nxt = min(left, key=lambda c: (comm.transfer_ms(nbytes, problem.links[out[-1]][c]), c))
            out.append(nxt)
            left.remove(nxt)
        return tuple(out)

    return list(dict.fromkeys([tuple(classes), theirs, path(classes[0]), path(theirs[0])]))


def mixed_groups(problem: Problem, order: tuple[int, ...], head: int, replicas: int,
                 stages: int) -> tuple[Group, ...] | None:
    """``head`` single-device stages then ``stages - head`` of ``replicas``, each stage on the first class in
    ``order`` with that many devices left (None: the devices run out, or the shape is empty). Where the policy
    wants trusted ends and that last stage is untrusted, the last stage is one device of the first trusted class in
    ``order`` instead, kept back for it."""
    plain = _taken(problem, order, head, replicas, stages, None)
    pol = problem.policy
    if plain is None or stages < 2 or not (pol.enabled and pol.trusted_endpoints) \
            or problem.classes[plain[-1].cls].trusted:
        return plain
    end = next((c for c in order if problem.classes[c].trusted), None)
    return None if end is None else _taken(problem, order, head, replicas, stages, end)


def _taken(problem: Problem, order: tuple[int, ...], head: int, replicas: int, stages: int,
           end: int | None) -> tuple[Group, ...] | None:
    """:func:`mixed_groups`' stages, the last one on a device of class ``end`` kept back for it (None: as taken)."""
    if not 0 <= head <= stages or stages < 1:
        return None
    left = {c.index: c.count for c in problem.classes}
    if end is not None:
        if left[end] < 1:
            return None
        left[end] -= 1
    out, at = [], 0
    for k in range(stages - (end is not None)):
        r = 1 if k < head else replicas
        while at < len(order) and left[order[at]] < r:
            at += 1
        if at == len(order):
            return None
        out.append(Group(cls=order[at], replicas=r))
        left[order[at]] -= r
    return tuple(out) if end is None else (*out, Group(cls=end, replicas=1))


def _pattern(price: Pricer, order: tuple[int, ...], r: int, start: tuple[int, int]) -> tuple[int, int]:
    """(head, stages) of least price reached from ``start`` by moves of ``PATTERN_STEPS`` (first improvement)."""
    p = price.problem
    at, best = start, price(mixed_groups(p, order, start[0], r, start[1]))
    for step in PATTERN_STEPS:
        moved = True
        while moved and not price.work.passed():
            moved = False
            h, s = at
            for cand in ((h + step, s), (h - step, s), (h, s + step), (h, s - step), (h + step, s + step),
                         (h - step, s - step), (h - step, s + step), (h + step, s - step)):
                ms = price(mixed_groups(p, order, cand[0], r, cand[1]))
                if ms < best * (1 - 1e-9):
                    at, best, moved = cand, ms, True
                    break
    return at


def _start(problem: Problem, order: tuple[int, ...], r: int) -> tuple[int, int]:
    """A start for (head, stages): as many stages as blocks and devices allow, half of them single-device (the
    pairs are ranked by its price; the grid ``_grid_best`` spans the stage counts below it)."""
    devices = sum(c.count for c in problem.classes if c.stage_capable)
    stages = min(problem.num_blocks, devices)
    while stages > 1 and mixed_groups(problem, order, stages // 2, r, stages) is None:
        stages -= 1
    return stages // 2, stages


def _grid_best(price: Pricer, order: tuple[int, ...], r: int, most: int) -> tuple[int, int]:
    """Of the coarse grid (``GRID_STAGES`` x ``GRID_HEADS``) below ``most`` stages, the (head, stages) priced least."""
    points = dict.fromkeys((round(s * h), s) for s in (max(1, round(most * f)) for f in GRID_STAGES)
                           for h in GRID_HEADS)
    return min(points, key=lambda hs: (price(mixed_groups(price.problem, order, hs[0], r, hs[1])), hs))


def group_moves(problem: Problem, groups: tuple[Group, ...]) -> list[tuple[Group, ...]]:
    """The descent's neighbours of ``groups`` (see the module docstring), in a fixed order; some may be invalid."""
    S = len(groups)
    replicated = [g.replicas for g in groups if g.replicas > 1]
    r = Counter(replicated).most_common(1)[0][0] if replicated else 2
    out = []
    for j in range(1, S + 1):  # a prefix unreplicated / a suffix replicated
        if groups[j - 1].replicas > 1:
            out.append(tuple(Group(cls=g.cls, replicas=1) for g in groups[:j]) + groups[j:])
        if groups[S - j].replicas == 1:
            out.append(groups[:S - j] + tuple(Group(cls=g.cls, replicas=r) if g.replicas == 1 else g
                                              for g in groups[S - j:]))
    for k, g in enumerate(groups):  # a replicated stage split in two; two single neighbours merged
        if g.replicas > 1:
            a = g.replicas // 2
            out.append(groups[:k] + (Group(cls=g.cls, replicas=a), Group(cls=g.cls, replicas=g.replicas - a))
                       + groups[k + 1:])
        if k + 1 < S and g.replicas == 1 and groups[k + 1] == g:
            out.append(groups[:k] + (Group(cls=g.cls, replicas=2),) + groups[k + 2:])
    for c in dict.fromkeys(g.cls for g in groups):  # a single-device stage in front; the last stage dropped
        out.append((Group(cls=c, replicas=1),) + groups)
    if S > 1:
        out.append(groups[:-1])
    return list(dict.fromkeys(out))


def _descend(price: Pricer, groups: tuple[Group, ...]) -> tuple[Group, ...]:
    """First-improvement descent on the programs' cost: this module's moves first, then the local search's one-move
    neighbours (``local.neighbours``: a stage's class or replicas changed, stages inserted, deleted, swapped)."""
    best = price(groups)
    moved = True
    while moved and not price.work.passed():
        moved = False
        ours = group_moves(price.problem, groups)
        for cand in ours + [c for c in neighbours(price.problem, groups) if c not in set(ours)]:
            ms = price(cand)
            if ms < best * (1 - 1e-9):
                groups, best, moved = cand, ms, True
                break
    return groups


def search(problem: Problem, placement: Placement, program_ms: float, *, time_budget_s: float,
           within: Work | None = None) -> tuple[Placement, float] | None:
    """A plan whose programs cost less than ``program_ms`` (``placement``'s), found as the module docstring says,
    and its cost; None when none is found in ``time_budget_s`` nominal seconds of work (charged to ``within``)."""
    work = Work.of(time_budget_s, within, "mixed replication")
    if problem.num_blocks < 2 or not math.isfinite(program_ms):
        return None
    price = Pricer(problem, work, program_ms)
    top = max((max(problem.replica_choices(c.index)) for c in problem.classes if c.stage_capable), default=1)
    pairs = [(order, r) for r in range(2, min(MAX_REPLICAS, top) + 1) for order in class_orders(problem, placement)]
    starts = {pair: _start(problem, *pair) for pair in pairs}
    ranked = sorted(pairs, key=lambda pr: price(mixed_groups(problem, pr[0], starts[pr][0], pr[1], starts[pr][1])))
    for order, r in ranked[:FIRST_PAIRS]:
        _pattern(price, order, r, _grid_best(price, order, r, starts[(order, r)][1]))
    seed = price.best()
    if price.volunteers:
        _pipelines(price, list(dict.fromkeys(order for order, _ in ranked)), PIPELINE_SHARE * work.left_s())
    own = sequence_groups(problem, placement)
    seeded = None if seed is None else sequence_groups(problem, seed[0])
    # A pipeline seed's lengths are all priced: its descent (the local search's replica and class moves) found
    # nothing on swarm-t4 in 2.0 nominal s of M=32's budget, which the later counts' bounds then lacked.
    covered = seeded is not None and price.volunteers and all(g.replicas == 1 for g in seeded)
    for groups in (own, None if seeded is None or covered else seeded):
        if groups is not None:
            _descend(price, groups)
    best = price.best()
    return best if best is not None and best[1] < program_ms * (1 - 1e-9) else None


def _pipelines(price: Pricer, orders: list[tuple[int, ...]], budget_s: float) -> None:
    """Per order, the pipelines of single-device stages from 2 stages up, priced until ``PIPELINE_PATIENCE``
    lengths in a row price above the cheapest of them (or the devices, blocks or work run out), then those within
    ``PIPELINE_CLIMB_WITHIN`` of the cheapest plan met climbed; in ``budget_s`` of ``price``'s work."""
    outer = price.work
    price.work = outer.sub(budget_s, "pipelines")
    try:
        _pipelines_in(price, orders)
    finally:
        price.work = outer


def _pipelines_in(price: Pricer, orders: list[tuple[int, ...]]) -> None:
    p = price.problem
    for order in orders:
        least, worse = math.inf, 0
        for stages in range(2, p.num_blocks + 1):
            groups = mixed_groups(p, order, stages, 1, stages)
            if groups is None or price.work.passed() or worse >= PIPELINE_PATIENCE:
                break
            ms = price(groups)
            least, worse = (ms, 0) if ms < least else (least, worse + 1)
    # The cheapest pipelines' cuts and verifiers climbed (``polish``): their cuts balance compute or the closed form,
    # neither the programs (a mini swarm of four T4s, 24 blocks: 6/6/6/6 10,381 ms, climbed to 7/6/6/5 9,457 with
    # a boundary split by side, under the 3-stage plan's 10,193).
    pipes = sorted((v for g, v in price.seen.items() if v is not None and all(x.replicas == 1 for x in g)),
                   key=lambda v: v[1])
    climbed = [v for v in pipes if v[1] <= PIPELINE_CLIMB_WITHIN * min(pipes[0][1], price.least_ms)]
    for i, (start, start_ms) in enumerate(climbed):  # the work left shared among the climbs still to come
        if price.work.passed():
            break
        plan, ms = polish(p, start, time_budget_s=price.work.left_s() / (len(climbed) - i), within=price.work)
        groups = sequence_groups(p, plan)
        if ms < start_ms and (price.seen.get(groups) is None or ms < price.seen[groups][1]):
            price.seen[groups] = (plan, ms)


def sequence_groups(problem: Problem, placement: Placement) -> tuple[Group, ...]:
    """A plan's stage groups (each stage's first device's class, its replica count)."""
    return tuple(Group(cls=problem.class_of(st.devices[0]), replicas=len(st.devices)) for st in placement.stages)
