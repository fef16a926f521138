"""What a monitor remembers of the tensors it accepted, for the replay test: the recent sketches
(near copies, by cosine) and the fingerprints of many more (exact copies), each with the key of
the data it was computed from."""
from __future__ import annotations

from collections import deque

import torch

from planner.integrity import predictors as pred

__all__ = ["CopyMemory", "SketchRing"]


class SketchRing:
    """The last ``capacity`` sketches in one preallocated ``[capacity, length]`` tensor,
    with their norms (a replay test reads every row each check)."""

    def __init__(self, capacity: int, length: int) -> None:
        self._data = torch.zeros(capacity, length)
        self._norms = torch.zeros(capacity)
        self._keys: list[int | None] = [None] * capacity   # each row's data key (see ``CopyMemory``)
        self._count = 0

    def __len__(self) -> int:
        return min(self._count, self._data.shape[0])

    def push(self, sketch: torch.Tensor, data_key: int | None = None) -> None:
        slot = self._count % self._data.shape[0]
        self._data[slot] = sketch
        self._norms[slot] = sketch.norm()
        self._keys[slot] = data_key
        self._count += 1

    def others(self, data_key: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows and norms of other data than ``data_key``'s (all of them when it is None)."""
        rows, norms = self.rows(), self.norms()
        if data_key is None:
            return rows, norms
        keep = torch.tensor([k != data_key for k in self._keys[: len(self)]], dtype=torch.bool)
        return (rows, norms) if bool(keep.all()) else (rows[keep], norms[keep])

    def rows(self) -> torch.Tensor:
        return self._data[: len(self)]

    def norms(self) -> torch.Tensor:
        return self._norms[: len(self)]


class CopyMemory:
    """Fingerprints of the last ``capacity`` sketches (``predictors.sketch_fingerprint``): exact
    replays from further back than the sketch ring reaches, at about 16 bytes a sample.

    Each keeps the key of the data it was computed from (``predictors.ids_fingerprint`` of the
    microbatch's labels; None: unknown): a copy of an earlier tensor *of the same data* is what a
    frozen stage sends when its data comes round again (fine-tuning with the bottom layers frozen,
    an epoch of 6 steps: the honest first stage was flagged on every microbatch from the second
    epoch and banned; emulation, 2026-12-03), not a replay."""

    def __init__(self, capacity: int) -> None:
        self._order: deque[int] = deque()
        self._seen: dict[int, int | None] = {}
        self._capacity = capacity

    def copied(self, sketch: torch.Tensor, data_key: int | None = None) -> bool:
        """Whether ``sketch`` is an exact copy of one computed from other data (or unknown data). All
        zeros is nobody's copy: a microbatch with no target to learn sends zero gradients honestly (the
        other tests judge a sender of zeros)."""
        if not bool(sketch.any()):
            return False
        key = pred.sketch_fingerprint(sketch)
        return key in self._seen and (data_key is None or self._seen[key] != data_key)

    def push(self, sketch: torch.Tensor, data_key: int | None = None) -> None:
        key = pred.sketch_fingerprint(sketch)
        if key in self._seen:
            return
        self._order.append(key)
        self._seen[key] = data_key
        if len(self._order) > self._capacity:
            self._seen.pop(self._order.popleft(), None)
