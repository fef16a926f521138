"""Warm start for a re-plan: the old plan's stages, repaired to the devices left, offered as starting plans.

A :class:`WarmStart` is the old plan's stage partition and placement (per stage its blocks and devices).
:func:`warm_placements` repairs it to a problem's devices by the simplest valid repair: a lost device
leaves its stage's replica group (the microbatches spread over the replicas left, in the old shares); a
stage left with no device takes as many free devices (freed capacity: devices the old plan did not use, a
re-admitted host's) as it had replicas, of the one class that runs its blocks fastest that way (trusted
at a trusted endpoint), else its blocks join the neighbouring stage. A second repair also tops up every
stage that lost replicas the same way (one class, up to the number lost). Verifiers are placed again
greedily (``verifiers.assign_verifiers``). Each repair, and the same devices with the cuts chosen again for
them (``seq_partition.partition_min_step``), are the search's first incumbents
(``count_search.search_count``); one that breaks memory or the policy is skipped.
"""
from __future__ import annotations

from dataclasses import dataclass

from planner.errors import InvalidInputError
from planner.solver.objective import Placement, evaluate, violations
from planner.solver.problem import Problem
from planner.solver.search.chain_dp import Group
from planner.solver.search.seq_partition import partition_min_step
from planner.solver.solution import StagePlacement
from planner.solver.verifiers import assign_verifiers


@dataclass(frozen=True, slots=True, kw_only=True)
class WarmStage:
    """An old stage: blocks ``first_block..last_block`` on ``devices`` (its replicas), running ``shares``
    of the step's microbatches (one per device)."""

    first_block: int
    last_block: int
    devices: tuple[str, ...]
    shares: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.devices or len(self.shares) != len(self.devices) or min(self.shares) < 1:
            raise InvalidInputError("warm-start stage", expected="devices with one share >= 1 each",
                                    found=f"{self.devices} {self.shares}")


@dataclass(frozen=True, slots=True, kw_only=True)
class WarmStart:
    """The old plan's stages, in order (contiguous, covering the chain)."""

    stages: tuple[WarmStage, ...]


def warm_placements(problem: Problem, warm: WarmStart) -> list[tuple[Placement, float, str]]:
    """Valid starting plans for ``problem`` from ``warm``, priced by the search's closed form."""
    if not warm.stages or warm.stages[-1].last_block != problem.num_blocks - 1:
        return []  # another chain: nothing to start from
    out: list[tuple[Placement, float, str]] = []
    tried: list = []
    for top_up in (False, True):
        groups = _repair(problem, warm, top_up=top_up)
        if groups is not None and groups not in tried:
            tried.append(groups)
            out += _candidates(problem, groups, "warm-start, topped up" if top_up else "warm-start")
    return out


def _candidates(problem: Problem, groups: list[tuple[WarmStage, tuple[str, ...]]],
                how: str) -> list[tuple[Placement, float, str]]:
    """The repaired stages as they are and with their cuts chosen again, where valid."""
    out = []
    ranges = [(s.first_block, s.last_block) for s, _ in groups]
    found = _placed(problem, ranges, [d for _, d in groups], [s for s, _ in groups])
    if found is not None:
        out.append((*found, how))
    classes = [{problem.class_of(d) for d in devs} for _, devs in groups]
    if all(len(c) == 1 for c in classes):  # the cuts chosen again for the repaired devices
        cut = partition_min_step(problem, tuple(Group(cls=min(c), replicas=len(devs))
                                                for c, (_, devs) in zip(classes, groups)))
        if cut is not None and list(cut) != ranges:
            found = _placed(problem, list(cut), [d for _, d in groups], [s for s, _ in groups])
            if found is not None:
                out.append((*found, f"{how}, re-partitioned"))
    return out


def _repair(problem: Problem, warm: WarmStart, *, top_up: bool) -> list[tuple[WarmStage, tuple[str, ...]]] | None:
    """Per stage left, (the old stage with its blocks, the devices it keeps or takes); None when nothing is
    left. ``top_up``: a stage that lost some replicas takes free devices for them too."""
    known = set(problem.device_ids)
    capable = {d for c in problem.classes if c.stage_capable for d in c.device_ids}
    kept = [(st, tuple(d for d in st.devices if d in known and d in capable)) for st in warm.stages]
    free = sorted(capable - {d for _, devs in kept for d in devs}, key=problem.device_ids.index)
    pol = problem.policy
    out: list[tuple[WarmStage, tuple[str, ...]]] = []
    for k, (st, devs) in enumerate(kept):
        lost = len(st.devices) - len(devs)
        if lost and (top_up or not devs):
            end = k in (0, len(kept) - 1) and pol.enabled and pol.trusted_endpoints
            extra = _free_group(problem, st, [d for d in free if problem.classes[problem.class_of(d)].trusted
                                              or not end], lost)
            devs += extra
            free = [d for d in free if d not in extra]
        if devs:
            out.append((st, devs))
        elif out:  # no device for it: its blocks join the previous stage
            prev, pdevs = out[-1]
            out[-1] = (_widened(prev, prev.first_block, st.last_block), pdevs)
        else:
            out.append((_widened(st, st.first_block, st.last_block), ()))  # joins the next stage below
    if out and not out[0][1]:
        if len(out) == 1:
            return None
        (head, _), (nxt, ndevs) = out[0], out[1]
        out[:2] = [(_widened(nxt, head.first_block, nxt.last_block), ndevs)]
    return out or None


def _free_group(problem: Problem, st: WarmStage, free: list[str], count: int) -> tuple[str, ...]:
    """Up to ``count`` free devices of one class that can hold the stage's weights and optimizer state, the
    class whose share of the stage's work per device taken is least (empty when none is free)."""
    state_bytes = problem.range_params(st.first_block, st.last_block) * problem.state_bytes_per_param
    by_class: dict[int, list[str]] = {}
    for d in free:
        if problem.classes[problem.class_of(d)].mem_bytes >= state_bytes:
            by_class.setdefault(problem.class_of(d), []).append(d)
    if not by_class:
        return ()
    cls = min(by_class, key=lambda c: (problem.range_time_ms(st.first_block, st.last_block, c)
                                       / min(count, len(by_class[c])), c))
    return tuple(by_class[cls][:count])


def _widened(st: WarmStage, first: int, last: int) -> WarmStage:
    return WarmStage(first_block=first, last_block=last, devices=st.devices, shares=st.shares)


def _shares(old: WarmStage, devices: tuple[str, ...], M: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The replicas kept and their microbatch counts: ``M`` split in the old shares (new devices: the
    mean share), at least one each (replicas beyond ``M`` are dropped)."""
    devices = devices[:M]
    old_share = dict(zip(old.devices, old.shares))
    mean = sum(old.shares) / len(old.shares)
    weights = [old_share.get(d, mean) for d in devices]
    total = sum(weights)
    exact = [M * w / total for w in weights]
    counts = [max(1, int(x)) for x in exact]
    while sum(counts) > M:  # the floors of 1 overshot: take from the largest
        counts[counts.index(max(counts))] -= 1
    order = sorted(range(len(devices)), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in order[:M - sum(counts)]:
        counts[i] += 1
    return devices, tuple(counts)


def _placed(problem: Problem, ranges: list[tuple[int, int]], devices: list[tuple[str, ...]],
            old: list[WarmStage]) -> tuple[Placement, float] | None:
    M = problem.num_microbatches
    stages = []
    for k, ((first, last), devs, st) in enumerate(zip(ranges, devices, old)):
        devs, counts = _shares(st, devs, M)
        stages.append(StagePlacement(index=k, first_block=first, last_block=last, devices=devs, microbatches=counts))
    verifiers = assign_verifiers(problem, tuple(stages), M)
    if verifiers is None:
        return None
    placement = Placement(stages=tuple(stages), verifiers=verifiers, num_microbatches=M)
    ev = evaluate(problem, placement)
    return None if violations(problem, placement, ev) else (placement, ev.step_ms)
