"""A lower bound on the compiled programs' cost (``objective.price_program``) from the stages' replicas.

The fluid LP prices throughput alone: ``r`` replicas of a stage do its work ``r`` times as fast, for free. But
replicas pay an all-reduce, and every microbatch crosses a replica at that replica's own speed. A stage over
blocks ``a..b`` with ``r`` replicas:

* **Busy.** One replica runs ``m >= ceil(M / r)`` microbatches, each at least ``t(a..b)`` (the blocks' least
  times over the classes), and ``pipe >= m t`` (the fluid LP's premise).
* **All-reduce.** With ``r >= 2`` the step ends no sooner than the stage's all-reduce (``step >= finish_k +
  AR_k``): a ring of ``r`` devices moves ``2 (r-1)/r`` times its gradients (at least its blocks' parameters) over
  its slowest link, and waits ``2 (r-1)`` latencies. That link is no faster than the fastest of the pool, and
  where ``r`` exceeds every island of a threshold's partition (``islands.islands_at``), no faster than the
  fastest between two islands. Exact gradients only (``--compress auto/int8`` may compress them: no term).
* **The last stage's path.** Its replicas keep one microbatch in flight (1F1B; GPipe: its forward and backward
  phases), so ``program_cost`` adds the first microbatch's forward path to its busy time and the last one's
  backward path: ``pipe >= ceil(M/r) t(e..L-1) + U(e)``, ``U(e)`` every block before ``e`` forward and
  backward at their least and the smallest boundary's ``h`` hops each way, ``h`` the stages before the last:
  each between two distinct devices, at most ``N - Q`` of them inside an island (``N`` devices in ``Q`` islands
  of a partition; a route's devices are distinct), the others over a link between islands.
* **Trusted ends.** Stage 0 and the last hold trusted devices where the ends must be trusted, so neither holds
  every trusted device, and a stage between them rings over the others (a volunteer swarm whose trusted host has
  two GPUs: its middle stages' rings cross the volunteers' links).

So ``step >= B`` for the least ``B`` at which some partition has every stage's busy time and all-reduce, and the
last stage's path, within ``B`` using no more devices than the pool has: bisected on ``B``, each test a DP over
the cuts of the fewest devices covering blocks ``0..e-1`` (a stage's fewest replicas at ``B``: the least ``r``
with ``ceil(M/r) t <= B``, if its all-reduce fits too, all-reduces rising with ``r``). Chains longer than
``DP_BLOCKS`` take the last stage alone (``e = L - 1``, no device count). On DT-FM's pools, whose every link is
2 Gb/s or slower, the head (103M parameters, the slowest block) binds: one replica runs ``M`` heads, several
all-reduce 206 MB over 2 Gb/s, and the layers before it pay the same trade.
"""
from __future__ import annotations

import math

import numpy as np

from cost_models.cluster import Link
from planner.solver.bound.islands import (
    COMPRESSED_ALLREDUCE,
    Islands,
    min_wire_bytes,
    partitions,
)
from planner.solver.problem import Problem, bound_problem

# Chains up to this many blocks get the DP over cuts (a test is ~L^2/2 vector cells, ~60 tests a bound).
DP_BLOCKS = 64
# Bisection steps on B (relative width 2^-40 of the bracket).
BISECTIONS = 40


def replica_bound_ms(problem: Problem) -> float:
    """The bound of the module docstring (ms; 0 where no class may hold the last block)."""
    problem = bound_problem(problem)
    stage = [c.index for c in problem.classes if c.stage_capable]
    pol = problem.policy
    ends = pol.enabled and pol.trusted_endpoints
    need = problem.param_count.astype(float) * problem.state_bytes_per_param + problem.act_bytes
    L = problem.num_blocks
    last = [c for c in stage if need[L - 1] <= problem.classes[c].mem_bytes and (problem.classes[c].trusted or not ends)]
    if not last:
        return 0.0
    cuts = _Cuts(problem, stage, last, need)
    if L > DP_BLOCKS:
        return cuts.last_alone_ms() * (1 - 1e-9)
    hi = cuts.last_alone_ms() + 1.0
    while not cuts.feasible(hi):
        if hi > 1e12:
            return 0.0
        hi *= 2
    lo = 0.0
    for _ in range(BISECTIONS):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if cuts.feasible(mid) else (mid, hi)
    return lo * (1 - 1e-9)  # infeasible: below every plan of the relaxation


class _Cuts:
    """Prefix sums of the blocks' least times, parameters and needs; the ring floors; the last stage's path."""

    def __init__(self, problem: Problem, stage: list[int], last: list[int], need: np.ndarray) -> None:
        L, M = problem.num_blocks, problem.num_microbatches
        self.M, self.L = M, L
        zero = np.zeros(1)
        self.t = np.concatenate([zero, np.cumsum(problem.time_ms[:, stage].min(axis=1))])
        self.t_last = np.concatenate([zero, np.cumsum(problem.time_ms[:, last].min(axis=1))])
        self.params = np.concatenate([zero, np.cumsum(problem.param_count.astype(float))]) * problem.grad_bytes_per_param
        self.need = np.concatenate([zero, np.cumsum(need)])
        self.mem = float(max(problem.classes[c].mem_bytes for c in stage))
        self.mem_last = float(max(problem.classes[c].mem_bytes for c in last))
        self.devices = sum(problem.classes[c].count for c in stage)
        self.last_devices = min(M, sum(problem.classes[c].count for c in last))
        bwd = problem.time_ms * (2.0 / 3.0) if problem.bwd_ms is None else problem.bwd_ms
        passes = (problem.time_ms - bwd)[:, stage].min(axis=1) + bwd[:, stage].min(axis=1)
        self.passes = np.concatenate([zero, np.cumsum(passes)])  # U(e): passes[e] + 2 hops_ms[s], s stages before e
        self.hops_ms = hops_ms(problem, stage, L)
        self.hops = max(1, _fewest_stages(need, self.mem) - 1)  # with a stage before the last
        pol = problem.policy
        self.ends = pol.enabled and pol.trusted_endpoints
        trusted = sum(problem.classes[c].count for c in stage if problem.classes[c].trusted)
        # With trusted ends, stage 0 and the last each hold a trusted device: neither holds all of them.
        self.end_cap = trusted - 1 if self.ends else self.devices
        self.ring = Rings(problem, stage, min(M, self.devices))
        self.middle_ring = Rings(problem, stage, min(M, self.devices), reserved=2 if self.ends else 0)

    def last_alone_ms(self) -> float:
        """The last stage over block ``L - 1`` alone, any number of devices before it."""
        e = self.L - 1
        t = self.t_last[self.L] - self.t_last[e]
        best = math.inf
        for r in range(1, self.last_devices + 1):
            busy = math.ceil(self.M / r) * t + self.passes[e] + 2 * self.hops_ms[self.hops]
            best = min(best, max(busy, float(self.ring.floor(np.array([self.params[self.L] - self.params[e]]),
                                                             np.array([r]))[0])))
        return best

    def _fewest(self, t: np.ndarray, params: np.ndarray, budget: np.ndarray, cap: int | np.ndarray, B: float,
                ring: Rings) -> np.ndarray:
        """Per stage, the fewest replicas whose busy time (``ceil(M/r) t``) fits ``budget`` and all-reduce ``B``
        (inf: none up to ``cap``)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            per = np.where(t > 0, np.floor(budget / np.where(t > 0, t, 1.0)), self.M)
        r = np.where(per >= 1, np.ceil(self.M / np.maximum(per, 1)), np.inf)
        r = np.where(r <= cap, r, np.inf)
        ok = np.isfinite(r)
        if ok.any():
            floors = np.full(r.shape, np.inf)
            floors[ok] = ring.floor(params[ok], r[ok].astype(int))
            r = np.where(floors <= B, r, np.inf)
        return r

    def feasible(self, B: float) -> bool:
        """Whether some partition meets ``B`` (module docstring) with the pool's devices: per stage count ``s`` before
        the last, the fewest devices covering blocks ``0..e-1`` (a min-plus product per ``s``), then the last stage
        from ``e`` with ``s`` hops each way on its path."""
        L = self.L
        j, i = np.triu_indices(L, k=1)  # a stage over blocks j..i-1, before the last
        first = j == 0  # stage 0: trusted devices where the ends must be; the others: not the ends' devices
        r = np.full(len(i), np.inf)
        for rows, cap, ring in ((first, self.end_cap, self.ring), (~first, self.devices, self.middle_ring)):
            r[rows] = self._fewest(self.t[i[rows]] - self.t[j[rows]], self.params[i[rows]] - self.params[j[rows]],
                                   np.full(int(rows.sum()), B), cap, B, ring)
        cost = np.full((L, L), np.inf)
        cost[j, i] = np.where(self.need[i] - self.need[j] <= self.mem, r, np.inf)
        starts = np.arange(L)
        t = self.t_last[L] - self.t_last[starts]
        params = self.params[L] - self.params[starts]
        fits = self.need[L] - self.need[starts] <= self.mem_last
        fewest = np.full(L, np.inf)
        fewest[0] = 0.0  # no stage before the last: it starts at block 0
        caps = np.where(starts > 0, min(self.last_devices, self.end_cap), self.last_devices)
        for hops in range(L):
            room = B - self.passes[starts] - 2 * self.hops_ms[hops]
            last = np.where(fits, self._fewest(t, params, room, caps, B, self.ring), np.inf)
            if np.any(fewest + last <= self.devices):
                return True
            fewest = np.min(fewest[:, None] + cost, axis=0)  # one stage more before the last
            if not np.isfinite(fewest).any():
                return False
        return False


class Rings:
    """The least all-reduce of ``P`` gradient bytes over a ring of ``r`` devices (module docstring), as the max of
    lines ``alpha_r P + beta_r`` over the links a ring of ``r`` must use at least once."""

    def __init__(self, problem: Problem, stage: list[int], replicas: int, reserved: int = 0) -> None:
        """``reserved``: trusted devices the ends hold, which a middle stage's ring cannot use: an island keeps at
        most its size less those of them the other islands' trusted devices cannot hold."""
        self.off = problem.compress in COMPRESSED_ALLREDUCE
        best = _fastest(problem, stage)
        trusted = {c for c in stage if problem.classes[c].trusted}
        everywhere = sum(problem.classes[c].count for c in trusted)

        def kept(island) -> int:
            own = sum(n for c, n in island.items() if c in trusted)
            return sum(island.values()) - max(0, min(own, reserved - (everywhere - own)))

        splits = [(max(kept(I) for I in isl.members), isl.between) for _, isl in partitions(problem, stage)]
        links = [(0, best)] if best is not None else []
        links += [(largest, between) for largest, between in splits]
        R = max(replicas, 1) + 1
        self.alpha = np.zeros((R, max(len(links), 1)))
        self.beta = np.full((R, max(len(links), 1)), -np.inf)  # a link a ring of r need not use: no line
        self.none = np.zeros(R, dtype=bool)  # a ring of r that no link joins: no such plan
        for r in range(2, R):
            used = [(i, lk) for i, (largest, lk) in enumerate(links) if r > largest]
            self.none[r] = not used
            for i, lk in used:
                self.alpha[r, i] = 2 * (r - 1) / r * 1e3 / lk.bytes_per_s
                self.beta[r, i] = 2 * (r - 1) * lk.latency_ms

    def floor(self, nbytes: np.ndarray, r: np.ndarray) -> np.ndarray:
        if self.off:
            return np.zeros(len(r))
        lines = self.alpha[r] * nbytes[:, None] + self.beta[r]
        out = np.where(self.none[r], np.inf, np.max(lines, axis=1))
        return np.where((r >= 2) & (nbytes > 0), out, 0.0)  # no gradients: ``comm.allreduce_ms`` is 0


def hops_ms(problem: Problem, stage: list[int], L: int, *, before_last: bool = False,
            to_last: bool = False) -> np.ndarray:
    """Per count ``h`` of boundaries a microbatch crosses one way, their least transfer time: each between two
    distinct devices, at most ``N - Q`` of them inside an island (``N`` devices in ``Q`` islands: a route's
    devices are distinct), the rest between islands; the most of any partition. ``before_last``: crossings
    among the devices before the last stage's (``spare``: one fewer inside an island where the ends must be
    trusted). ``to_last``: a route's from stage 0 to the last stage, where the ends must be trusted and one island
    ``H`` (two devices or more) holds every trusted stage device: a route of more than ``|H|`` devices starts and
    ends in ``H`` and leaves it, so it visits ``H`` in two runs at least, one crossing fewer inside it."""
    wire = min_wire_bytes(problem)
    fast = _fastest(problem, stage)
    if wire <= 0 or fast is None:
        return np.zeros(L + 1)
    h = np.arange(L + 1, dtype=float)
    one = fast.latency_ms + 1e3 * wire / fast.bytes_per_s
    out = h * one
    N = sum(problem.classes[c].count for c in stage)
    for _, isl in partitions(problem, stage):
        inside = N - len(isl.members) - (spare(problem, isl) if before_last else 0)
        if to_last and (home := _home(problem, isl)):
            inside = np.where(h >= home, inside - 1, inside)
        slow = isl.between.latency_ms + 1e3 * wire / isl.between.bytes_per_s
        out = np.maximum(out, np.minimum(h, inside) * one + np.maximum(h - inside, 0) * slow)
    return out


def spare(problem: Problem, isl: Islands) -> int:
    """1 where the ends must be trusted and every island holding a trusted stage device holds two devices or more,
    else 0. Then a route's devices before the last stage's (``d_0..d_{S-2}``) make at most ``N - Q - 1`` crossings
    inside an island: ``d_{S-1}`` is trusted, so its island ``H`` (``|H| >= 2``) has at most ``|H| - 1`` of them,
    at most ``|H| - 2`` crossings inside it, and every other island ``I`` at most ``|I| - 1``."""
    pol = problem.policy
    if not (pol.enabled and pol.trusted_endpoints):
        return 0
    held = [sum(I.values()) for I in isl.members if any(problem.classes[c].trusted for c in I)]
    return int(bool(held) and min(held) >= 2)


def _home(problem: Problem, isl: Islands) -> int:
    """The size of the one island holding every trusted stage device where the ends must be trusted and it holds
    two or more (0: else)."""
    pol = problem.policy
    if not (pol.enabled and pol.trusted_endpoints):
        return 0
    held = [sum(I.values()) for I in isl.members if any(problem.classes[c].trusted for c in I)]
    return held[0] if len(held) == 1 and held[0] >= 2 else 0


def slow_route(problem: Problem, stage: list[int]) -> tuple[float, float] | None:
    """``(wire ms, latency ms)`` of one smallest boundary tensor between islands where a partition leaves no
    crossing inside an island before the last stage's device (``hops_ms``' ``before_last`` count 0: one-GPU
    hosts, or a trusted host of two between volunteers'), the slowest such; None where none does. Then every
    boundary into a stage that is not the last is a link between islands."""
    wire = min_wire_bytes(problem)
    if wire <= 0:
        return None
    N = sum(problem.classes[c].count for c in stage)
    found = [(1e3 * wire / isl.between.bytes_per_s, isl.between.latency_ms) for _, isl in partitions(problem, stage)
             if N - len(isl.members) - spare(problem, isl) <= 0]
    return max(found, default=None)


def _fewest_stages(need: np.ndarray, mem_bytes: float) -> int:
    """The fewest contiguous stages whose blocks' needs each fit ``mem_bytes`` (greedy; a block too big for it
    alone is left to the other bounds: counted as a stage of its own)."""
    stages, held = 1, 0.0
    for b in need:
        if held > 0 and held + b > mem_bytes:
            stages, held = stages + 1, 0.0
        held += float(b)
    return stages


def _fastest(problem: Problem, classes: list[int]) -> Link | None:
    """A link at least as fast as any between two distinct devices of ``classes`` (None: no such pair)."""
    found = [lk for a in classes for b in classes
             if (a != b or problem.classes[a].count > 1) and (lk := problem.links[a][b]) is not None]
    if not found:
        return None
    return Link(bandwidth_gbps=max(lk.bandwidth_gbps for lk in found), latency_ms=min(lk.latency_ms for lk in found))
