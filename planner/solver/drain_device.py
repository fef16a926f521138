"""The state ``drain_schedule``'s list scheduler keeps of one device, and which device checks what each sends."""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Device", "Key", "checkers"]

Key = tuple[int, str, int]  # (boundary, F|B, microbatch): a checked tensor


@dataclass(slots=True)
class Device:
    """One device's state: a stage replica's (``stage`` >= 0) and/or a verifier's queue of copies."""

    order: int
    name: str = ""
    stage: int = -1
    ids: tuple[int, ...] = ()
    limit: int = 0
    fwd_ms: float = 0.0
    bwd_ms: float = 0.0
    next_fwd: int = 0
    next_bwd: int = 0   # GPipe: its backwards run in its forwards' order, this one next
    held: int = 0
    inputs: dict[int, float] = field(default_factory=dict)     # microbatch -> its input's arrival
    waiting: list[tuple[float, int]] = field(default_factory=list)  # 1F1B: gradients (arrival, mb), not yet due
    due: list[int] = field(default_factory=list)               # 1F1B: microbatches whose gradient is in by the clock
    grads: dict[int, float] = field(default_factory=dict)      # GPipe: microbatch -> its gradient's arrival
    copies: list[tuple[float, int, int, Key, str]] = field(default_factory=list)  # (arrival, mb, B first, ...)
    checkable: list[tuple[int, int, float, Key, str]] = field(default_factory=list)  # copies in by the clock
    clock: float = 0.0
    b_gate: float = 0.0
    last_op: str = ""
    version: int = 0
    offered: float = float("inf")  # when the step it has on the heap would start (inf: none)
    program: list[tuple] = field(default_factory=list)  # what it was placed to run, in order


def checkers(stages, verifiers) -> dict[tuple[int, str, str], str]:
    """(boundary, F|B, sending device) -> the device that checks what it sends there."""
    out: dict[tuple[int, str, str], str] = {}
    for v in verifiers:
        k = v.boundary
        for direction in v.directions:
            op = "F" if direction == "act" else "B"
            for s in stages[k if op == "F" else k + 1].devices:
                if v.covers(s):
                    out[(k, op, s)] = v.device
    return out
