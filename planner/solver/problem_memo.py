"""Results of a pure function of (problem, key), remembered: the searches ask the same questions again.

Keyed by the problem's identity (problems are large and hashed by nobody), which each entry keeps alive so the id
is not reused while the entry stands; the oldest entry goes first past ``kept``. Not shared between threads.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

V = TypeVar("V")


class ProblemMemo(Generic[V]):
    def __init__(self, kept: int) -> None:
        self.kept = kept
        self._entries: dict[tuple[int, Hashable], tuple[Any, V]] = {}

    def get(self, problem: Any, key: Hashable, compute: Callable[[], V]) -> V:
        """The remembered value for (``problem``, ``key``), else ``compute()``'s, remembered."""
        slot = (id(problem), key)
        hit = self._entries.get(slot)
        if hit is not None and hit[0] is problem:
            return hit[1]
        value = compute()
        if len(self._entries) >= self.kept:
            del self._entries[next(iter(self._entries))]
        self._entries[slot] = (problem, value)
        return value

    def __len__(self) -> int:
        return len(self._entries)
