"""What a solve (or a baseline) returns: the placement, before it is compiled into a plan."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from planner.errors import InvalidInputError

Direction = Literal["act", "grad"]


@dataclass(frozen=True, slots=True, kw_only=True)
class StagePlacement:
    """Stage ``index`` holds blocks ``first_block..last_block`` (inclusive) on ``devices``.

    With several devices the stage is replicated: replica ``i`` runs
    ``microbatches[i]`` of the step's microbatches and the replicas all-reduce
    their gradients. ``in_flight[i]``: the most microbatches replica ``i`` may hold
    in flight (empty: the schedule's least, ``planner.schedules.max_in_flight``). ``recompute``: whether its
    blocks' forwards run again in the backward (None: as the problem it was planned in, ``Problem.recompute``).
    ``out_codec``: how its activations and the gradients sent back for them travel (``cost_models.codecs``);
    ``allreduce_codec``: how its replicas all-reduce their gradients (``none``, ``int8`` or ``powersgd``).
    ``audit_every``: its replicas' audits recompute one in this many of their microbatches (0: not audited;
    ``planner.solver.audits``).
    """

    index: int
    first_block: int
    last_block: int
    devices: tuple[str, ...]
    microbatches: tuple[int, ...]
    in_flight: tuple[int, ...] = ()
    recompute: bool | None = None
    out_codec: str | None = None  # its boundary's codec (None: the problem's, ``Problem.codec``)
    allreduce_codec: str | None = None  # its replicas' gradient all-reduce codec (None: none)
    audit_every: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.first_block <= self.last_block:
            raise InvalidInputError(f"stage {self.index} block range", expected="0 <= first <= last",
                                    found=f"{self.first_block}..{self.last_block}")
        if not self.devices or len(self.devices) != len(self.microbatches):
            raise InvalidInputError(f"stage {self.index} replicas",
                                    expected="one microbatch count per device",
                                    found=f"{len(self.devices)} devices, {len(self.microbatches)} counts")
        if any(m < 1 for m in self.microbatches):
            raise InvalidInputError(f"stage {self.index} microbatches", expected=">= 1 per replica",
                                    found=repr(self.microbatches))
        if self.in_flight and (len(self.in_flight) != len(self.devices)
                               or not all(1 <= n <= m for n, m in zip(self.in_flight, self.microbatches))):
            raise InvalidInputError(f"stage {self.index} in-flight limits", expected="one per replica, "
                                    "1..its microbatch count", found=repr(self.in_flight))
        if isinstance(self.audit_every, bool) or not isinstance(self.audit_every, int) or self.audit_every < 0:
            raise InvalidInputError(f"stage {self.index} audit_every", expected="a whole number >= 0 (0: no audits)",
                                    found=repr(self.audit_every))

    @property
    def num_blocks(self) -> int:
        return self.last_block - self.first_block + 1


@dataclass(frozen=True, slots=True, kw_only=True)
class VerifierPlacement:
    """The verifier of the boundary between stage ``boundary`` and ``boundary + 1``.

    ``watch_only``: those of ``directions`` whose sender is trusted, copied here only as the input of the
    next untrusted stage's link and residual tests (seen, never flagged). ``senders``: the sending devices
    whose tensors it checks (empty: all); several verifiers of one boundary split its replicas so.
    """

    boundary: int
    device: str
    directions: tuple[Direction, ...] = ("act", "grad")
    watch_only: tuple[Direction, ...] = ()
    senders: tuple[str, ...] = ()

    def covers(self, sender: str) -> bool:
        """Whether this verifier checks what device ``sender`` sends across its boundary."""
        return not self.senders or sender in self.senders


def shared_boundary_problem(verifiers: Sequence[Any]) -> str:
    """What is wrong with how ``verifiers`` (anything with boundary, device, senders) share boundaries: a
    boundary's several verifiers must each name their senders, none named twice ('' where all is well)."""
    by_boundary: dict[int, list[Any]] = {}
    for v in verifiers:
        by_boundary.setdefault(v.boundary, []).append(v)
    for b, group in sorted(by_boundary.items()):
        if len(group) < 2:
            continue
        if any(not v.senders for v in group):
            return f"boundary {b} has {len(group)} verifiers, one of them watching every sender"
        if len({v.device for v in group}) < len(group):
            return f"boundary {b} has two verifiers on one device"
        named = [d for v in group for d in v.senders]
        if len(named) != len(set(named)):
            return f"boundary {b}'s verifiers share a sender ({', '.join(sorted(named))})"
    return ""


@dataclass(frozen=True, slots=True, kw_only=True)
class SolveReport:
    """How the placement was found and how good it is provably.

    ``gap`` = (objective - bound) / objective; 0.0 means proven optimal under
    the cost model. Baselines report ``bound_ms`` = None and ``gap`` = None.
    """

    method: str
    status: str
    objective_ms: float
    bound_ms: float | None
    gap: float | None
    solve_s: float
    notes: tuple[str, ...] = ()


def gap_of(objective_ms: float, bound_ms: float | None) -> float | None:
    """``SolveReport.gap`` of a plan of cost ``objective_ms`` against ``bound_ms`` (None: no bound)."""
    if bound_ms is None:
        return None
    return max(0.0, (objective_ms - bound_ms) / objective_ms) if objective_ms > 0 else 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Solution:
    stages: tuple[StagePlacement, ...]
    verifiers: tuple[VerifierPlacement, ...]
    num_microbatches: int
    schedule: str
    predicted_step_ms: float
    memory_bytes: tuple[tuple[str, int], ...]
    report: SolveReport

    def __post_init__(self) -> None:
        if not self.stages:
            raise InvalidInputError("solution", expected="at least one stage", found="none")
        for k, st in enumerate(self.stages):
            if st.index != k:
                raise InvalidInputError("stage order", expected=f"index {k}", found=str(st.index))
            if sum(st.microbatches) != self.num_microbatches:
                raise InvalidInputError(f"stage {k} microbatches", expected=f"sum {self.num_microbatches}",
                                        found=str(sum(st.microbatches)))
        for a, b in zip(self.stages, self.stages[1:]):
            if b.first_block != a.last_block + 1:
                raise InvalidInputError("stage ranges", expected="contiguous block ranges",
                                        found=f"stage {a.index} ends at {a.last_block}, "
                                              f"stage {b.index} starts at {b.first_block}")
