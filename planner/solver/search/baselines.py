"""Baseline placements priced by the same objective as the solver, and the greedy verifier assignment.

* ``uniform``: every stage device in cluster order gets an equal share of the
  blocks (torchtitan's default split).
* ``params``: same devices, contiguous ranges that balance parameter counts
  (DeepSpeed ``partition_method="parameters"``).
* ``greedy``: same devices, each gets a share of the work proportional to its
  speed (fastest device's block times as the yardstick), shrunk to fit memory.
* ``dp``: the exact homogeneous DP (``planner.solver.search.chain_dp.homogeneous_dp``)
  assuming every device is like the first stage device, on the devices in
  cluster order. Exact on a homogeneous cluster.

Baselines use one device per stage. When the policy wants trusted first and
last stages, the first and last trusted devices of the list move to the ends
(the smallest change to "cluster order" that can satisfy the policy).
Verifiers are then placed by ``verifiers.assign_verifiers`` on the cheapest allowed
site of each checked boundary.
"""
from __future__ import annotations

import math

import numpy as np

from planner.errors import InfeasiblePlanError, InvalidInputError
from planner.solver.objective import (
    Placement,
    even_split,
)
from planner.solver.problem import Problem
from planner.solver.search.budget import Work
from planner.solver.search.chain_dp import homogeneous_dp
from planner.solver.search.deadline import Deadline
from planner.solver.solution import StagePlacement
from planner.solver.verifiers import assign_verifiers

BASELINES = ("uniform", "params", "greedy", "dp")


# --- device orders and stage ranges -------------------------------------------
def stage_devices_in_order(problem: Problem) -> tuple[str, ...]:
    """Stage-capable devices in cluster order, trusted devices moved to the ends if the policy needs it."""
    devices = [d for c in problem.classes if c.stage_capable for d in c.device_ids]
    order = {d: i for i, d in enumerate(problem.device_ids)}
    devices.sort(key=order.__getitem__)
    pol = problem.policy
    if not (pol.enabled and pol.trusted_endpoints) or len(devices) < 2:
        return tuple(devices)
    trusted = [d for d in devices if problem.classes[problem.class_of(d)].trusted]
    if len(trusted) >= 2:
        first, last = trusted[0], trusted[-1]
        middle = [d for d in devices if d not in (first, last)]
        return tuple([first] + middle + [last])
    return tuple(trusted)  # one trusted device (or none): a one-stage pipeline is all that can satisfy it


def _even_ranges(num_blocks: int, num_stages: int) -> tuple[tuple[int, int], ...]:
    q, rem = divmod(num_blocks, num_stages)
    out, s = [], 0
    for k in range(num_stages):
        n = q + (1 if k < rem else 0)
        out.append((s, s + n - 1))
        s += n
    return tuple(out)


def _balanced_ranges(weights: np.ndarray, num_stages: int) -> tuple[tuple[int, int], ...]:
    """Contiguous ranges minimising the largest range weight (binary search + greedy fill)."""
    L = len(weights)
    prefix = np.concatenate([[0.0], np.cumsum(weights, dtype=float)])

    def fill(cap: float) -> tuple[tuple[int, int], ...] | None:
        out, s = [], 0
        for k in range(num_stages - 1):
            e = int(np.searchsorted(prefix, prefix[s] + cap, side="right")) - 2
            e = min(e, L - 1 - (num_stages - 1 - k))  # leave a block for every later stage
            if e < s:
                return None
            out.append((s, e))
            s = e + 1
        if prefix[L] - prefix[s] > cap:
            return None
        return tuple(out) + ((s, L - 1),)

    lo, hi = float(weights.max(initial=0.0)), float(prefix[-1])
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if fill(mid) is None:
            lo = mid
        else:
            hi = mid
    return fill(hi) or _even_ranges(L, num_stages)


def _proportional_ranges(problem: Problem, devices: tuple[str, ...]) -> tuple[tuple[int, int], ...]:
    """Ranges whose share of the chain's work (fastest class's times) follows each device's speed."""
    L, S = problem.num_blocks, len(devices)
    stage_classes = [c.index for c in problem.classes if c.stage_capable]
    ref = problem.time_ms[:, stage_classes].min(axis=1)
    prefix = np.concatenate([[0.0], np.cumsum(ref)])
    speed = np.array([1.0 / max(problem.range_time_ms(0, L - 1, problem.class_of(d)), 1e-12) for d in devices])
    targets = np.cumsum(speed / speed.sum()) * prefix[-1]
    ranges, s = [], 0
    for k in range(S):
        if k == S - 1:
            e = L - 1
        else:
            e = int(np.searchsorted(prefix, targets[k], side="left")) - 1
            e = min(max(e, s), L - 1 - (S - 1 - k))
        ranges.append((s, e))
        s = e + 1
    return tuple(ranges)


def _stages(problem: Problem, ranges: tuple[tuple[int, int], ...],
            devices: tuple[str, ...]) -> tuple[StagePlacement, ...]:
    M = problem.num_microbatches
    return tuple(StagePlacement(index=k, first_block=s, last_block=e, devices=(d,), microbatches=(M,))
                 for k, ((s, e), d) in enumerate(zip(ranges, devices)))


def baseline_placement(name: str, problem: Problem, deadline: Deadline | Work | None = None) -> Placement:
    """The ``name`` baseline's placement (verifiers included). Raises when it cannot satisfy the policy.
    ``deadline``: for ``dp``, whose DP then stops at the best partition found by then."""
    if name not in BASELINES:
        raise InvalidInputError(f"baseline {name!r}", expected=" or ".join(BASELINES))
    devices = stage_devices_in_order(problem)
    if not devices:
        raise InfeasiblePlanError(f"baseline {name}: no device may run a stage under the policy",
                                  fix="add trusted devices or relax trusted_endpoints")
    S = min(len(devices), problem.num_blocks)
    devices = devices[:S - 1] + devices[-1:] if S < len(devices) else devices
    if name == "uniform":
        ranges = _even_ranges(problem.num_blocks, S)
    elif name == "params":
        ranges = _balanced_ranges(problem.param_count.astype(float), S)
    elif name == "greedy":
        ranges = _proportional_ranges(problem, devices)
    else:
        ranges, devices = _dp_ranges(problem, devices, deadline)
    stages = _stages(problem, ranges, devices)
    verifiers = assign_verifiers(problem, stages, problem.num_microbatches)
    if verifiers is None:
        raise InfeasiblePlanError(f"baseline {name}: some boundary has no allowed verifier",
                                  fix="add a trusted device or a CPU verifier host, or relax the policy")
    return Placement(stages=stages, verifiers=verifiers, num_microbatches=problem.num_microbatches)


def _dp_ranges(problem: Problem, devices: tuple[str, ...],
               deadline: Deadline | Work | None) -> tuple[tuple[tuple[int, int], ...], tuple[str, ...]]:
    cls = problem.class_of(devices[0])
    part = homogeneous_dp(problem, cls, len(devices), deadline)
    if part is None:
        raise InfeasiblePlanError("baseline dp: no partition fits in memory on devices like "
                                  f"{problem.classes[cls].spec.name}",
                                  fix="the DP assumes a homogeneous cluster; use the solver instead")
    S = len(part.ranges)
    chosen = devices[:S - 1] + devices[-1:] if S < len(devices) else devices
    return part.ranges, chosen


def single_stage_placements(problem: Problem) -> list[Placement]:
    """Every one-stage plan: the whole chain replicated on r devices of one class (data parallelism)."""
    pol, M, L = problem.policy, problem.num_microbatches, problem.num_blocks
    out = []
    for c in problem.classes:
        if not c.stage_capable or (pol.enabled and pol.trusted_endpoints and not c.trusted):
            continue
        for r in problem.replica_choices(c.index):
            st = StagePlacement(index=0, first_block=0, last_block=L - 1, devices=c.device_ids[:r],
                                microbatches=even_split(M, r))
            out.append(Placement(stages=(st,), verifiers=(), num_microbatches=M))
    return out


def replicas_share(num_microbatches: int, replicas: int) -> float:
    """Busiest replica's share of the microbatches."""
    return math.ceil(num_microbatches / replicas) / num_microbatches
