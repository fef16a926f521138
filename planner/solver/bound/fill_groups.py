"""The fill bound's groups of stage classes (``_kinds``, ``_Group``) and what every test of one bound reads alike
(``_Shared``, ``_optim_ms``); ``bound.fill``'s docstring states the bound.

Devices are counted in at most two *groups* of kinds: a group's time per block is its members' least, its memory
their largest, its devices and trusted devices their sums, so every plan is a plan of the grouped pool and a bound
on that bounds it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.solver.bound.replicas import Rings, hops_ms, slow_route
from planner.solver.problem import Problem


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


def _optim_ms(problem: Problem, classes: tuple[int, ...]) -> np.ndarray:
    """Per stage ``j..i-1`` (``[j, i]``), the least optimizer step of its blocks on any of ``classes`` (0: none)."""
    L = problem.num_blocks
    out = np.zeros((L + 1, L + 1))
    for j in range(L):
        for i in range(j + 1, L + 1):
            out[j, i] = min((problem.range_optim_ms(j, i - 1, c) for c in classes), default=0.0)
    return out
