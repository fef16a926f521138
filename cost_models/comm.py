"""Communication time: point-to-point transfers and ring all-reduce. Pure functions.

Link bandwidths are in gigabits per second (``Link.bytes_per_s`` converts).
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from cost_models.cluster import ClusterSpec, Link
from planner.errors import InvalidInputError


def transfer_ms(nbytes: int | float, link: Link) -> float:
    """One message of ``nbytes``: latency plus bytes over bandwidth (0 for an empty message)."""
    if nbytes < 0:
        raise InvalidInputError("transfer size", expected="nbytes >= 0", found=str(nbytes))
    if nbytes == 0:
        return 0.0
    return link.latency_ms + 1e3 * nbytes / link.bytes_per_s


def transfer_ms_array(nbytes: np.ndarray, link: Link) -> np.ndarray:
    """:func:`transfer_ms` of each entry of ``nbytes`` (one table for many messages over one link)."""
    nbytes = np.asarray(nbytes, dtype=float)
    if (nbytes < 0).any():
        raise InvalidInputError("transfer size", expected="nbytes >= 0", found=str(nbytes.min()))
    return np.where(nbytes > 0, link.latency_ms + 1e3 * nbytes / link.bytes_per_s, 0.0)


def allreduce_ms(nbytes: int | float, links: Iterable[Link], replicas: int) -> float:
    """Ring all-reduce of ``nbytes`` over ``replicas`` devices joined by ``links``.

    ``2 (r-1)/r * nbytes / slowest bandwidth + 2 (r-1) * latency``: a
    reduce-scatter then an all-gather, each of ``r - 1`` steps that move
    ``nbytes / r`` over every ring link at once, so the slowest link (and the
    largest latency) paces every step.
    """
    if replicas < 1:
        raise InvalidInputError("all-reduce replicas", expected=">= 1", found=str(replicas))
    if nbytes < 0:
        raise InvalidInputError("all-reduce size", expected="nbytes >= 0", found=str(nbytes))
    if replicas == 1 or nbytes == 0:
        return 0.0
    ring = tuple(links)
    if not ring:
        raise InvalidInputError("all-reduce links", expected=f"the links of the {replicas}-device ring",
                                found="none")
    slowest_bps = min(lk.bytes_per_s for lk in ring)
    latency_ms = max(lk.latency_ms for lk in ring)
    steps = replicas - 1
    return 2.0 * steps / replicas * nbytes / slowest_bps * 1e3 + 2.0 * steps * latency_ms


def ring_links(cluster: ClusterSpec, device_ids: Sequence[str]) -> tuple[Link, ...]:
    """The links of a ring over ``device_ids`` in the given order (last back to first)."""
    ids = tuple(device_ids)
    if len(ids) < 2:
        return ()
    return tuple(cluster.link(a, b) for a, b in zip(ids, ids[1:] + ids[:1]))


def group_allreduce_ms(cluster: ClusterSpec, device_ids: Sequence[str], nbytes: int | float) -> float:
    """All-reduce of ``nbytes`` across a replica group of the cluster, ring in the given order."""
    return allreduce_ms(nbytes, ring_links(cluster, device_ids), len(tuple(device_ids)))
