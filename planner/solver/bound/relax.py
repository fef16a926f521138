"""A coarser problem for bounds: stage classes of one device type, trust and role merged.

Classes split identical devices by host, because their links differ (NVLink
inside a host, the network between hosts). For a *bound* they may be merged:
the merged class holds all their devices, its time per block and verify cost
are its members' least, its memory their largest, and each of its links the
best of its members' (highest bandwidth, lowest latency). Every plan of the
real problem is then a plan of the merged one that costs no more, so a lower
bound on the merged problem bounds the real one. The sequence DP's cost is
cubic in the classes: on clusters of many hosts this is what makes it
affordable (1000 blocks x 176 devices: 8 stage classes -> 4). Plans of the
merged problem are not plans of the real one: use it for bounds only.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from cost_models.cluster import Link
from planner.solver.problem import DeviceClass, Problem


def merged_for_bound(problem: Problem) -> Problem | None:
    """The problem with like classes merged (see the module docstring), or None when none merge."""
    groups: dict[tuple, list[DeviceClass]] = {}
    for c in problem.classes:
        groups.setdefault((c.spec.name, c.trusted, c.domain, c.stage_capable, c.verifier_host), []).append(c)
    if len(groups) == len(problem.classes):
        return None
    members = list(groups.values())
    classes = tuple(_merged(i, m) for i, m in enumerate(members))
    links = tuple(tuple(_best([problem.links[a.index][b.index] for a in A for b in B]) for B in members)
                  for A in members)
    time_ms = np.stack([problem.time_ms[:, [c.index for c in m]].min(axis=1) for m in members], axis=1)
    bwd = None if problem.bwd_ms is None else \
        np.stack([problem.bwd_ms[:, [c.index for c in m]].min(axis=1) for m in members], axis=1)
    return dataclasses.replace(problem, classes=classes, links=links, time_ms=time_ms, bwd_ms=bwd)


def _merged(index: int, members: Sequence[DeviceClass]) -> DeviceClass:
    first = members[0]
    return DeviceClass(index=index, name="+".join(c.name for c in members),
                       device_ids=tuple(d for c in members for d in c.device_ids), spec=first.spec,
                       trusted=first.trusted, domain=first.domain, stage_capable=first.stage_capable,
                       verifier_host=first.verifier_host, mem_bytes=max(c.mem_bytes for c in members),
                       verify_ms_per_byte=min(c.verify_ms_per_byte for c in members),
                       verify_fixed_ms=min(c.verify_fixed_ms for c in members))


def _best(links: Sequence[Link | None]) -> Link | None:
    """A link at least as fast as each of ``links`` (None: no pair of devices is joined)."""
    known = [lk for lk in links if lk is not None]
    if not known:
        return None
    return Link(bandwidth_gbps=max(lk.bandwidth_gbps for lk in known), latency_ms=min(lk.latency_ms for lk in known))
