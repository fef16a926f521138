"""Dynamic programs over the chain: the exact homogeneous DP and the partition of a device sequence.

* :func:`homogeneous_dp`: PipeDream/Alpa-style exact DP for a chain on ``n``
  identical devices joined by one kind of link, one device per stage. It
  minimises the iteration time ``F = sum t_k + (M-1) max t_k`` of
  ``planner.solver.objective`` exactly: first the smallest bottleneck and the
  smallest sum under it ("min bottleneck then min sum"), then every larger
  bottleneck cap at which the smallest sum drops, until a larger cap cannot
  pay off. Memory (1F1B in-flight counts depend on the stage's distance from
  the end, so the DP runs from the end of the chain) is a hard constraint.
* :func:`partition_sequence`: for a fixed sequence of stage groups
  (class, replicas), the contiguous partition with the smallest bottleneck
  (binary search on the cap, greedy furthest-fit probe). A heuristic when
  boundary sizes vary along the chain; exact when they do not.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from cost_models import comm
from cost_models.cluster import Link
from planner.solver.problem import Problem

INF = float("inf")


# --- shared range tables ---------------------------------------------------
def _in_out_ms(problem: Problem, link: Link | None) -> tuple[np.ndarray, np.ndarray]:
    """Transfer time of the boundary before block s (x_in[s]) and after block e (x_out[e]) over ``link``."""
    L = problem.num_blocks
    if link is None:
        return np.zeros(L), np.zeros(L)
    x = np.array([comm.transfer_ms(problem.boundary_bytes(e), link) for e in range(L)])
    x_in = np.concatenate([[0.0], x[:-1]])
    x_out = x.copy()
    x_out[-1] = 0.0
    return x_in, x_out


def _matrices(problem: Problem, cls: int, link: Link | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(t[s, e], static memory[s, e], saved activations[s, e]) of one-device stages; inf below the diagonal."""
    L = problem.num_blocks
    tp = problem._time_prefix[:, cls]
    x_in, x_out = _in_out_ms(problem, link)
    s, e = np.meshgrid(np.arange(L), np.arange(L), indexing="ij")
    valid = e >= s
    t = np.where(valid, tp[e + 1] - tp[s] + x_in[s] + x_out[e], INF)
    pp = problem._param_prefix
    ap = problem._act_prefix
    params = (pp[e + 1] - pp[s]).astype(float)
    for tie in problem.tied:  # a stage reading a tied parameter without its first block keeps a copy
        holds_first = (s <= tie.first_block) & (tie.first_block <= e)
        reads = np.zeros_like(valid)
        for r in tie.readers:
            reads |= (s <= r) & (r <= e)
        params += np.where(reads & ~holds_first, tie.param_count, 0)
    out_int = problem.out_bytes_int.astype(float)
    in_act = np.where(s == 0, problem.input_bytes, out_int[np.maximum(s - 1, 0)])
    in_grad = np.where(s == 0, 0.0, in_act)
    out_act = np.where(e < L - 1, out_int[e], 0.0)
    static = np.where(valid, params * problem.state_bytes_per_param + in_act + in_grad + 2 * out_act, INF)
    act = np.where(valid, (ap[e + 1] - ap[s]).astype(float), INF)
    return t, static, act


def _in_flight(problem: Problem, from_end: int, share: int) -> int:
    """1F1B: min(m, S - k) where S - k = stages from the end, this one included; GPipe: m."""
    return share if problem.schedule == "gpipe" else min(share, from_end)


# --- exact homogeneous DP ---------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class ChainPartition:
    """Stage ranges ``(first, last)`` and the DP's own figures for them."""

    ranges: tuple[tuple[int, int], ...]
    bottleneck_ms: float
    sum_ms: float
    step_ms: float


def _layers(t: np.ndarray, static: np.ndarray, act: np.ndarray, problem: Problem, cap_mem: int,
            max_stages: int, cap_ms: float) -> list[np.ndarray]:
    """Min-sum tables V[j][s]: best sum of stages s.. as the last j stages, every stage <= ``cap_ms``."""
    L, M = problem.num_blocks, problem.num_microbatches
    nxt = np.full(L + 1, INF)
    nxt[L] = 0.0
    tables = [nxt]
    for j in range(1, max_stages + 1):
        fits = static + act * _in_flight(problem, j, M) <= cap_mem
        cost = np.where(fits & (t <= cap_ms), t, INF) + tables[-1][1:][None, :]
        row = np.full(L + 1, INF)
        row[:L] = cost.min(axis=1)
        tables.append(row)
    return tables


def _bottleneck(t: np.ndarray, static: np.ndarray, act: np.ndarray, problem: Problem, cap_mem: int,
                max_stages: int) -> float:
    L, M = problem.num_blocks, problem.num_microbatches
    nxt = np.full(L + 1, INF)
    nxt[L] = 0.0
    best = INF
    for j in range(1, max_stages + 1):
        fits = static + act * _in_flight(problem, j, M) <= cap_mem
        cost = np.maximum(np.where(fits, t, INF), nxt[1:][None, :])
        row = np.full(L + 1, INF)
        row[:L] = cost.min(axis=1)
        nxt = row
        best = min(best, row[0])
    return best


def _trace(tables: list[np.ndarray], t: np.ndarray, static: np.ndarray, act: np.ndarray, problem: Problem,
           cap_mem: int, cap_ms: float, j: int) -> tuple[tuple[int, int], ...]:
    ranges, s, M = [], 0, problem.num_microbatches
    while j > 0:
        fits = static[s] + act[s] * _in_flight(problem, j, M) <= cap_mem
        cost = np.where(fits & (t[s] <= cap_ms), t[s], INF) + tables[j - 1][1:]
        e = int(np.argmin(cost))
        ranges.append((s, e))
        s, j = e + 1, j - 1
    return tuple(ranges)


def homogeneous_dp(problem: Problem, cls: int, num_devices: int) -> ChainPartition | None:
    """Exact min of ``F`` over partitions into at most ``num_devices`` one-device stages on class ``cls``.

    Assumes what a homogeneous cluster gives: every stage on a device of
    ``cls``, every boundary over ``problem.links[cls][cls]``, no verification
    load (trusted devices). Returns None when no partition fits in memory.
    """
    L, M = problem.num_blocks, problem.num_microbatches
    S_max = min(num_devices, L)
    link = problem.links[cls][cls] if S_max > 1 else None
    t, static, act = _matrices(problem, cls, link)
    cap_mem = problem.classes[cls].mem_bytes
    if S_max == 1:  # a single stage pays no boundary transfer
        t, static, act = _matrices(problem, cls, None)
    t_star = _bottleneck(t, static, act, problem, cap_mem, S_max)
    if not math.isfinite(t_star):
        return None
    candidates = np.unique(t[np.isfinite(t) & (t >= t_star)])
    floor_sum = _best_sum(problem, t, static, act, cap_mem, S_max, INF)[0]
    best: ChainPartition | None = None
    i = int(np.searchsorted(candidates, t_star))
    while i < len(candidates):
        cap = float(candidates[i])
        total, j, tables = _best_sum(problem, t, static, act, cap_mem, S_max, cap)
        ranges = _trace(tables, t, static, act, problem, cap_mem, cap, j)
        bott = max(float(t[s, e]) for s, e in ranges)
        step = total + (M - 1) * bott
        if best is None or step < best.step_ms - 1e-12:
            best = ChainPartition(ranges=ranges, bottleneck_ms=bott, sum_ms=total, step_ms=step)
        if M == 1 or total <= floor_sum + 1e-12:
            break
        # The next cap worth trying is the smallest one at which the best sum drops below ``total``.
        limit = (best.step_ms - floor_sum) / (M - 1)
        hi = int(np.searchsorted(candidates, limit, side="right"))
        lo = i + 1
        if lo >= hi:
            break
        if _best_sum(problem, t, static, act, cap_mem, S_max, float(candidates[hi - 1]))[0] >= total - 1e-12:
            break
        while lo < hi - 1:  # invariant: the sum drops at candidates[hi - 1], not at candidates[lo - 1]
            mid = (lo + hi - 1) // 2
            if _best_sum(problem, t, static, act, cap_mem, S_max, float(candidates[mid]))[0] < total - 1e-12:
                hi = mid + 1
            else:
                lo = mid + 1
        i = hi - 1
    return best


def _best_sum(problem: Problem, t: np.ndarray, static: np.ndarray, act: np.ndarray, cap_mem: int,
              S_max: int, cap_ms: float) -> tuple[float, int, list[np.ndarray]]:
    tables = _layers(t, static, act, problem, cap_mem, S_max, cap_ms)
    firsts = [tab[0] for tab in tables]
    j = int(np.argmin(firsts[1:])) + 1
    return float(firsts[j]), j, tables


# --- partition of a fixed device sequence -----------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class Group:
    """A stage's devices in a sequence: ``replicas`` devices of class ``cls``."""

    cls: int
    replicas: int = 1


def partition_sequence(problem: Problem, groups: tuple[Group, ...]) -> tuple[tuple[int, int], ...] | None:
    """Smallest-bottleneck contiguous ranges for stages on ``groups`` in order (None: nothing fits).

    Stage times here are compute plus the worst boundary transfer to each
    neighbour (verification is priced afterwards by the objective).
    """
    L, S = problem.num_blocks, len(groups)
    if S > L:
        return None
    stage = [_StageCosts(problem, groups, k) for k in range(S)]
    lo, hi = 0.0, max(sc.upper() for sc in stage)
    if _probe(stage, hi, L) is None:
        return None
    for _ in range(48):
        mid = 0.5 * (lo + hi)
        if _probe(stage, mid, L) is None:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-9 * max(hi, 1e-9):
            break
    return _probe(stage, hi, L)


class _StageCosts:
    """Prefix tables of one stage of a sequence, for the furthest-fit probe."""

    def __init__(self, problem: Problem, groups: tuple[Group, ...], k: int) -> None:
        g, S, M = groups[k], len(groups), problem.num_microbatches
        L = problem.num_blocks
        self.k, self.S, self.L = k, S, L
        self.share = math.ceil(M / g.replicas) / M
        self.time_prefix = problem._time_prefix[:, g.cls]
        self.x_in = np.zeros(L)
        self.x_out = 0.0
        if k > 0:
            lk = _group_link(problem, g, groups[k - 1])
            self.x_in = np.array([0.0] + [comm.transfer_ms(problem.boundary_bytes(e), lk) for e in range(L - 1)])
        if k < S - 1:
            lk = _group_link(problem, g, groups[k + 1])
            # The cut after this stage is not known yet: price the largest boundary (conservative).
            self.x_out = comm.transfer_ms(float(problem.out_bytes[:-1].max()) if L > 1 else 0.0, lk)
        m_share = math.ceil(M / g.replicas)
        in_flight = _in_flight(problem, S - k, m_share)
        pp = problem._param_prefix.astype(float)
        ap = problem._act_prefix.astype(float)
        self.mem_prefix = pp * problem.state_bytes_per_param + ap * in_flight
        self.mem_slack = problem.classes[g.cls].mem_bytes - 4 * float(problem.out_bytes_int.max()) \
            - problem.input_bytes - sum(t.param_count for t in problem.tied) * problem.state_bytes_per_param

    def upper(self) -> float:
        return self.share * (float(self.time_prefix[-1]) + float(self.x_in.max()) + self.x_out) + 1.0

    def furthest(self, s: int, cap_ms: float) -> int:
        """Largest end e >= s - 1 with the stage s..e within the cap and the memory (s - 1: nothing fits)."""
        budget = cap_ms / self.share - self.x_in[s] - (self.x_out if self.k < self.S - 1 else 0.0)
        e_time = int(np.searchsorted(self.time_prefix, self.time_prefix[s] + budget, side="right")) - 2
        e_mem = int(np.searchsorted(self.mem_prefix, self.mem_prefix[s] + self.mem_slack, side="right")) - 2
        return min(e_time, e_mem, self.L - 1)


def _group_link(problem: Problem, a: Group, b: Group) -> Link:
    lk = problem.links[a.cls][b.cls]
    assert lk is not None, "two stages on one device"
    return lk


def _probe(stage: list[_StageCosts], cap_ms: float, L: int) -> tuple[tuple[int, int], ...] | None:
    ranges, s, S = [], 0, len(stage)
    for k, sc in enumerate(stage):
        if k == S - 1:
            if sc.furthest(s, cap_ms) < L - 1:
                return None
            ranges.append((s, L - 1))
            return tuple(ranges)
        e = min(sc.furthest(s, cap_ms), L - 1 - (S - 1 - k))  # leave a block for every later stage
        if e < s:
            return None
        ranges.append((s, e))
        s = e + 1
    return None


# --- heuristic search over device sequences -----------------------------------
def sequence_placement(problem: Problem, groups: tuple[Group, ...]):
    """The placement of a group sequence: best-bottleneck ranges, greedy verifiers, priced (or None)."""
    from planner.solver.baselines import assign_verifiers  # local: baselines builds on this module
    from planner.solver.objective import Placement, evaluate, even_split, violations
    from planner.solver.solution import StagePlacement

    ranges = partition_sequence(problem, groups)
    if ranges is None:
        return None
    M, free = problem.num_microbatches, {}
    stages = []
    for k, (g, (s, e)) in enumerate(zip(groups, ranges)):
        pool = free.setdefault(g.cls, list(problem.classes[g.cls].device_ids))
        devices = tuple(pool[:g.replicas])
        del pool[:g.replicas]
        stages.append(StagePlacement(index=k, first_block=s, last_block=e, devices=devices,
                                     microbatches=even_split(M, g.replicas)))
    stages = tuple(stages)
    verifiers = assign_verifiers(problem, stages, M)
    if verifiers is None:
        return None
    placement = Placement(stages=stages, verifiers=verifiers, num_microbatches=M)
    ev = evaluate(problem, placement)
    if violations(problem, placement, ev):
        return None
    return placement, ev.step_ms


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


def _seed_sequences(problem: Problem) -> list[tuple[Group, ...]]:
    """Fastest-devices-first sequences of every length, trusted devices at the ends, classes kept together."""
    stage = [c for c in problem.classes if c.stage_capable]
    speed = {c.index: 1.0 / max(problem.range_time_ms(0, problem.num_blocks - 1, c.index), 1e-12) for c in stage}
    devices = sorted(((c.index, i) for c in stage for i in range(c.count)), key=lambda ci: -speed[ci[0]])
    pol = problem.policy
    need_trust = pol.enabled and pol.trusted_endpoints
    out = []
    max_s = min(problem.num_blocks, len(devices))
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


def _neighbours(problem: Problem, groups: tuple[Group, ...], rng: np.random.Generator) -> list[tuple[Group, ...]]:
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
        if 2 <= len(cand) <= problem.num_blocks and _fits_counts(problem, cand) and _endpoint_ok(problem, cand):
            out.append(cand)
    return out


def search_sequences(problem: Problem, *, time_budget_s: float, seed: int = 0):
    """Best (placement, step_ms) found over seeded sequences and a short randomised local search."""
    import time
    start = time.perf_counter()
    best = None
    best_groups: tuple[Group, ...] | None = None
    for groups in _seed_sequences(problem):
        if not _fits_counts(problem, groups):
            continue
        got = sequence_placement(problem, groups)
        if got is not None and (best is None or got[1] < best[1]):
            best, best_groups = got, groups
        if time.perf_counter() - start > time_budget_s / 2:
            break
    rng = np.random.default_rng(seed)
    tried: set[tuple[Group, ...]] = set()
    stale = 0  # rounds without a new candidate: the neighbourhood is exhausted
    while best_groups is not None and time.perf_counter() - start < time_budget_s and stale < 30:
        stale += 1
        for cand in _neighbours(problem, best_groups, rng):
            if cand in tried:
                continue
            tried.add(cand)
            stale = 0
            got = sequence_placement(problem, cand)
            if got is not None and got[1] < best[1] - 1e-9:
                best, best_groups = got, cand
                break
    return best
