"""A lower bound on the compiled programs' cost from every stage replica's fill, at its own device's speed.

``program_cost`` prices each stage replica as a resource busy ``m period`` (``m`` microbatches, ``period >=``
its pass ``t``) plus the path outside it: its first microbatch's forward up to it and its last one's backward
from it through stage 0 (``fwd[first][k] + bwd[last][k]``, both on the microbatch's route), so ``step >= pipe >=
m t + fwd + bwd``. For a stage over blocks ``j..i-1`` with ``s`` stages before it, that path is at least ``U(j)``
(blocks ``0..j-1`` forward and backward, each at its least over the classes) and ``2 hops(s)`` (``s`` boundaries
each way, ``replicas.hops_ms``). So at a step of ``B`` a device of kind ``g`` runs at most ``floor((B - U(j) -
2 hops(s)) / t_g(j..i-1))`` of the stage's ``M`` microbatches, none where the stage's weights, state and one
microbatch's activations do not fit it, and the stage's devices run all ``M``. The fluid LP (``objective``) gives
every device the same ``B`` and any mix of speeds: here the replicas of a stage deep in the chain lose the fill
before it, at the speed of the devices that run it. A replicated stage's all-reduce fits ``B`` too
(``replicas.Rings``, as ``replicas`` prices it), and stage 0 and the last run on trusted devices where the ends
must be trusted (each at most a group's trusted devices; one fewer in a longer pipeline where only that group has
them: the other end holds one). Stage 0's last backward ends the pipeline, and its all-reduce and optimizer step
follow (``step >= pipe + AR_0 + optim_0``): every replica's budget is less the least optimizer step of any stage 0,
and stage 0's own replicas' less its own all-reduce and optimizer step (a tiny model on one GPU: the step is its
passes and its optimizer step, which this bound then is). Every other stage's all-reduce starts no sooner than
its replicas' first inputs plus all their own passes (``program_cost``; the simulator runs a rank's passes, then
its all-reduce, then its optimizer step), so each replica's passes also fit ``B`` less the blocks before it
forward at their least, ``hops(s)`` one way, the stage's all-reduce over the ring its devices make and its
optimizer step (its group's least): ``step >= arrival + m t + AR_k + optim_k``. The ring's size is what the
test counts, so the count is raised to a fixed point (``_after_passes``). Where replicas all-reduce across slow
links (DT-FM worldwide), this term binds.

Devices are counted in at most two *groups* of kinds (``fill_groups``). ``step >= B`` for the least ``B`` at which
some partition meets all this with the pool's devices: bisected, each test a DP over the blocks whose state is the
devices of one group used and either the stages so far (their hops) or the blocks so far on stages of the slow group
alone (their passes on the path at its speed, at least the least excesses over the fastest), of the fewest devices of
the other group. Where there are more kinds, each split of them by speed into a fast group and a slow one bounds every
plan, and the largest is kept (a pool of A100s and V100s: the V100s must run stages, and a stage of V100s deep in the
chain pays its fill at their speed).

Each term's proof is kept with its code: ``fill_dp`` (the feasibility test: stage 0's round trip, routes before
the last stage), ``fill_rows`` (its per-stage tables: the round trip after a stage, rings of both groups, rings no
island holds, in flight), ``fill_linked`` (links between one-device stages) and ``fill_groups`` (the groups).
"""
from __future__ import annotations

import math

from planner.solver.bound.fill_dp import REL_TOL, _Test
from planner.solver.bound.fill_groups import _Group, _kinds, _Shared
from planner.solver.bound.fill_linked import LINKED
from planner.solver.problem import Problem, bound_problem
from planner.solver.search.budget import UNITS_PER_S, Work, fill_units

# DP cells a test may cost at most (blocks^2 / 2 x tracked states x (first group's devices + 1)^2); a variant past
# it is skipped (no bound from it).
CELLS = 3_000_000
# DP cells all of a bound's tests may cost together (~1 s on one core): the splits after are skipped.
TOTAL_CELLS = 4_000_000
# Splits of the kinds (fastest first) into two groups tried at most.
MAX_SPLITS = 3
# Feasibility tests one test's bracket and bisection to ``REL_TOL`` take at most, for its cost up front.
TESTS_EACH = 24
# A test with replica states: its DP's cells are about this many plain ones' (for the cells caps), and its work is
# charged as this many plain tests (``budget.fill_units``): 4.0-10.2 ms of CPU a test on the DT-FM, SWARM- and
# Sailor-like pools (26 blocks), under a plain test's nominal 17.6-56.4 ms.
LINKED_CELLS = (LINKED + 1) ** 2
LINKED_COST = 1
# A DP run again for one stage count (stage 0's rows and the DP, its tables kept) is charged this share of a test:
# about 3 ms of CPU on the SWARM-like pool (23 tests and 56 runs again: 0.30 s, charged 0.65 s), a test 17.6.
RERUN_COST = 0.25


def fill_bound_ms(problem: Problem, floor_ms: float = 0.0, *, within: Work | None = None,
                  cap_ms: float | None = None, rel_tol: float = REL_TOL) -> float:
    """The bound of the module docstring (ms; ``floor_ms``, a bound known valid, where this one is no more).
    ``within``: the plan's work budget, charged each feasibility test (``fill_units``); a test it cannot afford
    in full is skipped (a weaker bound, still valid), so the bound never runs a plan past its time.
    ``cap_ms``: no bound above it is asked for (a plan of that cost is known: the least over counts is no more),
    so a test is bisected within ``[floor_ms, cap_ms]`` and first tried at ``cap_ms``, where a count whose plans
    all cost more is dismissed in one test; at most ``cap_ms`` returned where it is above ``floor_ms``.
    ``rel_tol``: the bisection's width (its infeasible end is returned: valid at any width, coarser is cheaper)."""
    # a recomputing problem's plans mix stages with and without it: those without hold every activation (``_per``)
    full_act = problem.tables(False).act_bytes if problem.recompute and problem.twin is not None else None
    problem = bound_problem(problem)
    stage = [c.index for c in problem.classes if c.stage_capable]
    cap_ms = cap_ms if cap_ms is not None and math.isfinite(cap_ms) else None  # no plan known: bisect as before
    if not stage or (cap_ms is not None and cap_ms <= floor_ms):
        return floor_ms
    kinds = _kinds(problem, stage)
    shared: _Shared | None = None  # built for the first test that runs: O(L^2 C), seconds at 1000 blocks
    best, spent = floor_ms, 0
    for cut in range(1, min(len(kinds), MAX_SPLITS + 1) + (len(kinds) == 1)):
        fast = _Group.of(problem, [c for k in kinds[:cut] for c in k])
        slow = _Group.of(problem, [c for k in kinds[cut:] for c in k])
        L = problem.num_blocks
        for track in ("stages", "slow") if slow.count else ("stages",):
            tracked = _Test.tracked(fast, slow, track)[0].count
            cells = (L + 1) ** 2 // 2 * (L + 1) * (tracked + 1) ** 2
            if cells > CELLS or spent + cells > TOTAL_CELLS:
                continue
            if cap_ms is not None and best >= cap_ms * (1 - 1e-9):
                break  # at the cap: no test asks more
            each = fill_units(L, fast.count + slow.count)
            tests = TESTS_EACH if cap_ms is None else min(TESTS_EACH, _capped_tests(best, cap_ms, rel_tol))
            if within is not None and within.left_s() * UNITS_PER_S < tests * each:
                continue
            shared = shared or _Shared.of(problem, stage)
            # replica states where a link may bind and the cells and budget afford them (else the plain DP)
            linked = shared.route is not None and track == "stages" and cells * LINKED_CELLS <= CELLS \
                and spent + cells * LINKED_CELLS <= TOTAL_CELLS \
                and (within is None or within.left_s() * UNITS_PER_S >= tests * each * LINKED_COST)
            spent += cells * (LINKED_CELLS if linked else 1)
            test = _Test(problem, stage, fast, slow, track, shared, linked=linked, full_act=full_act)
            best = max(best, test.least_ms(best, cap_ms, rel_tol))
            if within is not None:
                within.charge((test.tests + (LINKED_COST - 1) * test.linked + math.ceil(RERUN_COST * test.reruns))
                              * each)
    return best


def _capped_tests(floor_ms: float, cap_ms: float, rel_tol: float = REL_TOL) -> int:
    """Tests ``_Test.least_ms`` runs at most within ``[floor_ms, cap_ms]``: the cap, the floor, then halving the
    bracket to ``rel_tol`` of the cap."""
    width = max(cap_ms - floor_ms, 0.0) / max(rel_tol * cap_ms, 1e-300)
    return 2 + max(0, math.ceil(math.log2(max(width, 1.0))))
