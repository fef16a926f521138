"""A point in time that a planning step must finish by: the time limit as a budget shared by its steps.

Steps that enumerate (grids, a DP's caps, the baselines) check it between candidates and return the best
found so far once it has passed; the clock is injectable, so tests drive it without waiting. The solver's
search passes a ``budget.Work`` in its place (the same ``passed``/``charge``): a budget in work, repeatable.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True, slots=True)
class Deadline:
    """``at_s`` on ``clock``'s scale (``time.perf_counter`` by default); ``math.inf``: never."""

    at_s: float
    clock: Callable[[], float] = field(default=time.perf_counter, compare=False)

    @staticmethod
    def after(budget_s: float, clock: Callable[[], float] = time.perf_counter) -> Deadline:
        return Deadline(clock() + budget_s, clock)

    @staticmethod
    def never() -> Deadline:
        return Deadline(math.inf)

    def left_s(self) -> float:
        """Seconds until the deadline (negative once past it)."""
        return self.at_s - self.clock()

    def passed(self) -> bool:
        return self.clock() >= self.at_s

    def charge(self, units: float) -> None:
        """Work is not counted against a deadline (``budget.Work`` counts it): the same calls serve both."""

    def less(self, seconds: float) -> Deadline:
        """``seconds`` before this deadline: time kept back for what follows."""
        return Deadline(self.at_s - seconds, self.clock)
