"""Which replica of a stage runs which microbatch: smooth weighted round-robin over the replicas' shares.

A stage whose replica ``i`` runs ``shares[i]`` of the step's ``M`` microbatches
gets them interleaved in proportion to the shares (SWARM's load-balanced
wiring, made deterministic): each microbatch goes to the replica with the
largest accumulated credit, ties to the lower index. Every replica then
receives work at its own pace from the first microbatch on, instead of one
replica idling while another works through a contiguous range. The solver's
objective and the compiler both use this one routing.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from planner.errors import InvalidInputError


@lru_cache(maxsize=4096)  # pricing a plan asks for the same few share vectors many times
def route(shares: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Microbatch ids (ascending) of each replica; replica ``i`` gets exactly ``shares[i]`` of them."""
    if not shares or any(s < 1 for s in shares):
        raise InvalidInputError("replica shares", expected="one count >= 1 per replica", found=repr(shares))
    total = sum(shares)
    weight = np.array(shares, dtype=np.int64)
    credit = np.zeros(len(shares), dtype=np.int64)
    out: list[list[int]] = [[] for _ in shares]
    for m in range(total):
        credit += weight
        pick = int(np.argmax(credit))  # the first of the largest: ties to the lower index
        credit[pick] -= total
        out[pick].append(m)
    return tuple(tuple(ids) for ids in out)


@lru_cache(maxsize=4096)
def pair_counts(src: tuple[int, ...], dst: tuple[int, ...]) -> dict[tuple[int, int], int]:
    """How many microbatches go from replica ``i`` of one stage (shares ``src``) to replica ``j`` of the next
    (cached: callers must not change the dict)."""
    owner = {m: j for j, ids in enumerate(route(dst)) for m in ids}
    counts: dict[tuple[int, int], int] = {}
    for i, ids in enumerate(route(src)):
        for m in ids:
            key = (i, owner[m])
            counts[key] = counts.get(key, 0) + 1
    return counts


@lru_cache(maxsize=4096)
def owners(shares: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """Per microbatch id: (the replica that runs it, its position among that replica's microbatches)."""
    out = [(0, 0)] * sum(shares)
    for i, ids in enumerate(route(shares)):
        for pos, m in enumerate(ids):
            out[m] = (i, pos)
    return tuple(out)
