"""One microbatch count's plan, and the best count's finished.

:func:`solve_count`: the search (``count_search``) or the grids of a fixed shape, then, of every valid plan
met, the one whose compiled programs cost least (``objective.price_program``), or a cheaper one of single-device
stages then replicated ones (``search.mixed``), hill-climbed on that cost (``polish``), its stages'
recomputation mixed (``recompute.mix``), and that cost bounded with free links.
:func:`polish_best`: the best count's plan hill-climbed further in the time the other counts left unused.
:func:`beyond`: a count no plan of which can beat a plan already found, dismissed by its cheap bounds, unsearched.
"""
from __future__ import annotations

import dataclasses
import math
import time

from planner.solver import recompute
from planner.solver.bound.fill import fill_bound_ms
from planner.solver.bound.lagrange import program_bound_ms
from planner.solver.bound.links import LinkBound, link_lower_bound
from planner.solver.count_search import search_count
from planner.solver.explain import precheck
from planner.solver.objective import (
    Placement,
    evaluate,
    price_program,
    program_lower_bound_ms,
)
from planner.solver.outcome import Outcome, Progress
from planner.solver.problem import Problem, bound_problem, recompute_problem
from planner.solver.search import mixed
from planner.solver.search.budget import (
    Work,
    link_bound_units,
    placement_units,
    program_bound_units,
    program_units,
)
from planner.solver.search.grid import cheapest, repartitioned, shaped
from planner.solver.search.polish import polish
from planner.solver.warm import WarmStart

# Of each M's time budget, held back to hill-climb on the cost of the compiled programs (``polish``: the
# objective itself; on DT-FM's spot case it needs ~2 s of a 7 s share to converge) and bound that cost (the
# search's bounds are on its closed form, which prices sends as busy time: ``problem.comm_free_for_bound``).
VALID_BOUND_SHARE = 0.3
POLISH_SHARE = 2 / 3  # of the time held back
# Of polish's budget, then also for plans of single-device stages then replicated ones (``search.mixed``), which
# the search's closed form ranks far too dear to reach (DT-FM worldwide: 3,854 -> 2,962 ms as programs in 1 s of
# work); after the link bound, from the Lagrangian bound's time: polish, the link bound and the other counts get
# what they had. As much as polish had: at 0.4 a pool with a host or a verifier host more missed the smaller pool's
# mixed plan in its own budget (test_monotone_pools seeds 9 and 10).
MIXED_SHARE = 1.0
MIXED_MIN_S = 0.05  # less work than this left for it: no mixed-replication search
# The fill bound's width where it only asks whether a count can beat a plan found (``beyond``): a test at that
# plan's cost, then few more (DT-FM worldwide at 60 s: M = 16 dismissed by that test in 23 ms, M = 4, 2, 1 by the
# fluid LP in 2 ms each; each had a sixth of the search before).
BEYOND_REL_TOL = 0.25
NO_LINK_BOUND = LinkBound(bound_ms=0.0, limit="compute", threshold_gbps=None, islands=0)  # where none is sought
CLIMB_STARTS = 4  # of the cheapest programs met, of distinct shapes, climbed in turn while the polish budget lasts
# Of the time held back, for the cheapest grid of each shape met, its cuts hill-climbed as ``--stages/--replicas``
# would (``_polished_grids``): a budget of its own, so the search and its plan stay as they were where no grid wins.
GRID_POLISH_SHARE = 0.5
GRID_SPLIT_SHARE = 0.2  # of a count's time limit, beside its own: the grids met re-partitioned for their devices


def solve_count(problem: Problem, time_limit_s: float, workers: int, label: str,
                progress: Progress | None, gap_tolerance: float,
                shape: tuple[int | None, int | None] = (None, None), warm: WarmStart | None = None, *,
                within: Work | None = None, seed: int = 0, bounded: bool = True) -> Outcome:
    """Search (``search_count``), then keep the plan whose compiled programs cost least among every valid plan the
    search met, and bound that cost (``problem.comm_free_for_bound``) in the time held back for it. With a
    ``shape`` (stages, replicas per stage) the plans are the grids of that shape (``grid.shaped``).
    ``time_limit_s``: nominal seconds of work (``search.budget``), charged to ``within`` too. ``bounded`` False:
    the fluid LP is the only bound (a rival plan's, which no one reads); the plan's climb gets the time held back."""
    start = time.perf_counter()
    work = Work.of(time_limit_s, within, "search")
    relaxed = bound_problem(problem)  # bounds every mix of stages with and without recompute
    if shape != (None, None):
        precheck(problem)
        # a rival's cuts are climbed once, below, with all its work: a climb stopped mid-pass here and started again
        # there missed DT-FM spot's 8 x 8 grid's second move in a free plan's 1.5 s (15,396.5 ms, not 15,293.6)
        placement = shaped(problem, stages=shape[0], replicas=shape[1],
                           time_budget_s=time_limit_s / 2 if bounded else 0.0, within=work)
        found = Outcome(problem=problem, placement=placement, step_ms=evaluate(problem, placement).step_ms,
                        bound_ms=0.0, method=f"grid {shape[0] or 'any'} x {shape[1] or 'any'}",
                        cpsat_status="SKIPPED (fixed shape)", solve_s=0.0)
        seen, rivals = [placement], []
    else:
        seen, rivals = [], []
        found = search_count(problem, (1 - VALID_BOUND_SHARE) * time_limit_s, workers, label, progress, gap_tolerance,
                             seen, warm, within=work, seed=seed, rivals=rivals)
    fluid = program_lower_bound_ms(relaxed)  # the programs' cost, not the closed form's fill
    work.charge(program_bound_units(relaxed.num_blocks, sum(c.stage_capable for c in relaxed.classes)))
    if found.placement is None:
        links = link_lower_bound(problem, within=work)
        work.charge(link_bound_units(problem.num_blocks))
        by, valid = _strongest({"fluid": fluid, _named(links): links.bound_ms})
        return dataclasses.replace(found, valid_bound_ms=valid, bound_by=by)
    starts = cheapest(problem, seen + [found.placement], within=work, cut=False)  # charged; every start priced
    pick = starts[0]
    program_ms = price_program(problem, pick).step_ms
    how = found.method if pick is found.placement else f"{found.method}, repriced"
    climb_s = (POLISH_SHARE if bounded else 1.0) * work.left_s()
    placement, polished_ms = _climbed(problem, starts, max(0.05, climb_s), shape != (None, None), work)
    if polished_ms < program_ms:
        program_ms, how = polished_ms, f"{how}, polished"
    grids_s = GRID_POLISH_SHARE * work.left_s()
    # The links a plan must cross (``bound.links``; its fill bound takes what it can afford of the work left).
    links = link_lower_bound(problem, within=work) if bounded else NO_LINK_BOUND
    if shape == (None, None):  # a fixed shape keeps its replicas
        # within the count's own work: time taken past it would be the later counts' and ``polish_best``'s
        mixed_s = min(MIXED_SHARE * climb_s, work.left_s())
        if mixed_s > MIXED_MIN_S:
            placement, program_ms, how = _mixed(problem, placement, program_ms, how, mixed_s, work)
    work.charge(mix_units(problem, placement))  # the count's own work: uncharged, the solve ran past its budget by it
    # the link bound's own work (its fill tests charged as they ran), after the mixed step: charged before it, the
    # step lost the 0.05 s it needs in test_monotone_pools seeds 9 and 13's 1 s plans
    work.charge(link_bound_units(problem.num_blocks) if bounded else 0.0)
    placement, program_ms = recompute.mix(problem, placement)
    # The grids count whatever their closed form, each shape's cheapest with its cuts polished as
    # ``--stages/--replicas`` would: a free search is never dearer than a grid it met. Their own budget, not the
    # search's, and beside its plan, not its hill-climb's start: where no grid wins, the plan stays as it was.
    grids = _polished_grids(problem, rivals, work.side(grids_s, "grids polished"), GRID_SPLIT_SHARE * time_limit_s)
    if problem.recompute:  # the ranking that counts is after ``recompute.mix``: the likeliest are mixed
        rival, rival_ms = _best_mixed(problem, list(dict.fromkeys(cheapest(problem, seen) + grids)),
                                      work.side(BEST_MIXED_SHARE * time_limit_s, "recomputation mixed"))
    else:
        rival, rival_ms = min(((g, price_program(problem, g).step_ms) for g in grids), key=lambda x: x[1],
                              default=(None, math.inf))
    if rival is not None and rival_ms < program_ms:
        placement, program_ms, how = rival, rival_ms, \
            f"{found.method}, a grid{' with recomputation mixed' if problem.recompute else ''} repriced"
    # The search's own bound holds for its problem; with recomputation, only the relaxation's hold for a mix.
    by, valid = _strongest({"fluid": fluid, "search": found.valid_bound_ms if relaxed is problem else 0.0,
                            _named(links): links.bound_ms})
    if bounded and program_ms - valid > gap_tolerance * program_ms:
        by, valid = _strongest({by: valid, "lagrange": program_bound_ms(relaxed, valid, cap_ms=program_ms,
                                                                         within=work, rel_tol=gap_tolerance)})
    return dataclasses.replace(found, placement=placement, method=how, program_ms=program_ms,
                               valid_bound_ms=min(valid, program_ms), bound_by=by,
                               solve_s=time.perf_counter() - start)


def _named(links: LinkBound) -> str:
    """The ``bound.counts.TERMS`` name of what limits ``bound.links``' bound (compute on its islands: ``islands``)."""
    return "islands" if links.limit == "compute" else links.limit


def _strongest(bounds: dict[str, float]) -> tuple[str, float]:
    """Of valid bounds by name (``bound.counts.TERMS``), the largest and its name (the first of equals)."""
    name = max(bounds, key=bounds.__getitem__)
    return name, bounds[name]


def _climbed(problem: Problem, starts: list[Placement], budget_s: float, cuts_only: bool,
             within: Work) -> tuple[Placement, float]:
    """The cheapest plan hill-climbing (``polish``) reaches from ``starts`` (cheapest program first): the cheapest
    start's climb as before, in ``budget_s`` charged to ``within``; then, in what it left of ``budget_s`` as a budget
    beside ``within`` (the steps after it keep what they had), each start of a shape (replicas per stage) not yet
    climbed until a local optimum (issue 36: a search that met one plan more, a (2, 2) stuck at 3,181 ms, no longer
    hides the (4, 4) that climbs to 2,243 ms)."""
    first = within.sub(budget_s, "polish")
    best, best_ms = polish(problem, starts[0], time_budget_s=budget_s, cuts_only=cuts_only, within=first)
    # charged with their replicas and verifiers (``placement_units``): ``program_units`` undercharged the
    # 176-device pool's climbs ~6x (95-104 s at a 30 s limit)
    more = within.side(first.left_s(), "polish, more starts")
    shapes = {_shape(starts[0])}
    for start in starts[1:CLIMB_STARTS]:
        if _shape(start) in shapes or more.passed():
            continue
        shapes.add(_shape(start))
        plan, ms = polish(problem, start, time_budget_s=more.left_s(), cuts_only=cuts_only, within=more,
                          units=placement_units)
        if ms < best_ms:
            best, best_ms = plan, ms
    return best, best_ms


def _shape(placement: Placement) -> tuple[int, ...]:
    return tuple(len(st.devices) for st in placement.stages)


def _mixed(problem: Problem, placement: Placement, program_ms: float, how: str, budget_s: float,
           within: Work) -> tuple[Placement, float, str]:
    """The mixed-replication search's plan (``search.mixed``) from ``placement``, polished, in ``budget_s`` of work
    charged to ``within``, where it costs less than ``placement``; else ``placement`` (its cost, how it was found)."""
    work = within.sub(budget_s, "mixed replication")
    got = mixed.search(problem, placement, program_ms, time_budget_s=budget_s, within=work)
    if got is None:
        return placement, program_ms, how
    plan, ms = polish(problem, got[0], time_budget_s=max(0.05, work.left_s()), within=work)
    return plan, ms, f"{how}, mixed replication"


def _polished_grids(problem: Problem, grids: list[Placement], within: Work, splits_s: float) -> list[Placement]:
    """``grids``, each also re-partitioned for its devices (cheapest first, in ``splits_s`` of work), and the
    cheapest of them of each shape (replicas per stage), cheapest shape first, with its cuts hill-climbed
    (``polish``, ``cuts_only``) until ``within`` is spent."""
    prices = {}
    for p in dict.fromkeys(grids):
        within.charge(program_units(p.num_microbatches, p.num_stages))
        prices[p] = price_program(problem, p).step_ms
    # a grid's even split can rank it last: each re-split, cheapest first, on a budget of its own (unbudgeted, the
    # splits took 11 of 36 s of CPU planning the 176-device pool at a 30 s limit)
    split = within.side(splits_s, "grids re-split")
    for p in repartitioned(problem, sorted(prices, key=prices.__getitem__), within=split):
        if p not in prices:
            within.charge(program_units(p.num_microbatches, p.num_stages))
            prices[p] = price_program(problem, p).step_ms
    by_shape: dict[tuple[int, ...], Placement] = {}
    for p in sorted(prices, key=prices.__getitem__):
        by_shape.setdefault(tuple(len(st.devices) for st in p.stages), p)
    out = list(prices)
    for p in by_shape.values():
        if within.passed():
            break
        out.append(polish(problem, p, time_budget_s=within.left_s(), cuts_only=True, within=within)[0])
    return out


# Plans of an all-recomputing problem mixed (``recompute.mix``) to pick the best: the likeliest by the closed form
# with no stage recomputing (``evaluate``: microseconds), the ``MIXED_PRICED`` first of them priced so (one pricing
# each), the ``MIXED`` cheapest mixed (a pricing per stage). Unbudgeted, it priced every plan of the pool: 1,957
# pricings, 3.6 s of CPU on test_one_cost's 12 recomputing plans at 2 s (each ~0.8 s of CPU in all).
MIXED = 8
MIXED_PRICED = 16
# Of a count's time limit, the work beside its own for the mixing (a fixed share: the search keeps its budget).
BEST_MIXED_SHARE = 0.3


def _best_mixed(problem: Problem, pool: list[Placement], within: Work) -> tuple[Placement | None, float]:
    """Of ``pool`` (plans of an all-recomputing problem), the ``MIXED`` cheapest without recomputation (of the
    closed form's likeliest), each mixed while ``within`` lasts (at least one); the cheapest mixed and its cost."""
    def off(p: Placement) -> Placement:
        return dataclasses.replace(p, stages=tuple(dataclasses.replace(st, recompute=False) for st in p.stages))

    def unrecomputed_ms(p: Placement) -> float:
        within.charge(placement_units(p))
        return price_program(problem, off(p)).step_ms

    likely = sorted(pool, key=lambda p: evaluate(problem, off(p)).step_ms)[:MIXED_PRICED]
    best: tuple[Placement | None, float] = (None, math.inf)
    for p in sorted(likely, key=unrecomputed_ms)[:MIXED]:
        if best[0] is not None and within.passed():
            break
        within.charge(mix_units(problem, p))
        mixed, ms = recompute.mix(problem, p)
        if ms < best[1]:
            best = (mixed, ms)
    return best


def mix_units(problem: Problem, placement: Placement) -> float:
    """``recompute.mix`` of ``placement``: a pricing, and one per stage where its stages recompute (each stage that
    fits without recomputation tried so)."""
    return (1 + (placement.num_stages if problem.recompute else 0)) * placement_units(placement)


def polish_best(best: Outcome, left_s: float, *, cuts_only: bool, within: Work | None = None) -> Outcome:
    """``best`` hill-climbed further in the time the microbatch counts left unused (those ruled out or proven
    early): each count's own hill-climb gets a small share, and the best count is where it pays."""
    if left_s <= 0.1:
        return best
    placement, ms = polish(best.problem, best.placement, time_budget_s=left_s, cuts_only=cuts_only, within=within)
    if ms >= best.program_ms:
        return best
    how = best.method if best.method.endswith("polished") else f"{best.method}, polished"
    return dataclasses.replace(best, placement=placement, program_ms=ms, method=how,
                               valid_bound_ms=min(best.valid_bound_ms, ms))


def beyond(problem: Problem, incumbent_ms: float, within: Work, *, mixes: bool = False) -> Outcome | None:
    """An unsearched outcome for ``problem`` where a valid bound of every plan of it (the fluid LP, then the fill
    bound tested at ``incumbent_ms``, the cost of a plan already found) is that cost or more: its search could not
    return a cheaper plan, and its share of the work goes to the bounds after the search. None where the bounds
    leave room. Charged to ``within``. ``mixes``: the bounds also hold for every mix of its stages with
    recomputation (its recomputing twin, which is then not searched either)."""
    if not math.isfinite(incumbent_ms):
        return None
    probe = recompute_problem(problem) if mixes else problem
    relaxed = bound_problem(probe)
    floor_ms = program_lower_bound_ms(relaxed)
    within.charge(program_bound_units(relaxed.num_blocks, sum(c.stage_capable for c in relaxed.classes)))
    by = "fluid"
    if floor_ms < incumbent_ms * (1 - 1e-9):
        floor_ms, by = fill_bound_ms(probe, floor_ms, within=within, cap_ms=incumbent_ms,
                                     rel_tol=BEYOND_REL_TOL), "fill"
    if floor_ms < incumbent_ms * (1 - 1e-9):
        return None
    return Outcome(problem=problem, placement=None, step_ms=math.inf, bound_ms=floor_ms, method="beyond",
                   cpsat_status=f"SKIPPED (no plan of it beats the {incumbent_ms:.3f} ms one found)", solve_s=0.0,
                   valid_bound_ms=floor_ms, bound_by=by)
