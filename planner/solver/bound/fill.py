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

from dataclasses import dataclass

import numpy as np

from planner.solver.bound.replicas import Rings, hops_ms
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


def fill_bound_ms(problem: Problem, floor_ms: float = 0.0, *, within: Work | None = None) -> float:
    """The bound of the module docstring (ms; ``floor_ms``, a bound known valid, where this one is no more).
    ``within``: the plan's work budget, charged each feasibility test (``fill_units``); a test it cannot afford
    in full is skipped (a weaker bound, still valid), so the bound never runs a plan past its time."""
    problem = bound_problem(problem)
    stage = [c.index for c in problem.classes if c.stage_capable]
    if not stage:
        return floor_ms
    kinds = _kinds(problem, stage)
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
            each = fill_units(L, fast.count + slow.count)
            if within is not None and within.left_s() * UNITS_PER_S < TESTS_EACH * each:
                continue
            spent += cells
            test = _Test(problem, stage, fast, slow, track)
            best = max(best, test.least_ms(best))
            if within is not None:
                within.charge(test.tests * each)
    return best


def _kinds(problem: Problem, stage: list[int]) -> list[list[int]]:
    """Stage classes of the same times and memory, fastest kind first."""
    by: dict[tuple, list[int]] = {}
    for c in stage:
        by.setdefault((problem.time_ms[:, c].tobytes(), problem.classes[c].mem_bytes), []).append(c)
    return sorted(by.values(), key=lambda k: float(problem.time_ms[:, k[0]].sum()))


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

    @staticmethod
    def of(problem: Problem, classes: list[int]) -> _Group:
        L = problem.num_blocks
        if not classes:
            return _Group(np.zeros(L + 1), np.full(L, np.inf), 0.0, 0, 0)
        bwd = problem.time_ms * (2.0 / 3.0) if problem.bwd_ms is None else problem.bwd_ms
        path = (problem.time_ms - bwd)[:, classes].min(axis=1) + bwd[:, classes].min(axis=1)
        t = problem.time_ms[:, classes].min(axis=1)
        return _Group(np.concatenate([[0.0], np.cumsum(t)]), path,
                      float(max(problem.classes[c].mem_bytes for c in classes)),
                      sum(problem.classes[c].count for c in classes),
                      sum(problem.classes[c].count for c in classes if problem.classes[c].trusted), tuple(classes))


class _Test:
    """Whether a step of ``B`` admits a partition (module docstring). The DP's state: blocks covered, devices of
    group ``a`` (``tracked``) used, and ``z``: the stages so far (``track="stages"``: the path before a
    stage pays ``2 hops(z)``) or the blocks so far on stages of group ``b`` alone (``track="slow"``: their passes
    on the path are ``b``'s, at least the ``z`` least excesses over the least pass of the blocks before)."""

    def __init__(self, problem: Problem, stage: list[int], fast: _Group, slow: _Group, track: str) -> None:
        L, M = problem.num_blocks, problem.num_microbatches
        self.L, self.M, self.track = L, M, track
        self.tests = 0   # feasibility tests run (their work charged to the plan's budget)
        self.a, self.b = self.tracked(fast, slow, track)
        pol = problem.policy
        self.ends = pol.enabled and pol.trusted_endpoints
        need = problem.param_count.astype(float) * problem.state_bytes_per_param + problem.act_bytes
        self.need = np.concatenate([[0.0], np.cumsum(need)])
        self.params = np.concatenate([[0.0], np.cumsum(problem.param_count.astype(float))]) \
            * problem.grad_bytes_per_param
        least = np.minimum(fast.path, slow.path)
        self.U = np.concatenate([[0.0], np.cumsum(least)])
        # Stage 0's optimizer step follows the pipeline (``step >= pipe + optim_0``): blocks 0..i-1 for stage 0
        # itself, the least of any stage 0 for the others.
        self.opt0 = np.array([0.0] + [min(problem.range_optim_ms(0, i - 1, c) for c in stage)
                                      for i in range(1, L + 1)])
        self.opt_any = float(self.opt0[1:].min())
        hops = 2 * hops_ms(problem, stage, L)
        j = np.arange(L + 1)[:, None]
        if track == "stages":
            self.extra = np.where(j > 0, hops[None, :L + 1], 0.0)
        else:  # the z least excesses of the slow group's passes among blocks 0..j-1
            self.extra = np.full((L + 1, L + 1), np.inf)
            for e in range(L + 1):
                self.extra[e, :e + 1] = np.concatenate([[0.0], np.cumsum(np.sort(slow.path[:e] - least[:e]))])
            self.extra += np.where(j > 0, hops[1], 0.0)
        devices = fast.count + slow.count
        self.ring = Rings(problem, stage, min(M, devices))
        self.middle_ring = Rings(problem, stage, min(M, devices), reserved=2 if self.ends else 0)
        # A stage's all-reduce and optimizer step follow its own passes, which start once its first microbatch's
        # forward is in: blocks 0..j-1 forward at their least and the hops before it, one way.
        bwd = problem.time_ms * (2.0 / 3.0) if problem.bwd_ms is None else problem.bwd_ms
        self.F = np.concatenate([[0.0], np.cumsum((problem.time_ms - bwd)[:, stage].min(axis=1))])
        one_way = hops_ms(problem, stage, L)
        self.arrive = np.where(j > 0, one_way[None, :L + 1] if track == "stages" else one_way[1], 0.0)
        self.optim = [_optim_ms(problem, g.classes) for g in (self.a, self.b)]

    @staticmethod
    def tracked(fast: _Group, slow: _Group, track: str) -> tuple[_Group, _Group]:
        """(group ``a``, whose devices the DP counts, group ``b``): ``a`` the fast one where the slow path is
        tracked (a stage of ``b`` alone is one without ``a``'s devices), else the smaller (none for one kind)."""
        if not slow.count:
            return _Group(np.zeros_like(fast.prefix), np.full(len(fast.path), np.inf), 0.0, 0, 0), fast
        return (fast, slow) if track == "slow" or fast.count <= slow.count else (slow, fast)

    def least_ms(self, floor_ms: float) -> float:
        """The least ``B`` this test cannot rule out, less a hair (``floor_ms`` where it rules out none above)."""
        lo = floor_ms
        if self.feasible(lo):
            return floor_ms
        hi = max(2 * lo, float(self.U[-1]) + 1.0)
        while not self.feasible(hi):
            if hi > 1e12:
                return floor_ms
            lo, hi = hi, 2 * hi
        while hi - lo > REL_TOL * hi:
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if self.feasible(mid) else (mid, hi)
        return lo * (1 - 1e-9)

    def feasible(self, B: float) -> bool:
        """Whether some partition meets ``B`` with the pool's devices: blocks in order, per state the fewest
        devices of group ``b``."""
        self.tests += 1
        L, NA, Z = self.L, self.a.count, self.L + 1
        best = np.full((L + 1, NA + 1, Z), np.inf)
        best[0, 0, 0] = 0.0
        for i in range(1, L + 1):
            js = np.nonzero(np.isfinite(best[:i]).any(axis=(1, 2)))[0]
            if not len(js):
                continue
            nb = self._fewest(B, js, i)  # (J, Z, NA + 1)
            for y in range(NA + 1):
                cand = best[js, :NA + 1 - y, :] + nb[:, None, :, y]  # to x = y..NA
                if self.track == "stages":
                    np.minimum(best[i, y:, 1:], cand.min(axis=0)[:, :Z - 1], out=best[i, y:, 1:])
                elif y > 0 or self.b.count == 0:
                    np.minimum(best[i, y:, :], cand.min(axis=0), out=best[i, y:, :])
                else:  # a stage of group b alone: its blocks join the slow path
                    for n, jj in enumerate(js):
                        d = i - int(jj)
                        np.minimum(best[i, :, d:], cand[n, :, :Z - d], out=best[i, :, d:])
        return bool((best[L] <= self.b.count).any())

    def _fewest(self, B: float, js: np.ndarray, i: int) -> np.ndarray:
        """Per stage ``j..i-1`` (``j`` in ``js``), state ``z`` and count ``y`` of group ``a``'s devices on it, the
        fewest of group ``b``'s devices that run its ``M`` microbatches within ``B`` (inf: none will do)."""
        slack = B - self.U[js][:, None] - self.extra[js] - self.opt_any  # (J, Z)
        end = (js == 0) | (i == self.L) if self.ends else np.zeros(len(js), dtype=bool)
        nb = self._after_passes(B, js, i, slack, end, self._nb(js, i, slack, end))
        y = np.arange(self.a.count + 1)
        nb = np.where(self._ring_ok(B, js, i, end, y[None, None, :] + nb), nb, np.inf)
        if js[0] == 0:
            nb[0] = self._first(B, i, end[:1])[None, :]
        return nb

    def _nb(self, js: np.ndarray, i: int, slack: np.ndarray | list[np.ndarray], end: np.ndarray) -> np.ndarray:
        """Per stage, state and count ``y`` of group ``a``'s devices, the fewest of group ``b``'s whose passes fit
        ``slack`` (per stage and state, or per group a list of them per stage, state and ``y``; the all-reduce
        aside; inf: none will do)."""
        slacks = slack if isinstance(slack, list) else [slack[:, :, None]] * 2
        per = [self._per(g, js, i, s) for g, s in zip((self.a, self.b), slacks)]
        y = np.arange(self.a.count + 1)
        short = np.maximum(self.M - y[None, None, :] * per[0], 0)
        pb = per[1]
        with np.errstate(divide="ignore", invalid="ignore"):
            nb = np.where(short == 0, 0.0, np.where(pb > 0, np.ceil(short / np.maximum(pb, 1)), np.inf))
        cap_a = np.where(end, self._end_cap(self.a, js, i), self.a.count)[:, None, None]
        cap_b = np.where(end, self._end_cap(self.b, js, i), self.b.count)[:, None, None]
        return np.where((y[None, None, :] <= cap_a) & (nb <= cap_b), nb, np.inf)

    def _end_cap(self, g: _Group, js: np.ndarray, i: int) -> np.ndarray:
        """Devices of ``g`` an end stage may hold: its trusted ones, less one where the other end is another stage
        and only ``g`` has trusted devices (that end holds one of them)."""
        other = self.b if g is self.a else self.a
        return np.where((js == 0) & (i == self.L), g.trusted, g.trusted - (other.trusted == 0 and g.trusted > 0))

    def _first(self, B: float, i: int, end: np.ndarray) -> np.ndarray:
        """Stage 0 over blocks ``0..i-1``: per count ``y`` of group ``a``'s devices, the fewest of group ``b``'s. Its
        last backward ends the pipeline, and its all-reduce and optimizer step follow (``step >= pipe + AR_0 +
        optim_0``): each replica's passes fit ``B`` less both, the all-reduce that of the ``r`` replicas used."""
        js, y = np.zeros(1, dtype=int), np.arange(self.a.count + 1)
        top = len(self.ring.none) - 1
        floors = np.concatenate([[0.0], self.ring.floor(np.full(max(top - 1, 0), self.params[i]),
                                                        np.arange(2, top + 1))])  # r = 1..top
        cap_b = self._end_cap(self.b, np.zeros(1, dtype=int), i)[0] if end[0] else self.b.count
        out = np.full(len(y), np.inf)
        for r in range(1, max(top, 1) + 1):
            slack = B - self.opt0[i] - floors[r - 1]
            if slack < 0:
                break  # the floors rise with r
            nb = self._nb(js, i, np.array([[slack]]), end)[0, 0]
            ok = (y + nb <= r) & (r - y <= cap_b)
            out = np.where(ok, np.minimum(out, r - y), out)
        return out

    def _per(self, g: _Group, js: np.ndarray, i: int, slack: np.ndarray) -> np.ndarray:
        """Microbatches one device of ``g`` runs of stage ``j..i-1`` within ``slack`` (0: none fit it)."""
        shape = (len(js),) + (1,) * (slack.ndim - 1)
        t = (g.prefix[i] - g.prefix[js]).reshape(shape)
        fits = (self.need[i] - self.need[js] <= g.mem).reshape(shape)
        with np.errstate(divide="ignore", invalid="ignore"):
            per = np.where(t > 0, np.floor(slack / np.where(t > 0, t, 1.0)), self.M)
        return np.where(fits & (slack >= 0), np.clip(per, 0, self.M), 0)

    def _after_passes(self, B: float, js: np.ndarray, i: int, slack: np.ndarray, end: np.ndarray,
                      nb: np.ndarray) -> np.ndarray:
        """``nb`` raised where each replica's passes, after its first microbatch's arrival, and then the stage's
        all-reduce and optimizer step must fit ``B`` too (``step >= arrival + m t + AR_k + optim_k``). The ring's
        size is not known: ``y + nb`` is at most it, so its floor at that size is at most the plan's, and the
        fewest devices under it a count the plan's is no less than, and so on to a fixed point."""
        y = np.arange(self.a.count + 1)[None, None, :]
        room = (B - self.F[js][:, None] - self.arrive[js])[:, :, None]  # (J, Z, 1)
        params = self.params[i] - self.params[js]
        for _ in range(ROUNDS):
            floor = self._floors(params, y + nb, end)
            slacks = [np.minimum(slack[:, :, None], room - opt[js, i][:, None, None] - floor) for opt in self.optim]
            raised = np.maximum(self._nb(js, i, slacks, end), nb)
            if np.array_equal(raised, nb):
                break
            nb = raised
        return nb

    def _floors(self, params: np.ndarray, r: np.ndarray, end: np.ndarray) -> np.ndarray:
        """Per stage, the least all-reduce of its gradients over a ring of ``r`` (the counts past the largest ring
        at the largest's: the floors rise with ``r``; inf counts: inf)."""
        out = np.full(r.shape, np.inf)
        for n in range(len(params)):
            ring = self.ring if end[n] else self.middle_ring
            rr = r[n]
            ok = np.isfinite(rr)
            if ok.any():
                idx = np.minimum(rr[ok], len(ring.none) - 1).astype(int)
                out[n][ok] = ring.floor(np.full(len(idx), params[n]), idx)
        return out

    def _ring_ok(self, B: float, js: np.ndarray, i: int, end: np.ndarray, r: np.ndarray) -> np.ndarray:
        """Whether a ring of ``r`` replicas all-reduces the stage's gradients within ``B`` (``r < 2``: none)."""
        params = self.params[i] - self.params[js]
        out = np.ones(r.shape, dtype=bool)
        for n in range(len(js)):
            ring = self.ring if end[n] else self.middle_ring
            top = len(ring.none) - 1
            sizes = np.arange(2, top + 1)
            if not len(sizes):
                continue
            floors = ring.floor(np.full(len(sizes), params[n]), sizes)
            fine = np.concatenate([[True, True], floors <= B])  # r = 0, 1: no all-reduce
            rr = r[n]
            idx = np.where(np.isfinite(rr), np.minimum(rr, top), 0).astype(int)
            out[n] = fine[idx]
        return out


def _optim_ms(problem: Problem, classes: tuple[int, ...]) -> np.ndarray:
    """Per stage ``j..i-1`` (``[j, i]``), the least optimizer step of its blocks on any of ``classes`` (0: none)."""
    L = problem.num_blocks
    out = np.zeros((L + 1, L + 1))
    for j in range(L):
        for i in range(j + 1, L + 1):
            out[j, i] = min((problem.range_optim_ms(j, i - 1, c) for c in classes), default=0.0)
    return out
