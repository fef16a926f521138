"""The parts of a plan: the model it is for, its stages, ranks and verifiers, and the predicted step.

Frozen values that check themselves on construction; :class:`planner.plan.Plan` holds them, and
``planner.plan_json`` writes and reads them.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cost_models.codecs import ALLREDUCE_CODECS, check_codec
from planner.errors import InvalidInputError
from planner.ir import Block, dtype_bytes
from planner.verifier_config import DIRECTIONS


def _check_non_negative(owner: str, obj: Any, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if value < 0:
            raise InvalidInputError(f"{owner}.{name}", expected=">= 0", found=repr(value))


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelRef:
    """Which model a plan is for: how to build it (``spec``) and the fingerprint of its trace.

    ``batch`` is the microbatch size the graph was traced at, ``dtype`` the
    dtype it was traced in (the block figures are at that size and dtype);
    ``seq`` the sequence length for language models (None otherwise).
    """

    spec: str
    name: str
    fingerprint: str
    batch: int
    seq: int | None = None
    dtype: str = "float32"

    def __post_init__(self) -> None:
        dtype_bytes(self.dtype)
        if not self.spec or not self.fingerprint:
            raise InvalidInputError("model reference", expected="a non-empty spec and fingerprint",
                                    found=f"spec={self.spec!r} fingerprint={self.fingerprint!r}")
        if self.batch < 1 or (self.seq is not None and self.seq < 1):
            raise InvalidInputError("model reference batch/seq", expected=">= 1",
                                    found=f"batch={self.batch} seq={self.seq}")


@dataclass(frozen=True, slots=True, kw_only=True)
class StageInfo:
    """Stage ``index``: a contiguous run of the chain's blocks (``planner.ir.Block``, per microbatch
    at the traced batch size).

    ``node_names``/``module_paths``/``param_names`` say what the runtime builds;
    ``boundary_nodes`` name the producers of the activation sent on.
    ``in_bytes`` is what the stage receives per microbatch (the model input
    for stage 0); ``out_bytes`` what it sends on (its last block's). Totals
    (``fwd_flops``, ``param_bytes``, ...) sum the blocks. ``recompute``: every block is checkpointed
    (its forward runs again in the backward; only block inputs stay saved). ``audit_every``: its replicas'
    auditor recomputes one in this many of their microbatches (``planner.runtime.rank.audits``; 0: none).
    """

    index: int
    blocks: tuple[Block, ...]
    in_bytes: int
    recompute: bool = False
    out_codec: str = "none"  # cost_models.codecs: how its activations (and their gradients back) travel
    allreduce_codec: str = "none"  # cost_models.codecs.ALLREDUCE_CODECS: how its replicas all-reduce gradients
    audit_every: int = 0

    def __post_init__(self) -> None:
        if not self.blocks:
            raise InvalidInputError(f"stage {self.index}", expected="at least one block", found="none")
        first = self.blocks[0].index
        if tuple(b.index for b in self.blocks) != tuple(range(first, first + len(self.blocks))):
            raise InvalidInputError(f"stage {self.index} blocks", expected="consecutive block indices",
                                    found=repr(tuple(b.index for b in self.blocks)))
        _check_non_negative(f"stage {self.index}", self, ("in_bytes", "audit_every"))
        check_codec(self.out_codec)
        check_codec(self.allreduce_codec, allowed=ALLREDUCE_CODECS)

    @property
    def first_block(self) -> int:
        return self.blocks[0].index

    @property
    def last_block(self) -> int:
        return self.blocks[-1].index

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def block_names(self) -> tuple[str, ...]:
        return tuple(b.name for b in self.blocks)

    def _concat(self, name: str) -> tuple[str, ...]:
        return tuple(x for b in self.blocks for x in getattr(b, name))

    def _sum(self, name: str) -> int:
        return sum(getattr(b, name) for b in self.blocks)

    node_names = property(lambda self: self._concat("node_names"))
    module_paths = property(lambda self: tuple(dict.fromkeys(self._concat("module_paths"))))
    param_names = property(lambda self: tuple(dict.fromkeys(self._concat("param_names"))))
    boundary_nodes = property(lambda self: self.blocks[-1].boundary_nodes)
    fwd_flops = property(lambda self: self._sum("fwd_flops"))
    bwd_flops = property(lambda self: self._sum("bwd_flops"))
    param_count = property(lambda self: self._sum("param_count"))
    param_bytes = property(lambda self: self._sum("param_bytes"))
    saved_act_bytes = property(lambda self: self._sum("saved_act_bytes"))
    mem_traffic_bytes = property(lambda self: self._sum("mem_traffic_bytes"))
    out_bytes = property(lambda self: self.blocks[-1].out_bytes)


@dataclass(frozen=True, slots=True, kw_only=True)
class RankInfo:
    """One process of the plan.

    A stage rank has ``stage``/``replica`` set and runs ``microbatches``
    (ascending ids), keeping at most ``max_in_flight`` microbatches' activations
    alive at once. ``verifies`` lists the boundaries this rank checks (a
    verifier-only rank has no stage).
    """

    rank: int
    host: str
    device: str
    device_type: str
    stage: int | None = None
    replica: int | None = None
    microbatches: tuple[int, ...] = ()
    max_in_flight: int = 0
    verifies: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if (self.stage is None) != (self.replica is None):
            raise InvalidInputError(f"rank {self.rank}", expected="stage and replica both set or both null",
                                    found=f"stage={self.stage} replica={self.replica}")
        if self.stage is None and (self.microbatches or not self.verifies):
            raise InvalidInputError(f"rank {self.rank}",
                                    expected="a stage, or (verifier-only) boundaries to verify and no microbatches",
                                    found=f"microbatches={self.microbatches} verifies={self.verifies}")
        if self.stage is not None and not (1 <= self.max_in_flight <= len(self.microbatches)):
            raise InvalidInputError(f"rank {self.rank} max_in_flight",
                                    expected=f"1..{len(self.microbatches)} (its microbatch count)",
                                    found=str(self.max_in_flight))
        if list(self.microbatches) != sorted(set(self.microbatches)):
            raise InvalidInputError(f"rank {self.rank} microbatches", expected="distinct ascending ids",
                                    found=repr(self.microbatches))

    @property
    def is_verifier(self) -> bool:
        return bool(self.verifies)

    @property
    def runs_stage(self) -> bool:
        return self.stage is not None


@dataclass(frozen=True, slots=True, kw_only=True)
class VerifierInfo:
    """The verifier of boundary ``boundary`` (stage b -> b+1) runs on ``rank``. ``watch_only``: the
    directions it sees only as a link test's input (a trusted sender's), never flagging them. ``senders``: the
    sending devices it checks (empty: all of them); a boundary's verifiers split its replicas so."""

    boundary: int
    rank: int
    device: str
    directions: tuple[str, ...] = DIRECTIONS
    watch_only: tuple[str, ...] = ()
    senders: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.directions or any(d not in DIRECTIONS for d in self.directions):
            raise InvalidInputError(f"verifier of boundary {self.boundary} directions",
                                    expected="a non-empty subset of act, grad", found=repr(self.directions))
        if not set(self.watch_only) <= set(self.directions):
            raise InvalidInputError(f"verifier of boundary {self.boundary} watch_only",
                                    expected=f"a subset of its directions {list(self.directions)}",
                                    found=repr(self.watch_only), fix="re-run `stagewise plan`")

    def covers(self, sender: str) -> bool:
        """Whether this verifier checks what device ``sender`` sends across its boundary."""
        return not self.senders or sender in self.senders

    def label(self) -> str:
        """``act+grad``, or ``grad; act for the link test`` where a trusted sender's copy is only watched."""
        checked = "+".join(d for d in self.directions if d not in self.watch_only)
        watched = "+".join(self.watch_only)
        label = f"{checked}; {watched} for the link test" if watched else checked
        return f"{label}; from {', '.join(self.senders)}" if self.senders else label


@dataclass(frozen=True, slots=True, kw_only=True)
class Predicted:
    """What the simulator predicts for one optimizer step of the compiled programs."""

    step_ms: float
    bubble_fraction: float
    peak_mem_bytes: tuple[int, ...]  # per rank

    def __post_init__(self) -> None:
        if self.step_ms < 0 or not 0.0 <= self.bubble_fraction <= 1.0:
            raise InvalidInputError("predicted metrics", expected="step_ms >= 0 and 0 <= bubble_fraction <= 1",
                                    found=f"{self.step_ms}, {self.bubble_fraction}")


def checker_ranks(ranks: Sequence[RankInfo], verifiers: Sequence[VerifierInfo]) -> dict[tuple[int, str, int], int]:
    """(boundary, "F"|"B", microbatch) -> the rank that verifies that tensor: the boundary's verifier whose
    senders hold the microbatch's sending replica (a boundary's verifiers may split its replicas)."""
    owner = {(r.stage, m): r for r in ranks if r.stage is not None for m in r.microbatches}
    out: dict[tuple[int, str, int], int] = {}
    for v in verifiers:
        for d in v.directions:
            op, sending = ("F", v.boundary) if d == "act" else ("B", v.boundary + 1)
            for (stage, m), r in owner.items():
                if stage == sending and v.covers(r.device):
                    out[(v.boundary, op, m)] = v.rank
    return out
