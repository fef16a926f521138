"""Uniform pp x dp grids (Megatron-style): the ``ppdp`` baseline and plans of a shape the user fixes.

A grid of ``pp`` stages with ``dp`` replicas each takes the ``pp * dp`` fastest
stage devices (where the policy wants trusted endpoints: the ``2 * dp`` fastest
trusted ones for the end stages, the fastest of the rest for the middle; where
those cannot hold their stages, the devices with the most memory instead),
orders them by region and host (so a stage's replicas share a host or a region
where they can, and its all-reduce stays on fast links), and
gives stage ``k`` an even share of the blocks and either the ``k``-th run of
``dp`` devices (replicas together: all-reduces on fast links) or every
``pp``-th device from the ``k``-th (pipelines together: a host or region runs
whole pipelines, their transfers on fast links, the all-reduces across). ``grids`` lists every valid one
(before a deadline: those found by then); ``best_grid`` is the baseline: the one whose compiled programs
cost least (``objective.price_program``). A grid whose stages cannot hold their weights and activations
on their devices is dropped before its verifiers are placed (most of the shapes of a large pool).
``shaped`` serves ``--stages``/``--replicas``: the grids of that shape (with ``--replicas`` free, the tapered
ones too: ``tapered``), each also re-partitioned for its devices and its cuts polished, the cheapest kept.
"""
from __future__ import annotations

import itertools
import math

from planner.errors import InfeasiblePlanError, InvalidInputError
from planner.solver.objective import (
    Placement,
    evaluate,
    even_split,
    price_program,
    stage_memory_bytes,
    violations,
)
from planner.solver.problem import Problem
from planner.solver.search.budget import (
    Work,
    evaluate_units,
    grid_check_units,
    grid_rank_units,
    grid_setup_units,
    grid_try_units,
    partition_units,
    placement_units,
)
from planner.solver.search.chain_dp import Group
from planner.solver.search.deadline import Deadline
from planner.solver.search.polish import polish
from planner.solver.search.seq_partition import partition_min_step
from planner.solver.solution import StagePlacement
from planner.solver.verifiers import assign_verifiers


def _even_ranges(num_blocks: int, parts: int) -> tuple[tuple[int, int], ...]:
    bounds = [round(i * num_blocks / parts) for i in range(parts + 1)]
    return tuple((a, b - 1) for a, b in itertools.pairwise(bounds))


def _by_speed(problem: Problem) -> list[tuple[float, int, str]]:
    """Every stage device as (whole-chain time, class, id), fastest first."""
    return sorted((problem.range_time_ms(0, problem.num_blocks - 1, c.index), c.index, d)
                  for c in problem.classes if c.stage_capable for d in c.device_ids)


def _by_place(problem: Problem, devices: list[str]) -> list[str]:
    """``devices`` by region and host (so a stage's replicas share a host or region where they can)."""
    return sorted(devices, key=lambda d: (problem.classes[problem.class_of(d)].name, d))


def _order(problem: Problem, fastest: list[tuple[float, int, str]], by: str) -> list[str]:
    """The stage devices in the order a grid takes them: fastest first (``by="speed"``) or with the most memory
    first (``by="memory"``: where the fastest cannot hold their stages)."""
    order = fastest if by == "speed" else sorted(fastest, key=lambda x: (-problem.classes[x[1]].mem_bytes, x[0]))
    return [d for _, _, d in order]


def _groups(problem: Problem, pp: int, dp: int, together: str, order: list[str],
            end_dp: int | None = None) -> list[list[str]] | None:
    """Stage device groups of a ``pp`` x ``dp`` grid, taking devices in ``order``. Where the policy wants trusted
    endpoints, or ``end_dp`` is given, the end stages take the first devices that may hold them (``end_devices``;
    ``end_dp`` each, default ``dp``) and the middle stages the first of the rest (end devices left over included);
    else the first ``pp * dp``. ``together``: ``replicas`` (a stage's replicas side by side) or ``pipelines`` (every
    ``pp``-th device of the stages that share a pool)."""
    pol = problem.policy
    if end_dp is None and not (pol.enabled and pol.trusted_endpoints):
        return _split(problem, order[:pp * dp], pp, dp, together)
    eligible = end_devices(problem)
    trusted = [d for d in order if d in eligible]
    per_end = dp if end_dp is None else end_dp
    ends = per_end * min(pp, 2)
    if len(trusted) < ends:
        return None
    taken = set(trusted[:ends])
    end_groups = _split(problem, trusted[:ends], min(pp, 2), per_end, "replicas")
    inner = _split(problem, [d for d in order if d not in taken][:(pp - 2) * dp], pp - 2, dp, together) \
        if pp > 2 else []
    if end_groups is None or inner is None:
        return None
    return [end_groups[0], *inner, *end_groups[1:]]


def end_devices(problem: Problem) -> set[str]:
    """The stage devices a tapered grid's end stages take: the trusted ones where the policy wants trusted
    endpoints, else those of the fastest device type (the ones worth the ends' unreplicated work)."""
    pol = problem.policy
    stage = [c for c in problem.classes if c.stage_capable]
    if pol.enabled and pol.trusted_endpoints:
        return {d for c in stage if c.trusted for d in c.device_ids}
    times = {c.index: problem.range_time_ms(0, problem.num_blocks - 1, c.index) for c in stage}
    best = min(times.values(), default=0.0)
    return {d for c in stage if times[c.index] <= best * (1 + 1e-9) for d in c.device_ids}


def _split(problem: Problem, devices: list[str], parts: int, dp: int, together: str) -> list[list[str]] | None:
    if len(devices) < parts * dp:
        return None
    placed = _by_place(problem, devices)
    return [placed[k * dp:(k + 1) * dp] if together == "replicas" else placed[k::parts] for k in range(parts)]


def _grid(problem: Problem, pp: int, dp: int, *, together: str,
          fastest: list[tuple[float, int, str]] | None = None, end_dp: int | None = None,
          work: Deadline | Work | None = None) -> Placement | None:
    """The grid on the fastest devices that may hold it (trusted ones at the ends where the policy says so, ``end_dp``
    replicas each: default ``dp``), else on those with the most memory; each step taken charged to ``work``
    (``grid_try_units`` per device order tried, ``grid_check_units`` for the check)."""
    M, L = problem.num_microbatches, problem.num_blocks
    if pp > L or dp > M:
        return None
    fastest = _by_speed(problem) if fastest is None else fastest
    for by in ("speed", "memory"):
        groups = _groups(problem, pp, dp, together, _order(problem, fastest, by), end_dp)
        if groups is None:
            _charge(work, grid_try_units(len(fastest), pp, 0))
            return None
        stages = tuple(StagePlacement(index=k, first_block=a, last_block=b, devices=tuple(groups[k]),
                                      microbatches=even_split(M, len(groups[k])))
                       for k, (a, b) in enumerate(_even_ranges(L, pp)))
        _charge(work, grid_try_units(len(fastest), pp, sum(len(g) for g in groups)))
        if _may_fit(problem, stages):
            found = _checked(problem, stages)
            _charge(work, _check_units(problem, stages, found, len(fastest)))
            return found
    return None


def _charge(work: Deadline | Work | None, units: float) -> None:
    if work is not None:
        work.charge(units)


def _check_units(problem: Problem, stages: tuple[StagePlacement, ...], found: Placement | None,
                 num_devices: int) -> float:
    """``grid_check_units`` of a grid checked (``found``: the valid placement, or None)."""
    untrusted = sum(1 for st in stages for d in st.devices if not problem.classes[problem.class_of(d)].trusted)
    copies = 0 if found is None else found.num_microbatches * len(found.verifiers)
    return grid_check_units(num_devices, sum(len(st.devices) for st in stages), untrusted, copies)


def _may_fit(problem: Problem, stages: tuple[StagePlacement, ...]) -> bool:
    """Trusted endpoints where the policy wants them, every replica's stage within its device's memory (verifier
    state aside): the rules of ``violations`` that rule out most grids, without placing verifiers or pricing."""
    pol = problem.policy
    if pol.enabled and pol.trusted_endpoints and not all(
            problem.classes[problem.class_of(d)].trusted for st in (stages[0], stages[-1]) for d in st.devices):
        return False
    need: dict[tuple[int, int], int] = {}
    for st in stages:
        for d, m in zip(st.devices, st.microbatches):
            if (st.index, m) not in need:
                need[st.index, m] = stage_memory_bytes(problem, st, len(stages), m)
            if need[st.index, m] > problem.classes[problem.class_of(d)].mem_bytes:
                return False
    return True


def _checked(problem: Problem, stages: tuple[StagePlacement, ...]) -> Placement | None:
    verifiers = assign_verifiers(problem, stages, problem.num_microbatches)
    if verifiers is None:
        return None
    placement = Placement(stages=stages, verifiers=verifiers, num_microbatches=problem.num_microbatches)
    return None if violations(problem, placement) else placement


def grids(problem: Problem, *, stages: int | None = None, replicas: int | None = None,
          deadline: Deadline | Work | None = None) -> list[Placement]:
    """Every valid grid (of the given shape, where given), the likeliest shapes first (``_compute_ms``: on
    hundreds of devices there are over a thousand shapes); once ``deadline`` has passed (a ``Work`` budget:
    spent, the shapes ranked and each grid tried charged to it), those found so far (at least the first valid one,
    when there is one)."""
    D, L, M = sum(c.count for c in problem.classes if c.stage_capable), problem.num_blocks, problem.num_microbatches
    # shapes out of reach (more stages than blocks, more replicas than microbatches) are never tried
    shapes = [(pp, dp) for pp in ([stages] if stages else range(1, min(D, L) + 1))
              for dp in ([replicas] if replicas else range(1, D // pp + 1)) if pp <= L and dp <= M]
    fastest = _by_speed(problem)
    _charge(deadline, grid_setup_units(D) + sum(grid_rank_units(pp) for pp, _ in shapes))
    out: list[Placement] = []
    for pp, dp in sorted(shapes, key=lambda s: (_compute_ms(problem, s[0], s[1], fastest), -s[0] * s[1], s[0])):
        if deadline is not None and out and deadline.passed():
            break
        for together in ("replicas", "pipelines")[:1 if 1 in (pp, dp) else 2]:
            found = _grid(problem, pp, dp, together=together, fastest=fastest, work=deadline)
            if found is not None:
                out.append(found)
    return out


def _compute_ms(problem: Problem, pp: int, dp: int, fastest: list[tuple[float, int, str]]) -> float:
    """The shape's step with compute alone, every stage on the slowest of its ``pp * dp`` devices: (microbatches
    per replica + pp - 1) x the slowest stage. Cheap; on the solver benchmark's 176-device pool it ranks the
    best grid among the first dozen shapes at every microbatch count, where most devices first put it up to
    450th of about 550 (a deadline then stopped the enumeration long before it)."""
    M, L = problem.num_microbatches, problem.num_blocks
    if pp > L or dp > M or pp * dp > len(fastest):
        return math.inf
    cls = fastest[pp * dp - 1][1]
    slowest = max(problem.range_time_ms(a, b, cls) for a, b in _even_ranges(L, pp))
    return (math.ceil(M / dp) + pp - 1) * slowest


# Grids priced as programs (costly on large clusters and many microbatches): the likeliest by the closed form.
PRICED = 24


def cheapest(problem: Problem, placements: list[Placement], count: int = PRICED,
             within: Deadline | Work | None = None, *, cut: bool = True) -> list[Placement]:
    """The ``count`` likeliest by the search's closed form (``objective.evaluate``: fast), cheapest program
    first; with a ``Work`` budget ``within``, the ranking and each pricing charged to it and (``cut``) only those
    priced before it is spent (at least the likeliest)."""
    if within is not None:
        within.charge(sum(evaluate_units(p) for p in placements))
    likely = sorted(placements, key=lambda p: evaluate(problem, p).step_ms)[:count]
    if isinstance(within, Work):
        priced = []
        for p in likely:
            if cut and priced and within.passed():
                break
            within.charge(placement_units(p))
            priced.append(p)
        likely = priced
    return sorted(likely, key=lambda p: price_program(problem, p).step_ms)


def grid_candidates(problem: Problem, *, repartition: int = 3, deadline: Deadline | Work | None = None,
                    priced: Work | None = None) -> list[Placement]:
    """The likeliest valid grids (found by ``deadline``), ranked by their programs' cost (those priced by
    ``priced``, a budget of its own: the grids' search may spend all of its own), and the ``repartition``
    cheapest re-partitioned for their devices."""
    found = cheapest(problem, grids(problem, deadline=deadline), within=priced)
    wide = cheapest(problem, tapered(problem, deadline=deadline), within=priced)
    # a few, memoised: unbudgeted (on ``priced``, spent by then, the first alone was split: a GPipe pool's plan +2.8%)
    return found + wide + repartitioned(problem, found[:repartition] + wide[:repartition])


def tapered(problem: Problem, *, deadline: Deadline | Work | None = None) -> list[Placement]:
    """Grids wider in the middle than at the ends, where the devices that may hold the end stages (``end_devices``:
    the trusted ones where the policy wants trusted ends, else the fastest type) are too few for a uniform grid to
    replicate the others (SWARM's pool: 2 trusted A100s at the ends, 16 volunteer T4 replicas between): every
    ``pp >= 3`` x ``dp`` wider than a uniform grid's ends allow, ``end_dp`` end devices per end; those found by
    ``deadline`` (each charged as a grid)."""
    fastest = _by_speed(problem)
    D, L, M = len(fastest), problem.num_blocks, problem.num_microbatches
    _charge(deadline, grid_setup_units(D))
    ends = len(end_devices(problem))
    if ends in (0, D):
        return []
    out: list[Placement] = []
    for end_dp in range(1, min(ends // 2, M) + 1):
        for pp in range(3, min(D - 2 * end_dp + 2, L) + 1):
            # the uniform grids' ends stop at ends // 2; more replicas than microbatches are out of reach
            for dp in range(ends // 2 + 1, min((D - 2 * end_dp) // (pp - 2), M) + 1):
                if deadline is not None and out and deadline.passed():
                    return out
                for together in ("replicas", "pipelines")[:1 if pp == 3 else 2]:
                    found = _grid(problem, pp, dp, together=together, fastest=fastest, end_dp=end_dp, work=deadline)
                    if found is not None:
                        out.append(found)
    return out


def best_grid(problem: Problem, deadline: Deadline | Work | None = None) -> Placement:
    """The ``ppdp`` baseline: of the likeliest valid grids (found by ``deadline``), the one whose programs cost
    least; their ranking and pricing charged to ``deadline`` (a ``Work``), every one of them priced."""
    found = grids(problem, deadline=deadline)
    if not found:
        raise InfeasiblePlanError("baseline ppdp: no uniform pp x dp grid fits memory and the policy here",
                                  fix="use the solver (it places stages unevenly to fit)")
    # not cut short by the budget the enumeration spent: the baseline stays the cheapest of the likeliest
    return cheapest(problem, found, within=deadline, cut=False)[0]


def repartitioned(problem: Problem, placements: list[Placement], within: Work | None = None) -> list[Placement]:
    """Each of ``placements`` with its blocks split for its devices where that is valid (``_repartitioned``); with
    a budget ``within``, each split charged to it (an exact DP: ~50 ms at 1000 blocks) and only those split before
    it is spent (at least the first)."""
    out = []
    for i, g in enumerate(placements):
        if within is not None:
            if i and within.passed():
                break
            within.charge(partition_units(problem.num_blocks, g.num_stages, exact=True))
        p = _repartitioned(problem, g)
        if p is not None:
            out.append(p)
    return out


def _repartitioned(problem: Problem, placement: Placement) -> Placement | None:
    """The grid's devices with the blocks split for them (exact DP), when each stage is one device class."""
    classes = [{problem.class_of(d) for d in st.devices} for st in placement.stages]
    if any(len(c) != 1 for c in classes):
        return None
    groups = tuple(Group(cls=c.pop(), replicas=len(st.devices)) for c, st in zip(classes, placement.stages))
    ranges = partition_min_step(problem, groups)
    if ranges is None:
        return None
    stages = tuple(StagePlacement(index=k, first_block=a, last_block=b, devices=st.devices,
                                  microbatches=st.microbatches) for k, ((a, b), st) in
                   enumerate(zip(ranges, placement.stages)))
    return _checked(problem, stages)


def shaped(problem: Problem, *, stages: int | None, replicas: int | None, time_budget_s: float,
           within: Work | None = None) -> Placement:
    """The cheapest plan of ``stages`` stages of ``replicas`` replicas each (either may be free); its cuts polished
    in ``time_budget_s`` nominal seconds of work (charged to ``within`` too)."""
    D = sum(c.count for c in problem.classes if c.stage_capable)
    for name, value, most, of in (("--stages", stages, min(D, problem.num_blocks),
                                   f"the cluster's {D} stage devices, the model's {problem.num_blocks} blocks"),
                                  ("--replicas", replicas, D, f"the cluster's {D} stage devices")):
        if value is not None and not 1 <= value <= most:
            raise InvalidInputError(name, expected=f"1..{most} ({of})", found=str(value), fix=f"pick a smaller {name}")
    if replicas is not None and replicas > problem.num_microbatches:  # other microbatch counts may do
        raise InfeasiblePlanError(f"--replicas {replicas} needs at least {replicas} microbatches, "
                                  f"found {problem.num_microbatches}", fix="raise --global-batch or --microbatches")
    if stages and replicas and stages * replicas > D:
        raise InvalidInputError("--stages x --replicas", expected=f"at most the cluster's {D} stage devices",
                                found=f"{stages} x {replicas} = {stages * replicas}", fix="shrink either")
    found = grids(problem, stages=stages, replicas=replicas)
    if replicas is None:  # replicas free: the middle may be wider than the trusted ends
        found += [p for p in tapered(problem) if stages is None or p.num_stages == stages]
    if not found:
        shape = f"{stages or 'any number of'} stages of {replicas or 'any number of'} replicas"
        why, fix = _no_grid(problem, stages, replicas) if stages and replicas else \
            ("fits memory and the verification policy here", ("allow more stages (less memory per device) or drop "
             "the constraint"))
        raise InfeasiblePlanError(f"no plan with {shape} {why}", fix=fix)
    found = cheapest(problem, found)
    found += repartitioned(problem, found)
    best = min(found, key=lambda p: price_program(problem, p).step_ms)
    return polish(problem, best, time_budget_s=time_budget_s, cuts_only=True, within=within)[0]


def _no_grid(problem: Problem, pp: int, dp: int) -> tuple[str, str]:
    """Why no ``pp`` x ``dp`` grid is valid, and what would make one: the first constraint that binds of
    trusted end stages, memory (on the fastest devices and on those with the most memory) and verifier sites."""
    pol, fastest = problem.policy, _by_speed(problem)
    trusted = sum(1 for _, c, _ in fastest if problem.classes[c].trusted)
    ends = dp * min(pp, 2)
    if pol.enabled and pol.trusted_endpoints and trusted < ends:
        return ((f"has trusted end stages: they need {ends} trusted stage devices ({dp} replicas each), the cluster "
                f"has {trusted}"), f"ask for at most {max(1, trusted // min(pp, 2))} replicas, or add trusted devices")
    worst = None
    for by in ("speed", "memory"):
        for together in ("replicas", "pipelines"):
            groups = _groups(problem, pp, dp, together, _order(problem, fastest, by))
            if groups is None:
                continue
            stages = tuple(StagePlacement(index=k, first_block=a, last_block=b, devices=tuple(groups[k]),
                                          microbatches=even_split(problem.num_microbatches, dp))
                           for k, (a, b) in enumerate(_even_ranges(problem.num_blocks, pp)))
            if _may_fit(problem, stages):
                return (("has a verifier for every boundary an untrusted device sends on: a verifier sits on a "
                        "trusted device of a stage at the boundary, of the first or the last stage, or on a CPU "
                        "verifier host, outside the senders' trust domains, where the policy allows"),
                        "add a trusted CPU verifier host (role: verifier) or use fewer replicas")
            over = max((stage_memory_bytes(problem, st, pp, m) / problem.classes[problem.class_of(d)].mem_bytes,
                        st.index) for st in stages for d, m in zip(st.devices, st.microbatches))
            worst = over if worst is None else min(worst, over)
    if worst is not None:
        return (f"fits memory: stage {worst[1]} needs {worst[0]:.2f}x its device's memory on the best grid found",
                "allow more stages (less memory per device) or recomputation (--recompute always)")
    return ("fits the policy here", "drop the constraint")
