"""Branching on the device class of one block, where the Lagrangian bound stalls (``lagrange``).

The sequence DP's Lagrangian bound at a pair of caps is the LP over mixtures
of stage sequences that meet the device counts on average, and no finer box
of caps changes that: it can stall well below the best plan on a mixture
whose every sequence over-uses some class. Splitting the sequences by
the class that holds the block on which the mixture disagrees most (a child
per class) partitions the plans at those caps: each child's dual value still
bounds its part, so the least over a tree's leaves bounds every plan there,
and it rises as the tree grows (tuning history: benchmarks/README.md).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from planner.solver.bound.sequence_dp import Cut


class Leaf(Protocol):
    best: float
    allowed: np.ndarray | None


def satisfies(cut: Cut, allowed: np.ndarray | None, classes: Sequence[int]) -> bool:
    """Whether the cut's sequence puts every block on a class ``allowed`` there (None: no restriction; a cut
    without its sequence is not known to)."""
    if allowed is None:
        return True
    return bool(cut.stages) and all(allowed[classes.index(c), s:e + 1].all() for s, e, c, _ in cut.stages)


def most_split_block(weighted: Sequence[tuple[float, Cut]], num_blocks: int,
                     classes: Sequence[int]) -> int | None:
    """The block whose class the weighted mixture of sequences agrees on least (None: it agrees on all)."""
    share = np.zeros((len(classes), num_blocks))
    for w, cut in weighted:
        for s, e, c, _ in cut.stages:
            share[classes.index(c), s:e + 1] += w
    top, total = share.max(axis=0), share.sum(axis=0)
    block = int(np.argmin(top / np.maximum(total, 1e-300)))
    return None if top[block] >= (1 - 1e-6) * total[block] else block


def child_masks(allowed: np.ndarray | None, block: int, num_classes: int, num_blocks: int) -> list[np.ndarray]:
    """One restriction per class still allowed at ``block``: the block on that class alone."""
    base = np.ones((num_classes, num_blocks), dtype=bool) if allowed is None else allowed
    out = []
    for c in range(num_classes):
        if base[c, block]:
            mask = base.copy()
            mask[:, block] = False
            mask[c, block] = True
            out.append(mask)
    return out


class ClassTree:
    """The leaves of one pair of caps' branching: their least dual value bounds every plan at the caps."""

    def __init__(self, root: Leaf) -> None:
        self.leaves: list[Leaf] = [root]

    def weakest(self) -> Leaf:
        return min(self.leaves, key=lambda leaf: leaf.best)

    def replace(self, leaf: Leaf, children: Sequence[Leaf]) -> None:
        self.leaves = [other for other in self.leaves if other is not leaf] + list(children)

    def value(self, cutoff: float) -> float:
        """The least leaf value; leaves at or above ``cutoff`` (nothing there beats the incumbent) are
        dropped, and with none left the tree is worth the cutoff."""
        self.leaves = [leaf for leaf in self.leaves if leaf.best < cutoff]
        return min((leaf.best for leaf in self.leaves), default=cutoff)
