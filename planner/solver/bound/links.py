"""A lower bound on the compiled programs' cost (``objective.price_program``) that sees the links.

The fluid LP (``objective._fluid_lp``) bounds compute and memory only: on pools joined by slow links it is
the step of a plan that uses every device with free links. This bound splits the plans by how
many *islands* they use, an island being the devices joined by links faster than a threshold (each
threshold among the pool's link bandwidths gives a valid bound; the largest is kept):

* **Compute on q islands.** A plan that uses devices of ``q`` islands is a plan of the problem restricted
  to those devices, whose busiest replica works ``M T`` at least, ``T`` the fluid LP's bottleneck
  (``objective.program_lower_bound_ms``: each replica is a resource busy ``m t``). Not its fill term: where
  stage 0 is the bottleneck its warm-up forwards hide the other stages' passes (one A100 holding block 0
  of 244 ms, another the rest, 4 microbatches: the programs cost 997.6 ms, ``simple_lower_bound_ms`` says
  1,107.6). Not knowing which ``q``, each kind of device (the same times and memory) keeps as many as its
  ``q`` largest islands hold (a superset of any choice: the LP only falls). With trusted endpoints a plan
  on one island needs a trusted device there.
* **A stage across islands** all-reduces its gradients over a ring that crosses between islands at
  least twice: ``AR >= 2 (r-1)/r * P g / bw + 2 (r-1) lat >= P g / bw + 2 lat`` with ``bw`` the fastest
  and ``lat`` the shortest link between islands, ``P`` at least the smallest block's parameters (exact
  gradients only: ``--compress auto/int8`` may compress it, where this term is dropped). The step ends no
  sooner than any stage's all-reduce (``program_cost``: ``step >= finish_k + AR_k``).
* **Every stage inside one island**, ``q >= 2`` islands used: every microbatch visits every stage, so
  every route crosses between islands ``h >= q - 1`` times each way (``q`` when only one island has the
  trusted devices both ends need). Then
  - *links*: at a crossing every microbatch's activation takes one of at most ``|A| |B|`` device pairs
    (the two largest islands' sizes; at most ``M``), each pair a resource busy with its messages' wire
    time: ``ceil(M / pairs) * bytes / bw`` (``bytes`` the smallest boundary under any codec the plan may
    use). Where both ends sit on the one trusted island ``H``, the first crossing leaves ``H`` from a stage
    other than the last, whose devices are in ``H`` too: ``pairs <= (|H| - 1) x`` the largest other island
    (a volunteer swarm with a trusted host of two: one pair, every activation on it);
  - *stage 0's window*: a replica of stage 0 holding blocks ``0..e`` keeps ``n`` microbatches in flight,
    ``n`` at most what its memory holds beside its weights and state, and each slot cycles through its
    pass and the round trip downstream ``D`` (``in_flight.limit``: ``n * period >= t + D``, or all in
    flight at once and then its busy time plus its idle wait is at least ``t + D``), so
    ``pipe >= M (t + D) / sum_i n_i``, ``D`` at least the other blocks' fastest time and ``2 h`` hops of
    the smallest boundary over the fastest link between islands (latency included).
  The window with ``h = 0`` bounds every plan and enters the maximum on its own.

``min over q`` of ``max(compute on q islands, min(all-reduce, links / window))`` is found by bisection on
``q``: the compute term falls and the others rise with ``q`` (any crossing point of the computed values
bounds every ``q``: below it the true LP, above it the rising term). The replicas' bound (``bound.replicas``)
and the fill bound (``bound.fill``: each stage's replicas at their own kind's speed after the path before them)
enter the maximum too.
"""
from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from cost_models.cluster import Link
from planner.solver.bound.fill import fill_bound_ms
from planner.solver.bound.islands import (
    COMPRESSED_ALLREDUCE,
    Islands,
    min_wire_bytes,
    partitions,
)
from planner.solver.bound.replicas import replica_bound_ms
from planner.solver.objective import program_lower_bound_ms
from planner.solver.problem import Problem, bound_problem
from planner.solver.search.budget import Work

# Fluid LPs solved per bound, in blocks x kinds (GLOP: ~1 s for 1000 blocks x 44 classes on one core).
LP_CELLS = 40_000


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkBound:
    """The bound, what sets it (``compute``: the fluid LP on the islands a plan must use; ``links``: the
    transfers, all-reduces or stage 0's window across slow links; ``memory``: stage 0's in-flight window with
    no crossing, or the links where no single island holds the model; ``replicas``: the stages' busy time against
    their all-reduce and the last stage's path, ``bound.replicas``; ``fill``: every stage's replicas at their own
    kind's speed after the path before them, and stage 0's optimizer step, ``bound.fill``), the link bandwidth that
    split the islands
    (None: none did) and the islands at the bound."""

    bound_ms: float
    limit: str
    threshold_gbps: float | None
    islands: int


def link_lower_bound_ms(problem: Problem, *, within: Work | None = None) -> float:
    """:func:`link_lower_bound`'s bound (ms)."""
    return link_lower_bound(problem, within=within).bound_ms


def link_lower_bound(problem: Problem, *, within: Work | None = None) -> LinkBound:
    """A lower bound on ``price_program`` of every valid plan of ``problem`` (see the module docstring);
    ``within``: the plan's work budget, which the fill bound's tests are charged to (``bound.fill``)."""
    stage = [c.index for c in problem.classes if c.stage_capable]
    if not stage:
        return LinkBound(bound_ms=0.0, limit="compute", threshold_gbps=None, islands=0)
    window = _Window(problem, stage)
    best = LinkBound(bound_ms=window.bound_ms(None, 0), limit="memory", threshold_gbps=None, islands=1)
    last = replica_bound_ms(problem)
    if last > best.bound_ms:
        best = LinkBound(bound_ms=last, limit="replicas", threshold_gbps=None, islands=1)
    fill = fill_bound_ms(problem, best.bound_ms, within=within)
    if fill > best.bound_ms:
        best = LinkBound(bound_ms=fill, limit="fill", threshold_gbps=None, islands=1)
    lps = _Lps(bound_problem(problem), {c: problem.classes[c].count for c in stage})
    for gbps, isl in partitions(problem, stage):
        found = _split_bound(problem, lps, isl, window, gbps)
        if found.bound_ms > best.bound_ms:
            best = found
    return best


class _Lps:
    """The fluid LP on ``q`` islands, cached by device counts, within a budget of LP cells (blocks x classes);
    past it, the LP of a larger pool already solved, which is no more (a valid bound, only weaker). Classes
    of one kind (the same times and memory: one device type on several hosts) are counted together, so any
    ``q`` islands' devices of a kind are at most the ``q`` largest islands' counts of that kind."""

    def __init__(self, relaxed: Problem, whole: dict[int, int]) -> None:
        self.relaxed, self.left = relaxed, LP_CELLS
        self.kind: dict[int, int] = {}
        first: dict[tuple, int] = {}
        for c in whole:
            key = (relaxed.time_ms[:, c].tobytes(), relaxed.classes[c].mem_bytes)
            self.kind[c] = first.setdefault(key, c)  # a kind is named by its first class
        self.known: dict[tuple, float] = {}

    def by_kind(self, island: Counter) -> Counter:
        out: Counter = Counter()
        for c, n in island.items():
            out[self.kind[c]] += n
        return out

    def on(self, counts: dict[int, int]) -> float:
        key = tuple(sorted((c, n) for c, n in counts.items() if n > 0))
        if key not in self.known:
            cells = self.relaxed.num_blocks * len(key)
            if cells > self.left:
                return max([ms for k, ms in self.known.items() if _covers(dict(k), dict(key))] + [0.0])
            self.left -= cells
            restricted = _restricted(self.relaxed, dict(key))
            self.known[key] = program_lower_bound_ms(restricted)
        return self.known[key]


def _covers(big: dict[int, int], small: dict[int, int]) -> bool:
    """Whether a pool of ``big`` devices per class holds one of ``small`` (its LP is then no more)."""
    return all(big.get(c, 0) >= n for c, n in small.items())


def _split_bound(problem: Problem, lps: _Lps, isl: Islands, window: _Window, gbps: float) -> LinkBound:
    """``min over q`` of ``max(compute on q islands, the links' term at q)`` (module docstring), bisected."""
    Q, M = len(isl.members), problem.num_microbatches
    pol = problem.policy
    ends = pol.enabled and pol.trusted_endpoints
    trusted = [I for I in isl.members if any(problem.classes[c].trusted for c in I)]
    returns = ends and len(trusted) == 1  # both ends on the one trusted island: a route leaves and comes back
    pairs = _crossing_pairs(isl, trusted[0] if returns else None, M)
    links_ms = math.ceil(M / pairs) * 1e3 * window.hop_bytes / isl.between.bytes_per_s if pairs else math.inf
    allreduce_ms = _allreduce_floor_ms(problem, isl.between)

    def rising(q: int) -> float:
        if q == 1:
            return 0.0
        if problem.num_blocks == 1:  # one stage: a plan on two islands replicates it
            return allreduce_ms
        crossings = q if returns else q - 1
        return min(allreduce_ms, max(links_ms, window.bound_ms(isl, crossings)))

    def compute(q: int) -> float:
        pool = [lps.by_kind(I) for I in (isl.members if q > 1 or not ends else trusted)]
        if not pool:
            return math.inf
        return lps.on({k: sum(sorted((I[k] for I in pool), reverse=True)[:q]) for k in {k for I in pool for k in I}})

    if compute(Q) > rising(Q):
        return LinkBound(bound_ms=compute(Q), limit="compute", threshold_gbps=gbps, islands=Q)
    # compute(lo) > rising(lo) (q = 0: no plan), compute(hi) <= rising(hi); the computed LPs are at most the
    # true ones, which fall with q, so q <= lo costs >= compute(lo) and q >= hi >= rising(hi).
    lo, hi = 0, Q
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if compute(mid) > rising(mid) else (lo, mid)
    below = compute(lo) if lo >= 1 else math.inf
    if below <= rising(hi):
        return LinkBound(bound_ms=below, limit="compute", threshold_gbps=gbps, islands=lo)
    memory = math.isinf(compute(1))  # no one island holds the model
    return LinkBound(bound_ms=rising(hi), limit="memory" if memory else "links", threshold_gbps=gbps, islands=hi)


def _crossing_pairs(isl: Islands, home: Counter | None, M: int) -> int:
    """The most device pairs one crossing's activations can spread over: the two largest islands' sizes' product;
    where both ends sit on the one trusted island ``home``, the route leaves it from a stage that is not the last,
    which holds a device of ``home`` too: ``(|home| - 1)`` times the largest other island. At most ``M``."""
    sizes = sorted((sum(I.values()) for I in isl.members), reverse=True)
    if home is None:
        return min(M, sizes[0] * sizes[1])
    away = max(sum(I.values()) for I in isl.members if I is not home)
    return min(M, (sum(home.values()) - 1) * away)


def _allreduce_floor_ms(problem: Problem, between: Link) -> float:
    """The least all-reduce of a stage whose replicas sit on two islands (exact gradients only)."""
    if problem.compress in COMPRESSED_ALLREDUCE:
        return 0.0
    params = int(problem.param_count.min())
    if params == 0:
        return 0.0
    return 1e3 * params * problem.grad_bytes_per_param / between.bytes_per_s + 2 * between.latency_ms


def _restricted(problem: Problem, counts: dict[int, int]) -> Problem:
    """``problem`` with stage class ``c`` holding ``counts[c]`` devices of its kind (none where not named; ids
    made up past its own), for the fluid LP alone: only counts, times and memory matter to it."""
    keep = [c for c in problem.classes if counts.get(c.index, 0) > 0 or not c.stage_capable]
    classes = []
    for i, c in enumerate(keep):
        n = counts.get(c.index, c.count)
        ids = c.device_ids[:n] + tuple(f"{c.name}#{j}" for j in range(c.count, n))
        classes.append(dataclasses.replace(c, index=i, device_ids=ids))
    idx = [c.index for c in keep]
    links = tuple(tuple(problem.links[a][b] for b in idx) for a in idx)
    bwd = None if problem.bwd_ms is None else problem.bwd_ms[:, idx]
    return dataclasses.replace(problem, classes=tuple(classes), links=links, time_ms=problem.time_ms[:, idx],
                               bwd_ms=bwd, twin=None)


class _Window:
    """Stage 0's window (module docstring): per last block ``e`` of stage 0, its least pass, the other blocks'
    least time, and per class how many microbatches a device can hold in flight."""

    def __init__(self, problem: Problem, stage: list[int]) -> None:
        L, M = problem.num_blocks, problem.num_microbatches
        base = problem.tables(False)
        pol = problem.policy
        ends = [c for c in stage if problem.classes[c].trusted or not (pol.enabled and pol.trusted_endpoints)]
        fastest = base.time_ms[:, stage].min(axis=1)
        self.rest_ms = np.concatenate([np.cumsum(fastest[::-1])[::-1][1:], [0.0]])  # blocks after e
        variants = [v for v in (problem, problem.twin) if v is not None]
        mem = {c: max(v.classes[c].mem_bytes for v in variants) for c in stage}
        self.slots = np.zeros((L, len(problem.classes)), dtype=np.int64)  # microbatches in flight, at most M
        self.pass_ms = np.full(L, math.inf)
        for e in range(L):  # e = L - 1: one stage, no round trip
            for c in ends:
                n = max(_slots(v, e, mem[c], M) for v in variants)
                self.slots[e, c] = n
                if n >= 1:
                    self.pass_ms[e] = min(self.pass_ms[e], base.range_time_ms(0, e, c))
        self.problem, self.hop_bytes = problem, min_wire_bytes(problem)

    def bound_ms(self, isl: Islands | None, crossings: int) -> float:
        """``min over e`` of ``M (t + D) / sum n``: stage 0 on one island (any device where ``isl`` is None)."""
        M = self.problem.num_microbatches
        hop = 0.0
        if crossings and self.hop_bytes > 0:
            hop = isl.between.latency_ms + 1e3 * self.hop_bytes / isl.between.bytes_per_s
        groups = [Counter({c.index: c.count for c in self.problem.classes})] if isl is None else isl.members
        held = np.max([sum(n * self.slots[:, c] for c, n in I.items()) for I in groups], axis=0)
        held = np.minimum(held, M)
        ok = (held >= 1) & np.isfinite(self.pass_ms)
        if crossings:  # a route that crosses has a second stage
            ok[-1] = False
        if not ok.any():
            return 0.0
        per = M * (self.pass_ms[ok] + self.rest_ms[ok] + 2 * crossings * hop) / held[ok]
        return float(per.min() * (1 - 1e-9))


def _slots(problem: Problem, e: int, mem_bytes: int, M: int) -> int:
    """Microbatches a device of ``mem_bytes`` running blocks ``0..e`` holds in flight beside its weights and
    state (``in_flight.memory_cap`` without the verifier and all-reduce state), at most ``M``."""
    act = problem.range_act_bytes(0, e)
    room = mem_bytes - problem.range_params(0, e) * problem.state_bytes_per_param - problem.buffer_bytes(0, e)
    if room < 0:
        return 0
    return M if act <= 0 else int(min(M, room // act))
