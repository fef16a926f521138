"""The simulated timeline's value types (``planner.simulate``): its boxes and what one step looks like."""
from __future__ import annotations

from dataclasses import dataclass

from planner.plan_values import Predicted


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """One box of the timeline: ``kind`` is F, B, send (a transfer), message (a rank's CPU time on one,
    with ``simulate(messages=...)``), verify, allreduce or optim."""

    rank: int
    kind: str
    start_ms: float
    end_ms: float
    label: str
    stage: int | None = None
    mb: int | None = None
    peer: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SimResult:
    """What one simulated optimizer step looks like (per-rank tuples are indexed by rank)."""

    step_ms: float
    pipeline_ms: float
    busy_ms: tuple[float, ...]
    compute_ms: tuple[float, ...]
    idle_ms: tuple[float, ...]
    bubble_fraction: float
    peak_mem_bytes: tuple[int, ...]
    peak_in_flight: tuple[int, ...]
    events: tuple[Event, ...]

    def predicted(self) -> Predicted:
        return Predicted(step_ms=self.step_ms, bubble_fraction=self.bubble_fraction,
                         peak_mem_bytes=self.peak_mem_bytes)
