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

**The round trip after a stage.** A replica's passes start no sooner than its first input (``A``), and a
microbatch's backward there needs its forward there and then its round trip after the stage: every block after
it forward and back (at least ``U(L) - U(i)``) and, where a stage follows, a crossing each way (``hops(1)`` each:
a route's devices are distinct). One device runs one pass at a time, so with ``m`` microbatches, forward ``f`` and
backward ``b`` (its group's least) and that round trip ``D``, its last backward ends no sooner than ``A + m f + D +
b`` (the last forward to end, then its round trip and backward) nor ``A + f + D + m b`` (no backward before the
first forward's round trip), as well as ``A + m t``: each replica's count is also at most what these fit in the
budget ``m t`` had (``_per``), whatever follows it. Binds where ``D`` outweighs ``(m - 1)`` forwards: few
microbatches a replica, a long or slow chain after it (random wide-area pools: up to +30%).
**Rings of both groups.** Where some partition of the pool into islands (``islands.partitions``) has each island
holding one group's classes only (A100 hosts and V100 hosts), a stage with devices of both groups has two
replicas in different islands, so its ring uses a link between islands: its all-reduce is at least ``Rings``'
line for the fastest and quickest such link (``_mixed_lines``), where the DP knows it holds both (``y`` of group
``a`` and at least one of ``b``: the fixed point's count, an exact count, stage 0's ``r - y``); else the ring's
floor as before (Sailor-like: 646.9 -> 661.3 ms).
**Rings no island holds.** At any partition into islands, a stage of ``y`` devices of group ``a`` and ``w`` of
``b`` that no island holds together (``islands.spans``: more A100s than a host of four; more V100s than a zone has
beside its A100s) has replicas in two islands, so its ring uses a link between them: its all-reduce is at least
that link's line (``_island_lines``), read at the same counts as the mixed rings (the fixed point's, an exact
count, stage 0's ``r - y``; both lines rise with ``y`` and ``w``, so a count no more than the plan's gives a
floor no more than its). Sailor-like: 661.3 -> 678.4 ms (a stage of eight A100s no longer rings at NVLink speed).
**In flight.** A device holds at most the microbatches its memory has room for in flight (``_per``: the
compiler places a forward only below that), so its first backward waits ``f + trip`` with ``n`` forwards at most
run, and its last forward leaves ``n`` backwards at most: ``f + trip + m b + (m - n) f`` and ``m f + (m - n) b +
trip + b`` fit its budget too. A recomputing problem's stage may hold every activation at the plain times or only
its blocks' inputs at the recomputing ones: each device's count is the better of the two.
**Stage 0's round trip.** In a plan of ``S`` stages stage 0's first gradient comes back over every crossing of the
route, at least ``last(S - 1)`` each way (``hops_ms`` ``to_last``), not one: where the DP (counting stages) lets a
plan of ``S`` stages through, it runs again with stage 0's rows at that round trip and only those plans ending
(``_Test.feasible``; each such run charged ``RERUN_COST`` of a test). SWARM-like: a T4 holding the embedding and six layers has
room for 18 of its 32 microbatches and its gradients cross four volunteers' links each way: 7,622.3 -> 7,688.2 ms.
**Routes before the last stage.** Where the ends must be trusted and every island holding a trusted stage device
holds two or more, a route's devices before the last stage's make one crossing inside an island fewer than
``hops`` allows (``replicas.spare``): the last stage's device is trusted, so its island has at most one device
less on the route before it. A stage before the last pays these ``before`` hops on its path; the last, ``last``:
where one island ``H`` holds every trusted stage device, a route of more than ``|H|`` stages starts and ends in
``H`` and leaves it, one crossing fewer inside (``hops_ms`` ``to_last``).
**Links between one-device stages.** Where no crossing before the last stage's can stay inside an island at some
partition (``replicas.slow_route``: one-GPU hosts; a trusted host of two between volunteers), every boundary into
a stage before the last is a link between islands, at least ``w`` ms of wire per (smallest) message. A stage at
depth ``z`` with ``r`` replicas after one of ``p`` receives the ``M`` activations over at most ``p r`` device pairs,
so one pair is busy ``ceil(M / (p r)) w``: it sends no sooner than the first microbatch's forward through blocks
``0..j-1`` and ``z - 1`` crossings, and after its last message the microbatch still waits its latency, runs the
blocks after ``j`` forward and every block backward (``U(L)`` with the blocks before), crosses at least once more
forward and back over its whole route (``S - 1 >= z + 1`` crossings from the last stage: ``last(z + 1)``), and
stage 0's optimizer step follows: ``step >= U(L) + before(z - 1) + ceil(M / (p r)) w + lat + hops(1) + last(z +
1) + optim``. A replicated stage's all-reduce waits for that microbatch too: after the message it runs every
block from the stage forward and back to it, crosses at least once each way, then the all-reduce over ``r`` and
the stage's optimizer step (``_after_link``). The DP then also holds the replica count of the stage so far (1 to ``LINKED``, or more), each stage of exactly ``c``
replicas checked with its all-reduce over ``c`` (``_exact``), and ``p r`` at least what the link needs
(``_feasible_linked``): four one-GPU hosts on 0.1 Gb/s with large boundaries, 19.5 -> 45.4 s, the best plan 45.4.

Devices are counted in at most two *groups* of kinds: a group's time per block is its members' least, its memory
their largest, its devices and trusted devices their sums, so every plan is a plan of the grouped pool and a bound
on that bounds it. ``step >= B`` for the least ``B`` at which some partition meets all this with the pool's
devices: bisected, each test a DP over the blocks whose state is the devices of one group used and either the
stages so far (their hops) or the blocks so far on stages of the slow group alone (their passes on the path at
its speed, at least the least excesses over the fastest), of the fewest devices of the other group. Where there
are more kinds, each split of them by speed into a fast group and
a slow one bounds every plan, and the largest is kept (a pool of A100s and V100s: the V100s must run stages,
and a stage of V100s deep in the chain pays its fill at their speed).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from planner.solver.bound.islands import COMPRESSED_ALLREDUCE, partitions, spans
from planner.solver.bound.replicas import Rings, hops_ms, slow_route
from planner.solver.problem import Problem, bound_problem
from planner.solver.search.budget import UNITS_PER_S, Work, fill_units

# DP cells a test may cost at most (blocks^2 / 2 x tracked states x (first group's devices + 1)^2); a variant past
# it is skipped (no bound from it).
CELLS = 3_000_000
# DP cells all of a bound's tests may cost together (~1 s on one core): the splits after are skipped.
TOTAL_CELLS = 4_000_000
# Relative width the bisection stops at (the bound is its infeasible end: valid whatever the width).
REL_TOL = 1e-5
# Splits of the kinds (fastest first) into two groups tried at most.
MAX_SPLITS = 3
# Feasibility tests one test's bracket and bisection to ``REL_TOL`` take at most, for its cost up front.
TESTS_EACH = 24
# Rounds of raising a stage's devices by its all-reduce at the ring size they make (each round's count is valid).
ROUNDS = 8
# Replica counts a stage's state holds exactly where boundaries are links between islands (``_feasible_linked``;
# more is one state).
LINKED = 3
# A test with replica states: its DP's cells are about this many plain ones' (for the cells caps), and its work is
# charged as this many plain tests (``budget.fill_units``): 4.0-10.2 ms of CPU a test on the DT-FM, SWARM- and
# Sailor-like pools (26 blocks), under a plain test's nominal 17.6-56.4 ms.
LINKED_CELLS = (LINKED + 1) ** 2
LINKED_COST = 1
# A device's passes within the round trip after its stage (``_per``); off: the bound without that term (tests).
ROUND_TRIP = True
# Rings no island holds whole pay a link between islands (``_island_lines``); off: the bound without them (tests).
ISLANDS = True
# Stage 0's round trip crosses to the last stage and back (``_Test.feasible``, per count of stages); off: one crossing
# each way, as every other stage's (tests).
STAGE0_TRIP = True
# A device holds at most the microbatches its memory has room for in flight (``_per``); off: no such cap (tests).
IN_FLIGHT = True
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


def _kinds(problem: Problem, stage: list[int]) -> list[list[int]]:
    """Stage classes of the same times and memory, fastest kind first."""
    by: dict[tuple, list[int]] = {}
    for c in stage:
        by.setdefault((problem.time_ms[:, c].tobytes(), problem.classes[c].mem_bytes), []).append(c)
    return sorted(by.values(), key=lambda k: float(problem.time_ms[:, k[0]].sum()))


@dataclass(frozen=True, slots=True, eq=False)
class _Shared:
    """What every test of one bound reads alike: per stage class its optimizer step per stage ``j..i-1``
    (``_optim_ms``), the least hops one way (``replicas.hops_ms``), and the rings of the pool's stage devices."""

    optim: dict[int, np.ndarray]
    hops: np.ndarray
    ring: Rings
    middle_ring: Rings
    before: np.ndarray  # the least hops one way among the devices before the last stage's (``before_last``)
    last: np.ndarray  # the least hops one way from stage 0 to the last stage (``to_last``)
    route: tuple[float, float] | None  # ``replicas.slow_route``: every boundary before the last between islands

    @staticmethod
    def of(problem: Problem, stage: list[int]) -> _Shared:
        devices = min(problem.num_microbatches, sum(problem.classes[c].count for c in stage))
        pol = problem.policy
        ends = pol.enabled and pol.trusted_endpoints
        L = problem.num_blocks
        return _Shared({c: _optim_ms(problem, (c,)) for c in stage}, hops_ms(problem, stage, L),
                       Rings(problem, stage, devices), Rings(problem, stage, devices, reserved=2 if ends else 0),
                       hops_ms(problem, stage, L, before_last=True), hops_ms(problem, stage, L, to_last=True),
                       slow_route(problem, stage))


@dataclass(frozen=True, slots=True, eq=False)
class _Group:
    """Stage classes counted together (module docstring): per block their least pass (prefix sums) and least
    forward plus least backward, their largest memory, their devices and trusted devices."""

    prefix: np.ndarray
    path: np.ndarray
    mem: float
    count: int
    trusted: int
    classes: tuple[int, ...] = ()
    fwd: np.ndarray | None = None  # prefix sums of the least forward per block (None: no devices)
    bwd: np.ndarray | None = None  # and of the least backward

    @staticmethod
    def of(problem: Problem, classes: list[int]) -> _Group:
        L = problem.num_blocks
        if not classes:
            return _Group(np.zeros(L + 1), np.full(L, np.inf), 0.0, 0, 0)
        bwd = problem.time_ms * (2.0 / 3.0) if problem.bwd_ms is None else problem.bwd_ms
        path = (problem.time_ms - bwd)[:, classes].min(axis=1) + bwd[:, classes].min(axis=1)
        t = problem.time_ms[:, classes].min(axis=1)
        fwd, back = ((problem.time_ms - bwd)[:, classes].min(axis=1), bwd[:, classes].min(axis=1))
        return _Group(np.concatenate([[0.0], np.cumsum(t)]), path,
                      float(max(problem.classes[c].mem_bytes for c in classes)),
                      sum(problem.classes[c].count for c in classes),
                      sum(problem.classes[c].count for c in classes if problem.classes[c].trusted), tuple(classes),
                      np.concatenate([[0.0], np.cumsum(fwd)]), np.concatenate([[0.0], np.cumsum(back)]))


class _Test:
    """Whether a step of ``B`` admits a partition (module docstring). The DP's state: blocks covered, devices of
    group ``a`` (``tracked``) used, and ``z``: the stages so far (``track="stages"``: the path before a
    stage pays ``2 hops(z)``) or the blocks so far on stages of group ``b`` alone (``track="slow"``: their passes
    on the path are ``b``'s, at least the ``z`` least excesses over the least pass of the blocks before).

    What a test reads of each stage ``j..i-1`` and state ``z`` that no ``B`` changes (its groups' pass times and
    memory fit, device caps, optimizer steps, all-reduce floors per ring size) is tabled once (``_Rows``); a
    test is then a few vector operations over every (stage, state, count) at once, and the DP over the blocks."""

    def __init__(self, problem: Problem, stage: list[int], fast: _Group, slow: _Group, track: str,
                 shared: _Shared | None = None, *, linked: bool = True, full_act: np.ndarray | None = None) -> None:
        """``full_act``: where ``problem`` is a recomputing problem's relaxation (``bound_problem``), the activations
        a stage without recomputation holds (its stages may be either: ``_nb`` takes the better)."""
        L, M = problem.num_blocks, problem.num_microbatches
        self.L, self.M, self.track = L, M, track
        self.tests = 0   # feasibility tests run (their work charged to the plan's budget)
        self.linked = 0  # of them, with replica states (``_feasible_linked``: charged ``LINKED_COST`` plain ones)
        self.reruns = 0  # DPs run again per stage count (stage 0's round trip: charged ``RERUN_COST`` of a test)
        self.a, self.b = self.tracked(fast, slow, track)
        pol = problem.policy
        self.ends = pol.enabled and pol.trusted_endpoints
        need = problem.param_count.astype(float) * problem.state_bytes_per_param + problem.act_bytes
        self.need = np.concatenate([[0.0], np.cumsum(need)])
        # a stage's state and one microbatch's activations, apart (``_Rows.slots``)
        self.state = np.concatenate([[0.0], np.cumsum(problem.param_count.astype(float) * problem.state_bytes_per_param)])
        self.act = np.concatenate([[0.0], np.cumsum(problem.act_bytes.astype(float))])
        self.mixed_recompute = full_act is not None
        self.act_full = self.act if full_act is None else np.concatenate([[0.0], np.cumsum(full_act.astype(float))])
        self.params = np.concatenate([[0.0], np.cumsum(problem.param_count.astype(float))]) \
            * problem.grad_bytes_per_param
        least = np.minimum(fast.path, slow.path)
        self.U = np.concatenate([[0.0], np.cumsum(least)])
        # Stage 0's optimizer step follows the pipeline (``step >= pipe + optim_0``): blocks 0..i-1 for stage 0
        # itself, the least of any stage 0 for the others.
        shared = _Shared.of(problem, stage) if shared is None else shared
        self.opt0 = np.min([shared.optim[c][0] for c in stage], axis=0)
        self.opt_any = float(self.opt0[1:].min())
        # A stage before the last crosses only boundaries among the devices before the last stage's
        # (``shared.before``); the last stage's path, from stage 0 to it (``shared.last``).
        j = np.arange(L + 1)[:, None]
        if track == "stages":
            self.extra, self.extra_last = (np.where(j > 0, 2 * h[None, :L + 1], 0.0)
                                           for h in (shared.before, shared.last))
        else:  # the z least excesses of the slow group's passes among blocks 0..j-1
            excess = np.full((L + 1, L + 1), np.inf)
            for e in range(L + 1):
                excess[e, :e + 1] = np.concatenate([[0.0], np.cumsum(np.sort(slow.path[:e] - least[:e]))])
            self.extra, self.extra_last = (excess + np.where(j > 0, 2 * h[1], 0.0) for h in (shared.before, shared.last))
        self.ring, self.middle_ring = shared.ring, shared.middle_ring
        # A stage's all-reduce and optimizer step follow its own passes, which start once its first microbatch's
        # forward is in: blocks 0..j-1 forward at their least and the hops before it, one way.
        bwd = problem.time_ms * (2.0 / 3.0) if problem.bwd_ms is None else problem.bwd_ms
        self.F = np.concatenate([[0.0], np.cumsum((problem.time_ms - bwd)[:, stage].min(axis=1))])
        self.Bw = np.concatenate([[0.0], np.cumsum(bwd[:, stage].min(axis=1))])
        self.before, self.hop = shared.before, float(shared.hops[1]) if L >= 1 else 0.0
        self.last = shared.last
        self.arrive, self.arrive_last = (np.where(j > 0, h[None, :L + 1] if track == "stages" else h[1], 0.0)
                                         for h in (shared.before, shared.last))
        # Two single-device stages in a row (``_feasible_linked``): every activation on one link (``route``).
        self.route = shared.route if linked and track == "stages" and L > 2 else None
        self.rest = None if self.route is None else self.U[L] + np.concatenate([[np.inf], shared.before[:L]]) \
            + np.concatenate([shared.last[1:], [np.inf]]) + shared.hops[1] + self.route[1] + self.opt_any
        self.optim = [np.min([shared.optim[c] for c in g.classes], axis=0) if g.classes
                      else np.zeros((L + 1, L + 1)) for g in (self.a, self.b)]
        self.mixed = _mixed_lines(problem, stage, self.a, self.b, len(shared.ring.none))
        self.islands = _island_lines(problem, stage, self.a, self.b, len(shared.ring.none)) if ISLANDS else ()
        self.rows = _Rows.of(self)
        self._pair_i = np.repeat(np.arange(1, L + 1), np.arange(1, L + 1))  # each stage's end
        self._ar_rest = self._after_link() if self.route is not None else None

    @staticmethod
    def tracked(fast: _Group, slow: _Group, track: str) -> tuple[_Group, _Group]:
        """(group ``a``, whose devices the DP counts, group ``b``): ``a`` the fast one where the slow path is
        tracked (a stage of ``b`` alone is one without ``a``'s devices), else the smaller (none for one kind)."""
        if not slow.count:
            return _Group(np.zeros_like(fast.prefix), np.full(len(fast.path), np.inf), 0.0, 0, 0), fast
        return (fast, slow) if track == "slow" or fast.count <= slow.count else (slow, fast)

    def least_ms(self, floor_ms: float, cap_ms: float | None = None, rel_tol: float = REL_TOL) -> float:
        """The least ``B`` this test cannot rule out, less a hair (``floor_ms`` where it rules out none above); with
        ``cap_ms`` above ``floor_ms``, no more than it, less a hair: the cap tried first (where it is ruled out, so
        is every ``B`` below it), then the floor, then the bracket between them halved."""
        lo = floor_ms
        if cap_ms is not None and cap_ms > floor_ms:
            if not self.feasible(cap_ms):
                return cap_ms * (1 - 1e-9)
            if self.feasible(lo):
                return floor_ms
            hi = cap_ms
        else:
            if self.feasible(lo):
                return floor_ms
            hi = max(2 * lo, float(self.U[-1]) + 1.0)
            while not self.feasible(hi):
                if hi > 1e12:
                    return floor_ms
                lo, hi = hi, 2 * hi
        while hi - lo > rel_tol * hi:
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if self.feasible(mid) else (mid, hi)
        return lo * (1 - 1e-9)

    def feasible(self, B: float) -> bool:
        """Whether some partition meets ``B`` with the pool's devices: blocks in order, per state the fewest
        devices of group ``b``."""
        self.tests += 1
        linked = self.route is not None and np.any(self.M * self.route[0] + self.rest[1:self.L] > B)
        if linked:
            self.linked += 1  # a link may bind: the DP with replica states
            nb = self._linked_rows(B)
            ends = self._run_linked(nb)
        else:
            fewest = self._fewest(B)  # (stages, Z, NA + 1), stage j..i-1 at i (i - 1) / 2 + j
            ends = self._run(fewest)
        ok = ends <= self.b.count  # (..., Z): per count of stages (or slow blocks) at the end
        if self.track != "stages" or not STAGE0_TRIP or not ROUND_TRIP or not ok.any():
            return bool(ok.any())
        # An S-stage plan's stage 0 waits its first gradient's round trip over S - 1 crossings each way: the DP again
        # with stage 0's rows at that trip, its plans of S stages (each count the first DP let through, fewest first)
        for S in np.flatnonzero(ok.reshape(-1, ok.shape[-1]).any(axis=0)):
            if S < 2:
                return True  # one stage: no round trip
            self.reruns += 1
            first = self._first(B, int(S))
            if linked:
                self._put_first(nb, self._first_by_r)
                if (self._run_linked(nb)[..., S] <= self.b.count).any():
                    return True
            else:
                fewest[self.rows.firsts, 0] = first
                if (self._run(fewest)[..., S] <= self.b.count).any():
                    return True
        return False

    def _run(self, fewest: np.ndarray) -> np.ndarray:
        """The DP of ``feasible`` over the stages' fewest devices of group ``b`` (``_fewest``): per count ``x`` of
        group ``a``'s devices and end state, the fewest of ``b``'s covering every block."""
        L, NA, Z = self.L, self.a.count, self.L + 1
        best = np.full((L + 1, NA + 1, Z), np.inf)
        best[0, 0, 0] = 0.0
        reached = np.zeros(L + 1, dtype=bool)
        reached[0] = True
        alone = self.track == "slow" and self.b.count > 0  # y = 0: a stage of group b alone
        for i in range(1, L + 1):
            js = np.flatnonzero(reached[:i])
            if not len(js):
                continue
            nb = fewest[i * (i - 1) // 2 + js, :i]  # (J, z, NA + 1): states z <= j < i, the others unreached
            came = best[js, :, :i]
            every = (came[:, :, :, None] + nb[:, None, :, :]).min(axis=0)  # (x, z, y): to x + y
            for y in range(1 if alone else 0, NA + 1):
                if self.track == "stages":
                    np.minimum(best[i, y:, 1:i + 1], every[:NA + 1 - y, :, y], out=best[i, y:, 1:i + 1])
                else:
                    np.minimum(best[i, y:, :i], every[:NA + 1 - y, :, y], out=best[i, y:, :i])
            if alone:  # its blocks join the slow path: state z to z + i - j
                cand = came + nb[:, None, :, 0]
                z = np.arange(Z)[None, :] - (i - js)[:, None]
                padded = np.concatenate([cand, np.full(cand.shape[:2] + (1,), np.inf)], axis=2)
                at = np.broadcast_to(np.where((z >= 0) & (z < i), z, i)[:, None, :], cand.shape[:2] + (Z,))
                np.minimum(best[i], np.take_along_axis(padded, at, axis=2).min(axis=0), out=best[i])
            reached[i] = np.isfinite(best[i]).any()
        return best[L]

    def _linked_rows(self, B: float) -> list[list[np.ndarray]]:
        """The tables of ``feasible``'s DP (``_run_linked``; per replica state the previous stage left, per replica
        count of the stage) where every boundary into a stage before the last is a link between islands (``route``:
        ``w`` ms of wire per message, its latency): the DP's states also hold the replicas of the stage so far
        (1 to ``LINKED``, or more). A stage at depth ``z`` (not the last) with ``r`` replicas after one of ``p``
        gets every activation over at most ``p r`` device pairs, one of them busy ``ceil(M / (p r)) w``: its first
        message is sent no sooner than the first microbatch's forward through the stages before (``before(z -
        1)`` hops), and its last one's microbatch then still crosses it (latency), the blocks after it forward and
        every block backward, a hop forward and its whole route back (``last(S - 1) >= last(z + 1)``),
        and stage 0's optimizer step follows (``rest``): ``p r`` is at least the least with ``ceil(M / (p r)) w +
        rest(z) <= B``. A plan's stage of exactly ``r`` replicas (``y`` of group ``a``) has ``r - y`` of group
        ``b``, at least the fewest (``_fewest``); of more than ``LINKED``, more than ``LINKED - y``: each state's
        count is so no more than the plan's, and the DP no stricter than the plans."""
        L, NA, M, K = self.L, self.a.count, self.M, LINKED + 1
        exact = self._exact(B)  # per replica count: (stages, Z, NA + 1); stage 0's by ``_first`` (through _fewest)
        by_r = self._first_by_r  # stage 0: (L, r = 1..top + more, Y)
        y = np.arange(NA + 1)[None, None, :]
        with np.errstate(divide="ignore", invalid="ignore"):
            per = np.floor((B - self.rest) / self.route[0])
            pairs = np.where(per >= 1, np.ceil(M / np.maximum(per, 1)), np.inf)[None, :, None]  # (Z,): the link's
        before_last = (self._pair_i < L)[:, None, None]
        nb = []
        for p in range(1, K + 1):  # the state the previous stage left (K: more than LINKED, or none)
            if p == K:
                row = [e.copy() for e in exact]
            else:
                row = [np.where(before_last & (p * c < pairs), np.inf, e) for c, e in enumerate(exact[:-1], 1)]
                row.append(np.where(before_last, np.maximum(exact[-1], np.ceil(pairs / p) - y), exact[-1]))
                for c in range(2, K + 1):  # a replicated stage's all-reduce after the busiest pair into it
                    most = c if c < K else max(self.rows.top, K)
                    late = self._ar_rest[c - 2] + np.ceil(M / (p * most)) * self.route[0] > B
                    row[c - 1] = np.where(before_last & late[:, :, None], np.inf, row[c - 1])
            for out in row:
                out[self.rows.firsts] = np.inf
            nb.append(row)
        self._put_first(nb, by_r)
        return nb

    def _put_first(self, nb: list[list[np.ndarray]], by_r: np.ndarray) -> None:
        """Stage 0's rows (``_first``'s per replica count) into ``_linked_rows``' tables: it follows no stage."""
        K = LINKED + 1
        for c in range(1, K + 1):
            nb[K - 1][c - 1][self.rows.firsts, 0] = by_r[:, c - 1] if c < K else by_r[:, K - 1:].min(axis=1)

    def _run_linked(self, nb: list[list[np.ndarray]]) -> np.ndarray:
        """The DP of ``_linked_rows``' tables: per replica state, count of group ``a``'s devices and count of
        stages at the end, the fewest of group ``b``'s covering every block."""
        L, NA, Z, K = self.L, self.a.count, self.L + 1, LINKED + 1
        best = np.full((L + 1, K, NA + 1, Z), np.inf)
        best[0, K - 1, 0, 0] = 0.0
        reached = np.zeros(L + 1, dtype=bool)
        reached[0] = True
        for i in range(1, L + 1):
            js = np.flatnonzero(reached[:i])
            if not len(js):
                continue
            at = i * (i - 1) // 2 + js
            for was in range(K):
                came = best[js, was, :, :i]
                if not np.isfinite(came).any():
                    continue
                for now in range(K):
                    every = (came[:, :, :, None] + nb[was][now][at, :i][:, None, :, :]).min(axis=0)
                    for yy in range(NA + 1):
                        np.minimum(best[i, now, yy:, 1:i + 1], every[:NA + 1 - yy, :, yy],
                                   out=best[i, now, yy:, 1:i + 1])
            reached[i] = np.isfinite(best[i]).any()
        return best[L]

    def _after_link(self) -> list[np.ndarray]:
        """Per replica count ``c = 2..LINKED + 1`` (index ``c - 2``; the last: more), per stage after stage 0 and
        state (``(stages, Z)``, inf where none), what follows a message into it (``_feasible_linked``) up to its
        all-reduce's end: the blocks before it forward and the crossings before it, then (after the message) its
        latency, every block from it forward and back to it, a crossing each way, its all-reduce over ``c`` and
        its optimizer step."""
        rows, n, L = self.rows, self.rows.inner, self.L
        pair = rows.pair[:n]
        i = self._pair_i[pair]
        j = pair - i * (i - 1) // 2
        z = rows.cell[:n] % (L + 1)
        base = self.F[L] + self.Bw[L] - self.Bw[j] + self.before[np.maximum(z - 1, 0)] + self.route[1] \
            + 2 * self.hop + np.minimum(rows.opt_a[:n], rows.opt_b[:n])
        out = []
        for c in range(2, LINKED + 2):
            full = np.full(L * (L + 1) // 2 * (L + 1), np.inf)
            if c <= rows.top:
                full[rows.cell[:n]] = base + rows.floors[pair, c]
            out.append(full.reshape(-1, L + 1))
        return out

    def _exact(self, B: float) -> list[np.ndarray]:
        """Per replica count ``c = 1..LINKED`` (and one more: more than ``LINKED``), per stage after stage 0, state
        and count ``y`` of group ``a``'s devices, group ``b``'s devices a stage of exactly ``c`` replicas has where
        its passes, all-reduce over ``c`` and optimizer step fit ``B`` (as ``_after_passes`` at ring size ``c``;
        inf: not); of more, the fewest of group ``b`` whose passes fit beside the all-reduce over ``LINKED + 1``,
        no more than any larger ring's (the floors rise with the ring)."""
        rows, Y, n, K = self.rows, self.a.count + 1, self.rows.inner, LINKED + 1
        fewest = self._fewest(B)[rows.pair[:n], np.asarray(rows.cell[:n] % (self.L + 1))]  # any ring's fixed point
        at = np.arange(n)
        y = np.arange(Y)[None, :]
        slack = B - rows.U[:n] - rows.extra[:n] - self.opt_any
        room = B - rows.F[:n] - rows.arrive[:n]
        out = []
        for c in range(1, K + 1):
            if c > rows.top:
                out.append(np.full((self.L * (self.L + 1) // 2, self.L + 1, Y), np.inf))
                continue
            # y of a, c - y or, past LINKED, at least K - y of b (the floors rise with both)
            floor = rows.floor(rows.pair[:n, None], y, np.maximum(c - y, 0))
            slacks = [np.minimum(slack[:, None], room[:, None] - opt[:n, None] - floor)
                      for opt in (rows.opt_a, rows.opt_b)]
            nb = np.maximum(self._nb(np.broadcast_to(at[:, None], floor.shape), slacks[0], slacks[1], y), fewest)
            if c < K:
                nb = np.where((nb <= c - y) & (c - y <= rows.cap_b[:n, None]) & (floor <= B), c - y, np.inf)
            else:
                nb = np.maximum(nb, K - y)
                nb = np.where((nb <= rows.cap_b[:n, None]) & (floor <= B), nb, np.inf)
            full = np.full((self.L * (self.L + 1) // 2 * (self.L + 1), Y), np.inf)
            full[rows.cell[:n]] = nb
            out.append(full.reshape(-1, self.L + 1, Y))
        return out

    def _fewest(self, B: float) -> np.ndarray:
        """Per stage ``j..i-1``, state ``z`` and count ``y`` of group ``a``'s devices on it, the fewest of group
        ``b``'s devices that run its ``M`` microbatches within ``B`` (inf: none will do; states no DP reaches:
        inf)."""
        rows, Y, n = self.rows, self.a.count + 1, self.rows.inner
        slack = B - rows.U[:n] - rows.extra[:n] - self.opt_any
        y = np.arange(Y)[None, :]
        nb = self._after_passes(B, slack, self._nb(np.arange(n), slack, slack, y))
        w = np.where(np.isfinite(nb), nb, 0).astype(int)
        nb = np.where(rows.floor(rows.pair[:n, None], y, w) <= B, nb, np.inf)  # r = 0, 1: no all-reduce (0)
        out = np.full((self.L * (self.L + 1) // 2 * (self.L + 1), Y), np.inf)
        out[rows.cell[:n]] = nb
        out = out.reshape(-1, self.L + 1, Y)
        out[rows.firsts, 0] = self._first(B)
        return out

    def _nb(self, at: np.ndarray, slack_a: np.ndarray, slack_b: np.ndarray, y: np.ndarray,
            trip: np.ndarray | None = None) -> np.ndarray:
        """Per row of ``rows`` (``at``; their slacks per group, one per row or per row and count ``y``), the fewest
        of group ``b``'s devices whose passes fit (the all-reduce aside; inf: none will do); ``trip``: the round
        trip after each (default the rows')."""
        rows, M = self.rows, self.M
        trip = rows.trip[at] if trip is None else trip
        per_a = _per(rows.t_a[at], rows.pos_a[at], rows.fits_a[at], slack_a, M, rows.f_a[at], rows.b_a[at], trip,
                     rows.slots_a[at])
        pb = _per(rows.t_b[at], rows.pos_b[at], rows.fits_b[at], slack_b, M, rows.f_b[at], rows.b_b[at], trip,
                  rows.slots_b[at])
        if self.mixed_recompute:  # or the stage recomputes: each backward runs its forward again, activations apart
            per_a = np.maximum(per_a, _per(rows.t_a[at] + rows.f_a[at], rows.pos_a[at], rows.fits_a[at], slack_a, M,
                                           rows.f_a[at], rows.b_a[at] + rows.f_a[at], trip, rows.slots_ra[at]))
            pb = np.maximum(pb, _per(rows.t_b[at] + rows.f_b[at], rows.pos_b[at], rows.fits_b[at], slack_b, M,
                                     rows.f_b[at], rows.b_b[at] + rows.f_b[at], trip, rows.slots_rb[at]))
        if per_a.ndim < y.ndim:
            per_a, pb = per_a[..., None], pb[..., None]
        short = np.maximum(M - y * per_a, 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            nb = np.where(short == 0, 0.0, np.where(pb > 0, np.ceil(short / np.maximum(pb, 1)), np.inf))
        cap_a, cap_b = rows.cap_a[at], rows.cap_b[at]
        if cap_a.ndim < nb.ndim:
            cap_a, cap_b = cap_a[..., None], cap_b[..., None]
        return np.where((y <= cap_a) & (nb <= cap_b), nb, np.inf)

    def _end_cap(self, g: _Group, js: np.ndarray, i: np.ndarray) -> np.ndarray:
        """Devices of ``g`` an end stage may hold: its trusted ones, less one where the other end is another stage
        and only ``g`` has trusted devices (that end holds one of them)."""
        other = self.b if g is self.a else self.a
        return np.where((js == 0) & (i == self.L), g.trusted, g.trusted - (other.trusted == 0 and g.trusted > 0))

    def _first(self, B: float, stages: int | None = None) -> np.ndarray:
        """Stage 0 over blocks ``0..i-1`` (per ``i``): per count ``y`` of group ``a``'s devices, the fewest of group
        ``b``'s. Its last backward ends the pipeline, and its all-reduce and optimizer step follow (``step >= pipe
        + AR_0 + optim_0``): each replica's passes fit ``B`` less both, the all-reduce that of the ``r``
        replicas used (``r`` up to the first whose slack is negative: the floors rise with ``r``). ``stages``: in a
        plan of that many stages its microbatches' round trip after it crosses to the last stage and back, at least
        ``last(stages - 1)`` each way (``hops_ms`` ``to_last``: every crossing of the route), beside every block
        after it forward and back (else one crossing each way, as every stage's)."""
        rows, Y = self.rows, self.a.count + 1
        top = rows.top
        y = np.arange(Y)
        r = np.arange(1, top + 1)[None, :, None]
        # r replicas, y of group a and r - y of b (``_Rows.floor``: where it holds both, its ring crosses islands)
        floor = rows.floor(rows.firsts[:, None, None], y[None, None, :], np.maximum(r - y[None, None, :], 0))
        slack = B - self.opt0[1:, None, None] - floor  # (L, r = 1..top, Y)
        valid = np.logical_and.accumulate(slack >= 0, axis=1)
        at = np.broadcast_to(rows.first_rows[:, None, None], slack.shape)
        trip = None
        if stages is not None:
            i = np.arange(1, self.L + 1)
            trip = np.where(i < self.L, self.U[self.L] - self.U[i] + 2 * max(self.hop, float(self.last[stages - 1])),
                            0.0)
            trip = np.broadcast_to(trip[:, None, None], slack.shape)
        nb = self._nb(at, slack, slack, y[None, None, :], trip)  # (L, top, Y)
        ok = valid & (y + nb <= r) & (r - y <= rows.cap_b[rows.first_rows][:, None, None])
        by_r = np.where(ok, r - y, np.inf)
        if by_r.shape[1] < LINKED + 1:  # r past the largest ring: none
            by_r = np.concatenate([by_r, np.full((by_r.shape[0], LINKED + 1 - by_r.shape[1], Y), np.inf)], axis=1)
        self._first_by_r = by_r  # per replica count r = 1..: for ``_feasible_linked``
        return by_r.min(axis=1)

    def _after_passes(self, B: float, slack: np.ndarray, nb: np.ndarray) -> np.ndarray:
        """``nb`` raised where each replica's passes, after its first microbatch's arrival, and then the stage's
        all-reduce and optimizer step must fit ``B`` too (``step >= arrival + m t + AR_k + optim_k``). The ring's
        size is not known: ``y + nb`` is at most it, so its floor at that size is at most the plan's, and the
        fewest devices under it a count the plan's is no less than, and so on to a fixed point (or ``ROUNDS``).
        Each entry's rounds are its own: an entry a round left alone is at its fixed point, one raised to inf
        too, and only the others go on."""
        rows, Y = self.rows, nb.shape[1]
        room = B - rows.F - rows.arrive
        nb = nb.copy()
        live = np.flatnonzero(np.isfinite(nb))
        at, y = np.divmod(live, Y)
        flat = nb.reshape(-1)
        cur = flat[live]
        for _ in range(ROUNDS):
            if not len(live):
                break
            floor = rows.floor(rows.pair[at], y, cur.astype(int))  # ``_Rows.floor``: at y of a, cur of b
            slacks = [np.minimum(slack[at], room[at] - opt[at] - floor) for opt in (rows.opt_a, rows.opt_b)]
            raised = np.maximum(self._nb(at, slacks[0], slacks[1], y), cur)
            moved = raised != cur
            flat[live[moved]] = raised[moved]
            keep = moved & np.isfinite(raised)
            live, at, y, cur = live[keep], at[keep], y[keep], raised[keep]
        return nb


def _mixed_lines(problem: Problem, stage: list[int], a: _Group, b: _Group, R: int) -> tuple[np.ndarray, np.ndarray]:
    """Per ring size ``r < R``, the all-reduce of a stage holding devices of both groups, as lines ``alpha_r P +
    beta_r`` (``(R, lines)``; ``-inf``: no line): at a partition into islands each of one group's classes only,
    two of its replicas sit in different islands, so its ring uses a link between islands, no faster than their
    fastest nor quicker than their quickest (``Rings``' line for that link)."""
    own = [set(a.classes), set(b.classes)]
    links = [] if problem.compress in COMPRESSED_ALLREDUCE or not a.classes or not b.classes else \
        [isl.between for _, isl in partitions(problem, stage)
         if all(any(set(I) <= g for g in own) for I in isl.members)]
    alpha, beta = np.zeros((R, max(len(links), 1))), np.full((R, max(len(links), 1)), -np.inf)
    for i, lk in enumerate(links):
        for r in range(2, R):
            alpha[r, i], beta[r, i] = 2 * (r - 1) / r * 1e3 / lk.bytes_per_s, 2 * (r - 1) * lk.latency_ms
    return alpha, beta


def _island_lines(problem: Problem, stage: list[int], a: _Group, b: _Group, R: int
                  ) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]:
    """Per partition into islands (``islands.spans``): which stages of ``y`` devices of group ``a`` and ``w`` of
    ``b`` no island holds whole (``(a.count + 1, b.count + 1)``), and per ring size ``r < R`` the line ``alpha_r P +
    beta_r`` of its link between islands (``Rings``' for that link): such a stage has replicas in two islands, so
    its ring uses a link between them, no faster than their fastest nor quicker than their quickest (Sailor-like:
    eight A100s on a stage span two hosts of four, a stage of the zone of four A100s and more of their V100s than
    it has spans the zones). Where every island holds one group only, a stage of both is ``_mixed_lines``'."""
    if problem.compress in COMPRESSED_ALLREDUCE:
        return ()
    own = [set(a.classes), set(b.classes)]
    out = []
    for span, isl in spans(problem, stage, own[0], own[1], a.count + 1, b.count + 1):
        if all(any(set(I) <= g for g in own) for I in isl.members):
            span = span.copy()
            span[1:, 1:] = False  # both groups: the mixed rings' line
        if not span.any():
            continue
        r = np.arange(R)
        lk = isl.between
        alpha = np.where(r >= 2, 2 * (r - 1) / np.maximum(r, 1) * 1e3 / lk.bytes_per_s, 0.0)
        beta = np.where(r >= 2, 2 * (r - 1) * lk.latency_ms, 0.0)
        out.append((span, alpha, beta))
    return tuple(out)


def _per(t: np.ndarray, pos: np.ndarray, fits: np.ndarray, slack: np.ndarray, M: int, f: np.ndarray,
         b: np.ndarray, trip: np.ndarray, slots: np.ndarray | None = None) -> np.ndarray:
    """Microbatches one device runs of a stage of pass ``t`` (``pos``: ``t > 0``; else 1) within ``slack`` (0: none
    fit it, or its blocks do not fit the device: ``fits``): ``m t``, and with its forward ``f``, backward ``b`` and
    the round trip after it ``trip`` (``_Rows``), ``m f + trip + b`` and ``f + trip + m b``, all within ``slack``.

    **In flight.** With room for ``n`` microbatches' activations (``slots``), a device holds at most ``n`` in flight
    (``in_flight.limit``: ``max(least, min(need, cap))``, and a valid plan fits the schedule's least, so at most the
    memory's cap). The compiler places a forward only while fewer than ``n`` are in flight (from its forward's
    start to its backward's), and the device runs its program in that order: before its first backward starts,
    no sooner than ``f + trip`` after its first input, it ran ``n`` forwards at most, and all ``m`` backwards and
    the other ``m - n`` forwards follow; when its last forward starts, ``n`` backwards at most are still to run,
    and ``trip + b`` follow that forward's end. So ``f + trip + m b + (m - n) f`` and ``m f + (m - n) b + trip +
    b`` fit ``slack`` too where ``m > n`` (SWARM-like: a T4 holding the embedding and six layers has room for 18 of
    its 32 microbatches, and its first gradient comes back over four volunteers' links each way)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        per = np.where(pos, np.floor(slack / t), M)
        per = np.where(f > 0, np.minimum(per, np.floor((slack - trip - b) / f)), per)
        per = np.where(b > 0, np.minimum(per, np.floor((slack - trip - f) / b)), per)
        if slots is not None:
            fb = np.where(f + b > 0, f + b, 1.0)
            held = np.minimum(np.floor((slack - f - trip + slots * f) / fb), np.floor((slack - trip - b + slots * b) / fb))
            per = np.where((f + b > 0) & np.isfinite(slots), np.minimum(per, np.maximum(slots, held)), per)
    return np.where(fits & (slack >= 0), np.clip(per, 0, M), 0)


@dataclass(frozen=True, slots=True, eq=False)
class _Rows:
    """A test's per-stage tables, none of which depend on ``B``: one row per stage ``j..i-1`` (``j >= 1``) and
    state ``z`` a DP can be in at ``j`` (``z <= j``; at least 1 where it counts stages), and per stage (``pair``:
    ``i (i - 1) / 2 + j``) its all-reduce floor per ring size (``r`` past the largest ring at the largest's)."""

    pair: np.ndarray
    cell: np.ndarray   # the row's (pair, z) in the test's output, flattened
    U: np.ndarray
    extra: np.ndarray
    F: np.ndarray
    arrive: np.ndarray
    t_a: np.ndarray    # pass times (1 where none: ``pos_*`` false)
    pos_a: np.ndarray
    fits_a: np.ndarray
    t_b: np.ndarray
    pos_b: np.ndarray
    fits_b: np.ndarray
    cap_a: np.ndarray
    cap_b: np.ndarray
    opt_a: np.ndarray
    opt_b: np.ndarray
    f_a: np.ndarray    # the stage's least forward and backward per group (``_per``; 0 where none)
    b_a: np.ndarray
    f_b: np.ndarray
    b_b: np.ndarray
    slots_a: np.ndarray  # microbatches in flight a device of the group has room for (``_per``; inf: no cap)
    slots_b: np.ndarray
    slots_ra: np.ndarray  # the same recomputing (activations: each block's input; ``_Test.mixed_recompute``)
    slots_rb: np.ndarray
    trip: np.ndarray   # the least round trip after the stage (``_per``): its blocks after, and a crossing each way
    inner: int         # rows of stages after stage 0 (the first ``inner``; then stage 0's, per i)
    floors: np.ndarray  # (pairs, r = 0..top)
    mixed_floors: np.ndarray  # the same where the stage holds devices of both groups (``_mixed_lines``)
    top: int
    firsts: np.ndarray  # the pairs of stage 0 (j = 0), per i = 1..L
    first_rows: np.ndarray  # their rows among these (appended after the others, z = 0)
    nbytes: np.ndarray  # per stage, its gradient bytes
    islands: tuple  # ``_island_lines``: per partition, the counts no island holds whole and its line

    @staticmethod
    def of(test: _Test) -> _Rows:
        L = test.L
        i = np.repeat(np.arange(1, L + 1), np.arange(1, L + 1))
        j = np.arange(len(i)) - i * (i - 1) // 2
        pair = np.arange(len(i))
        z0 = 1 if test.track == "stages" else 0  # counting stages, a stage after stage 0 has one before it
        states = j[j > 0] + 1 - z0
        inner = np.repeat(pair[j > 0], states)
        z = z0 + np.arange(len(inner)) - np.repeat(np.cumsum(states) - states, states)
        firsts = pair[j == 0]
        rp = np.concatenate([inner, firsts])  # every row's pair: the inner stages', then stage 0's
        rz = np.concatenate([z, np.zeros(len(firsts), dtype=int)])
        ri, rj = i[rp], j[rp]
        end = ((rj == 0) | (ri == L)) if test.ends else np.zeros(len(rp), dtype=bool)

        def group(g: _Group) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
            t = g.prefix[ri] - g.prefix[rj]
            cap = np.where(end, test._end_cap(g, rj, ri), g.count)
            return np.where(t > 0, t, 1.0), t > 0, test.need[ri] - test.need[rj] <= g.mem, cap

        t_a, pos_a, fits_a, cap_a = group(test.a)
        t_b, pos_b, fits_b, cap_b = group(test.b)

        def slots(g: _Group, acts: np.ndarray) -> np.ndarray:
            """Microbatches in flight a device of ``g`` has room for beside the stage's state (``in_flight.memory_cap``
            no more: its buffers and verifier state aside, the group's largest memory), of ``acts`` (prefix sums)."""
            act = acts[ri] - acts[rj]
            room = g.mem - (test.state[ri] - test.state[rj])
            with np.errstate(divide="ignore", invalid="ignore"):
                n = np.where(act > 0, np.floor(room / np.where(act > 0, act, 1.0)), np.inf)
            return n if IN_FLIGHT else np.full(len(rp), np.inf)

        def passes(g: _Group) -> tuple[np.ndarray, np.ndarray]:
            if g.fwd is None or not g.count:
                return np.zeros(len(rp)), np.zeros(len(rp))
            return g.fwd[ri] - g.fwd[rj], g.bwd[ri] - g.bwd[rj]

        (f_a, b_a), (f_b, b_b) = passes(test.a), passes(test.b)
        trip = test.U[L] - test.U[ri] + np.where(ri < L, 2 * test.hop, 0.0) if ROUND_TRIP else np.zeros(len(rp))
        top = len(test.ring.none) - 1
        sizes = np.arange(top + 1)
        pend = ((j == 0) | (i == L)) if test.ends else np.zeros(len(pair), dtype=bool)
        params = test.params[i] - test.params[j]
        floors = np.empty((len(pair), top + 1))
        for ring, rows in ((test.ring, pend), (test.middle_ring, ~pend)):
            n = int(rows.sum())
            floors[rows] = ring.floor(np.repeat(params[rows], top + 1), np.tile(sizes, n)).reshape(n, top + 1)
        alpha, beta = test.mixed

        def mixed(nbytes: np.ndarray, r: np.ndarray) -> np.ndarray:
            lines = (alpha[r] * nbytes[:, None] + beta[r]).max(axis=1)
            return np.where((r >= 2) & (nbytes > 0), lines, 0.0)

        mixed_floors = np.maximum(floors, mixed(np.repeat(params, top + 1), np.tile(sizes, len(pair))).reshape(
            len(pair), top + 1))
        last = ri == L
        extra = np.where(last, test.extra_last[rj, rz], test.extra[rj, rz])
        arrive = np.where(last, np.broadcast_to(test.arrive_last, (L + 1, L + 1))[rj, rz],
                          np.broadcast_to(test.arrive, (L + 1, L + 1))[rj, rz])
        return _Rows(pair=rp, cell=rp * (L + 1) + rz, U=test.U[rj], extra=extra, F=test.F[rj],
                     arrive=arrive, t_a=t_a, pos_a=pos_a,
                     fits_a=fits_a, t_b=t_b, pos_b=pos_b, fits_b=fits_b, cap_a=cap_a, cap_b=cap_b, opt_a=test.optim[0][rj, ri],
                     opt_b=test.optim[1][rj, ri], f_a=f_a, b_a=b_a, f_b=f_b, b_b=b_b,
                     slots_a=slots(test.a, test.act_full), slots_b=slots(test.b, test.act_full),
                     slots_ra=slots(test.a, test.act), slots_rb=slots(test.b, test.act), trip=trip, inner=len(inner), floors=floors, mixed_floors=mixed_floors, top=top, firsts=firsts,
                     first_rows=np.arange(len(inner), len(rp)), nbytes=params,
                     islands=test.islands)

    def floor(self, pair: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
        """The all-reduce floor of stage ``pair`` (index arrays, broadcast) on ``y`` devices of group ``a`` and ``w``
        of ``b``, a ring of ``y + w`` (past the largest ring, at the largest's: the floors rise with it): ``Rings``',
        the mixed rings' where it holds both groups (``_mixed_lines``), and the line of a partition's link between
        islands where no island of it holds the stage whole (``_island_lines``)."""
        r = np.minimum(y + w, self.top)
        out = np.where((y >= 1) & (w >= 1), self.mixed_floors[pair, r], self.floors[pair, r])
        nbytes = self.nbytes[pair]
        for span, alpha, beta in self.islands:
            cross = span[np.minimum(y, span.shape[0] - 1), np.minimum(w, span.shape[1] - 1)] & (r >= 2) & (nbytes > 0)
            out = np.where(cross, np.maximum(out, alpha[r] * nbytes + beta[r]), out)
        return out


def _optim_ms(problem: Problem, classes: tuple[int, ...]) -> np.ndarray:
    """Per stage ``j..i-1`` (``[j, i]``), the least optimizer step of its blocks on any of ``classes`` (0: none)."""
    L = problem.num_blocks
    out = np.zeros((L + 1, L + 1))
    for j in range(L):
        for i in range(j + 1, L + 1):
            out[j, i] = min((problem.range_optim_ms(j, i - 1, c) for c in classes), default=0.0)
    return out
