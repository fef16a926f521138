"""A lower bound on the compiled programs' cost (``objective.price_program``) from the stage that holds the last block.

The fluid LP prices throughput alone: ``r`` replicas of a stage do its work ``r`` times as fast. But every
microbatch crosses a replica at that replica's own speed, and replicas pay an all-reduce. The last stage ``K``
(the one holding block ``L - 1``) with ``r`` replicas, one of which runs ``m >= ceil(M / r)`` microbatches:

* **Busy and path.** That replica is busy ``m t`` (``t >= t_{L-1}``, the last block's least time on a class
  that may hold it), and ``program_cost`` adds its first microbatch's forward path to it and its last one's
  backward path from it (1F1B: the last stage keeps one microbatch in flight, so it idles, never overlaps;
  GPipe: its forward and backward phases): ``pipe >= ceil(M/r) t_{L-1} + U``. ``U`` is at least every block
  before ``L - 1`` forward (least forward over classes) and backward (least backward), blocks of ``K`` itself
  included (a block of ``K`` costs ``m >= 1`` times its whole pass there), and ``2 (S_min - 1)`` hops of the
  smallest boundary over the fastest link, ``S_min`` the fewest stages whose blocks fit the largest memory.
* **All-reduce.** With ``r >= 2`` the step ends no sooner than ``K``'s all-reduce (``step >= finish_K + AR_K``):
  a ring of ``r`` devices moves ``2 (r-1)/r`` times the last block's gradients at least over its slowest link,
  and waits ``2 (r-1)`` latencies. That link is no faster than the fastest link of the pool, and where ``r``
  exceeds every island of a threshold's partition (``islands.islands_at``), no faster than the fastest link
  between two of its islands. Exact gradients only (``--compress auto/int8`` may compress it: the term is then
  ``ceil(M/r) t_{L-1} + U`` alone).

``step >= min over r of max(ceil(M/r) t_{L-1} + U, AR(r))``, ``r`` up to the devices that may hold block
``L - 1`` (trusted ones where the ends must be trusted). On DT-FM's pools, whose every link is 2 Gb/s or
slower, the head (103M parameters, the slowest block) binds: one replica is ``M`` heads, several an all-reduce
of 206 MB over 2 Gb/s.
"""
from __future__ import annotations

import math

import numpy as np

from cost_models.cluster import Link
from planner.solver.bound.islands import (
    COMPRESSED_ALLREDUCE,
    min_wire_bytes,
    partitions,
    relaxed,
)
from planner.solver.problem import Problem


def last_stage_bound_ms(problem: Problem) -> float:
    """The bound of the module docstring (ms; 0 where no class may hold the last block)."""
    problem = relaxed(problem)
    L, M = problem.num_blocks, problem.num_microbatches
    stage = [c.index for c in problem.classes if c.stage_capable]
    need = problem.param_count.astype(float) * problem.state_bytes_per_param + problem.act_bytes
    pol = problem.policy
    ends = pol.enabled and pol.trusted_endpoints
    last = [c for c in stage if need[L - 1] <= problem.classes[c].mem_bytes
            and (problem.classes[c].trusted or not ends)]
    if not last:
        return 0.0
    t_last = float(problem.time_ms[L - 1, last].min())
    path = _path_ms(problem, stage, need)
    replicas = min(M, sum(problem.classes[c].count for c in last))
    ar = _ring_floors(problem, last, replicas)
    found = min(max(math.ceil(M / r) * t_last + path, ar[r]) for r in range(1, replicas + 1))
    return found * (1 - 1e-9)


def _path_ms(problem: Problem, stage: list[int], need: np.ndarray) -> float:
    """``U``: the blocks before the last forward and backward at their least, and the fewest hops."""
    bwd = problem.time_ms * (2.0 / 3.0) if problem.bwd_ms is None else problem.bwd_ms
    fwd = problem.time_ms - bwd
    L = problem.num_blocks
    passes = float(fwd[:L - 1, stage].min(axis=1).sum() + bwd[:L - 1, stage].min(axis=1).sum())
    hops = _fewest_stages(need, max(problem.classes[c].mem_bytes for c in stage)) - 1
    if hops <= 0:
        return passes
    fast = _fastest(problem, stage)
    wire = min_wire_bytes(problem)
    hop = 0.0 if fast is None or wire <= 0 else fast.latency_ms + 1e3 * wire / fast.bytes_per_s
    return passes + 2 * hops * hop


def _fewest_stages(need: np.ndarray, mem_bytes: int) -> int:
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


def _ring_floors(problem: Problem, classes: list[int], replicas: int) -> list[float]:
    """Per replica count ``r`` (index; 0 unused), the least all-reduce of the last block's gradients over a ring of
    ``r`` devices of ``classes`` (0 without exact gradients)."""
    out = [0.0] * (replicas + 1)
    params = float(problem.param_count[-1]) * problem.grad_bytes_per_param
    if problem.compress in COMPRESSED_ALLREDUCE or params <= 0:
        return out
    best = _fastest(problem, classes)
    splits = [(max(sum(I.values()) for I in isl.members), isl.between) for _, isl in partitions(problem, classes)]
    for r in range(2, replicas + 1):
        slow = [between for largest, between in splits if r > largest]
        links = slow + ([best] if best is not None else [])
        if not links:  # no two devices joined: no ring of r
            out[r] = math.inf
            continue
        out[r] = max(2 * (r - 1) / r * 1e3 * params / lk.bytes_per_s + 2 * (r - 1) * lk.latency_ms for lk in links)
    return out
