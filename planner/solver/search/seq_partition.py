"""Stage ranges for a fixed sequence of stage groups that minimise the iteration time, by DP.

``chain_dp.partition_sequence`` balances the bottleneck with a conservative price
for the cut it has not chosen yet; on chains whose boundary sizes vary and
links are slow that leaves a lot on the table. Here, for the groups in
order (class, replicas), every stage's time is exact given its range:
``h (compute + activation out + gradient back + verifier copies)`` with
``h = ceil(M/r)/M``, the copies priced as the cheapest trusted site unless
the receiving stage can verify (one trusted device). Memory uses the stage's
own 1F1B in-flight count; a replicated stage all-reduces its parameters'
gradients (``Problem.allreduce_line``). Two DPs over (stage, first block)
(``seqpart_kernel``): the smallest bottleneck ``T*``, then the smallest sum
of stage times under a few caps ``>= T*``; the pick minimises
``sum + (M - 1) max + max all-reduce``, repeated under a few caps on the
all-reduce. The plan is then priced exactly by the objective.
"""
from __future__ import annotations

import math

import numpy as np

from cost_models import comm, memory
from planner.solver.objective import Placement, evaluate, even_split, violations
from planner.solver.problem import Problem
from planner.solver.problem_memo import ProblemMemo
from planner.solver.search.chain_dp import Group, partition_sequence
from planner.solver.search.seq_partition_kernel import min_bottleneck, min_sum
from planner.solver.solution import StagePlacement
from planner.solver.verifiers import assign_verifiers

INF = math.inf
CAP_STEPS = (1.0, 1.01, 1.03, 1.06, 1.1, 1.16, 1.25, 1.4)
# Caps on the largest all-reduce, as fractions of the best compute-balanced partition's.
AR_STEPS = (0.85, 0.7, 0.55, 0.4, 0.3, 0.2, 0.12, 0.06)
CAP_STEPS_AR = (1.0, 1.03, 1.1, 1.25)  # bottleneck caps tried under each all-reduce cap
AR_WORTH = 0.01  # an all-reduce below this share of the iteration is not worth re-partitioning for
SCREEN_CAPS = (1.0, 1.03)  # bottleneck caps of ``screen_step``


class _Stage:
    """Per-stage tables: time prefix, sends, memory prefix and budget."""

    def __init__(self, problem: Problem, groups: tuple[Group, ...], k: int, copy_ms) -> None:
        p, L, M, S = problem, problem.num_blocks, problem.num_microbatches, len(groups)
        g = groups[k]
        c = p.classes[g.cls]
        self.h = math.ceil(M / g.replicas) / M
        self.cp = p._time_prefix[:, g.cls]
        self.fwd = np.zeros(L)
        self.bwd = np.zeros(L)
        pol = p.policy
        checked = pol.enabled and not c.trusted

        def sole_verifier(o: Group) -> bool:
            return o.replicas == 1 and p.classes[o.cls].trusted

        if k < S - 1:
            lk = p.links[g.cls][groups[k + 1].cls]
            self.fwd[:L - 1] = p.boundary_transfer_ms(lk) if lk else INF
            if checked and not sole_verifier(groups[k + 1]):
                self.fwd[:L - 1] += copy_ms(g.cls)
        if k > 0:
            lk = p.links[g.cls][groups[k - 1].cls]
            self.bwd[1:] = p.boundary_transfer_ms(lk) if lk else INF
            if checked and pol.check_gradients and not sole_verifier(groups[k - 1]):
                self.bwd[1:] += copy_ms(g.cls)
        in_flight = memory.in_flight_microbatches(p.schedule, S, k, math.ceil(M / g.replicas))
        self.mp = p._param_prefix.astype(float) * p.state_bytes_per_param + p._act_prefix.astype(float) * in_flight
        out = p.out_bytes_int.astype(float)
        self.in_buf = np.concatenate([[float(p.input_bytes)], 2 * out[:-1]])
        self.out_buf = np.concatenate([2 * out[:-1], [0.0]]) if k < S - 1 else np.zeros(L)
        self.mem_cap = float(c.mem_bytes)


def copy_table(problem: Problem):
    """ms of a verifier copy of each boundary from a class: the cheapest trusted site allowed."""
    pol = problem.policy
    sites = [c.index for c in problem.classes if c.trusted and (
        (c.stage_capable and pol.verifier_placement in ("any", "stage"))
        or (c.verifier_host and pol.verifier_placement in ("any", "cpu")))]
    cache: dict[int, np.ndarray] = {}

    def copy_ms(cls: int) -> np.ndarray:
        if cls not in cache:
            rows = [[comm.transfer_ms(problem.boundary_bytes(e), problem.links[cls][v])
                     for e in range(problem.num_blocks - 1)] for v in sites if v != cls]
            cache[cls] = np.min(rows, axis=0) if rows else np.full(problem.num_blocks - 1, INF)
        return cache[cls]
    return copy_ms


# Partitions already computed: the grids re-partition the same groups of classes again (each count's seeds, then
# its rivals; 276 calls, 176 distinct, on the 176-device pool).
_PARTS: ProblemMemo[tuple[tuple[int, int], ...] | None] = ProblemMemo(kept=512)


def partition_min_step(problem: Problem, groups: tuple[Group, ...]) -> tuple[tuple[int, int], ...] | None:
    """Ranges for ``groups`` minimising ``sum tau + (M - 1) max tau + max all-reduce`` (None: nothing fits)."""
    return _PARTS.get(problem, groups, lambda: _partition_min_step(problem, groups))


def _partition_min_step(problem: Problem, groups: tuple[Group, ...]) -> tuple[tuple[int, int], ...] | None:
    L, S, M = problem.num_blocks, len(groups), problem.num_microbatches
    if S > L:
        return None
    copy_ms = copy_table(problem)
    args = _kernel_args(problem, groups, [_Stage(problem, groups, k, copy_ms) for k in range(S)])
    best = min_step(args, M)
    return None if best is None else best[1]


def screen_step(problem: Problem, groups: tuple[Group, ...], copy_ms=None) -> float:
    """A quick estimate of :func:`partition_min_step`'s iteration time for ``groups`` (inf: nothing fits): the
    bottleneck DP and the min-sum DP under two caps, without the all-reduce caps (3 kernel calls of ~40).
    ``copy_ms``: a :func:`copy_table` of ``problem`` to share between calls."""
    if len(groups) > problem.num_blocks:
        return INF
    copy_ms = copy_ms or copy_table(problem)
    args = _kernel_args(problem, groups, [_Stage(problem, groups, k, copy_ms) for k in range(len(groups))])
    got = _best_under(args, INF, problem.num_microbatches, caps=SCREEN_CAPS)
    return INF if got is None else got[0]


def min_step(args: tuple, M: int) -> tuple[float, tuple[tuple[int, int], ...], float] | None:
    """(iteration time, ranges, largest all-reduce) of the best partition found for the kernel tables."""
    best = _best_under(args, INF, M)
    if best is None:
        return None
    # A replicated stage over slow links can all-reduce for longer than the whole pipeline fill; the
    # partition that balances compute alone then loses to one that moves parameters off that stage.
    top = best[2]
    for f in AR_STEPS if top > AR_WORTH * best[0] else ():
        got = _best_under(args, f * top, M, caps=CAP_STEPS_AR)
        if got is not None and got[0] < best[0] - 1e-12:
            best = got
    return best


def _kernel_args(problem: Problem, groups: tuple[Group, ...], stages: list[_Stage]) -> tuple:
    ar = [problem.allreduce_line(g.cls, g.replicas) for g in groups]
    return (np.array([st.h for st in stages]), np.stack([st.cp for st in stages]),
            np.stack([st.fwd for st in stages]), np.stack([st.bwd for st in stages]),
            np.stack([st.mp for st in stages]), stages[0].in_buf, np.stack([st.out_buf for st in stages]),
            np.array([st.mem_cap for st in stages]), np.array([a for a, _ in ar]), np.array([b for _, b in ar]),
            problem._param_prefix.astype(float))


def _best_under(args: tuple, ar_cap_ms: float, M: int, *, caps: tuple[float, ...] = CAP_STEPS
                ) -> tuple[float, tuple[tuple[int, int], ...], float] | None:
    """(iteration time, ranges, largest all-reduce) of the best partition with every all-reduce <= the cap."""
    t_star = min_bottleneck(*args, ar_cap_ms)
    if not math.isfinite(t_star):
        return None
    H, CP, FWD, BWD, *_, AR0, AR1, PP = args
    S, L = CP.shape[0], CP.shape[1] - 1
    choice = np.zeros((S, L), np.int64)
    best = None
    for f in caps if M > 1 else (INF,):
        if not math.isfinite(min_sum(*args, t_star * f, ar_cap_ms, choice)):
            continue
        ranges, s, total, peak, ar = [], 0, 0.0, 0.0, 0.0
        for k in range(S):
            e = int(choice[k, s])
            ranges.append((s, e))
            tau = float(H[k] * (CP[k, e + 1] - CP[k, s] + FWD[k, e] + BWD[k, s]))
            total, peak = total + tau, max(peak, tau)
            if PP[e + 1] > PP[s] and (AR0[k] or AR1[k]):
                ar = max(ar, float(AR0[k] + AR1[k] * (PP[e + 1] - PP[s])))
            s = e + 1
        step = total + (M - 1) * peak + ar
        if best is None or step < best[0] - 1e-12:
            best = (step, tuple(ranges), ar)
    return best


def sequence_placement(problem: Problem, groups: tuple[Group, ...], *, exact: bool = False):
    """The placement of a group sequence: greedy verifiers, priced (or None).

    Ranges: best-bottleneck (``partition_sequence``), or with ``exact`` the
    DP of :func:`partition_min_step` (exact stage sends, min iteration time).
    """
    ranges = partition_min_step(problem, groups) if exact else partition_sequence(problem, groups)
    placement = None if ranges is None else placed(problem, groups, ranges)
    if placement is None:
        return None
    ev = evaluate(problem, placement)
    if violations(problem, placement, ev):
        return None
    return placement, ev.step_ms


def placed(problem: Problem, groups: tuple[Group, ...], ranges: tuple[tuple[int, int], ...]) -> Placement | None:
    """``groups`` on ``ranges``, each class's devices taken in order, verifiers placed greedily (None: some
    boundary has no verifier); constraints not checked."""
    M, free = problem.num_microbatches, {}
    stages = []
    for k, (g, (s, e)) in enumerate(zip(groups, ranges)):
        pool = free.setdefault(g.cls, list(problem.classes[g.cls].device_ids))
        stages.append(StagePlacement(index=k, first_block=s, last_block=e, devices=tuple(pool[:g.replicas]),
                                     microbatches=even_split(M, g.replicas)))
        del pool[:g.replicas]
    verifiers = assign_verifiers(problem, tuple(stages), M)
    return None if verifiers is None else Placement(stages=tuple(stages), verifiers=verifiers, num_microbatches=M)
