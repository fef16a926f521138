"""The instruction set of a plan's per-rank programs, and its short string form.

Every rank runs one program: a tuple of :class:`Instruction`. The runtime
(``planner.runtime.rank.executor``) and the simulator (``planner.simulate``) both
interpret these programs, so what is predicted is what runs.

Semantics (shared by the runtime, the simulator and the validator):

* ``SEND_*`` is non-blocking (``isend``: the tensor is buffered and the
  program moves on); every receive (``RECV_*``, ``VERIFY_*`` with a peer,
  ``VERDICT_*``) blocks until the matching send has arrived. ``ALLREDUCE`` is
  a collective over the replicas of one stage.
* ``stage`` is always the stage on whose behalf the instruction acts:
  the stage that computes (``F``, ``B``), that sends its output activation or
  its input gradient (``SEND_F``, ``SEND_B``), that receives them
  (``RECV_F``, ``RECV_B``), or that *consumes* the checked tensor
  (``VERIFY_*``, ``VERDICT_*``). So a ``kSEND_F`` matches a ``(k+1)RECV_F``
  (or a ``(k+1)VERIFY_F``) and a ``kSEND_B`` matches a ``(k-1)RECV_B``
  (or a ``(k-1)VERIFY_B``), as in ``torch.distributed.pipelining``.
* ``boundary`` b is the edge between stage b and b+1. For ``*_F`` ops it is
  ``stage - 1`` and for ``*_B`` ops it is ``stage``; it is derived, never
  written in the string form.

Grammar of the string form (one instruction, no spaces)::

    instr  := STAGE OP [MB] ["<" SRC] [">" DST]
    STAGE, MB, SRC, DST := decimal integers

    kF m            forward of microbatch m on stage k             "1F3"
    kB m            backward of microbatch m on stage k            "1B3"
    kSEND_F m>r     send stage k's output activation of m to rank r  "1SEND_F3>2"
    kRECV_F m<r     receive stage k's input activation of m from r   "2RECV_F3<1"
    kSEND_B m>r     send the gradient of stage k's input to rank r     "2SEND_B3>1"
    kRECV_B m<r     receive the gradient of stage k's output from r    "1RECV_B3<2"
    kVERIFY_F m[<r][>c]  verify the activation entering stage k (boundary k-1):
                    read the copy sent by rank r (no ``<r``: the tensor this rank
                    received itself), score it, send the verdict to consumer
                    rank c (no ``>c``: the verdict is used on this rank)
                                                                   "2VERIFY_F3<1>4"
    kVERIFY_B m[<r][>c]  the same for the gradient entering stage k (boundary k)
    kVERDICT_F m<v  consumer of stage k: receive verifier v's verdict on the
                    activation of m before using it               "2VERDICT_F3<5"
    kVERDICT_B m<v  the same for the gradient
    kALLREDUCE      all-reduce stage k's gradients across its replicas "1ALLREDUCE"
    kOPTIM          optimiser step of stage k                       "1OPTIM"
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

from planner.errors import InvalidInputError

COMPUTE_OPS = ("F", "B")
SEND_OPS = ("SEND_F", "SEND_B")
RECV_OPS = ("RECV_F", "RECV_B")
VERIFY_OPS = ("VERIFY_F", "VERIFY_B")
VERDICT_OPS = ("VERDICT_F", "VERDICT_B")
STEP_OPS = ("ALLREDUCE", "OPTIM")
OPS: tuple[str, ...] = COMPUTE_OPS + SEND_OPS + RECV_OPS + VERIFY_OPS + VERDICT_OPS + STEP_OPS

# Longest names first so that the alternation never stops at a prefix.
_OP_ALTERNATION = "|".join(sorted(OPS, key=len, reverse=True))
_PATTERN = re.compile(rf"^(\d+)({_OP_ALTERNATION})(\d+)?(?:<(\d+))?(?:>(\d+))?$")


def direction(op: str) -> str:
    """``"F"`` for ops on activations, ``"B"`` for ops on gradients ("" for ALLREDUCE/OPTIM)."""
    if op in STEP_OPS:
        return ""
    return op[-1]


@dataclass(frozen=True, slots=True, kw_only=True)
class Instruction:
    """One step of a rank's program (see the module docstring for the meaning of each op).

    ``peer`` is the other rank of a point-to-point op: the destination of a
    ``SEND_*``, the source of a ``RECV_*``, the sender of the copy a
    ``VERIFY_*`` scores (None: the tensor is on this rank), the verifier
    a ``VERDICT_*`` comes from. ``dest`` is only for ``VERIFY_*``: the
    consumer rank the verdict goes to (None: the verdict stays on this rank).
    """

    op: str
    stage: int
    mb: int | None = None
    peer: int | None = None
    boundary: int | None = None
    dest: int | None = None

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise InvalidInputError(f"instruction op {self.op!r}", expected=f"one of {', '.join(OPS)}",
                                    found=repr(self.op))
        for name in ("stage", "mb", "peer", "dest", "boundary"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise InvalidInputError(f"instruction {self.op} field {name}",
                                        expected="a non-negative int", found=repr(value))
        self._check_fields()
        derived = self._derived_boundary()
        if self.boundary is None:
            object.__setattr__(self, "boundary", derived)
        elif self.boundary != derived:
            raise InvalidInputError(f"instruction {self.op} of stage {self.stage}: boundary",
                                    expected=str(derived), found=str(self.boundary))

    def _check_fields(self) -> None:
        needs_mb = self.op not in STEP_OPS
        needs_peer = self.op in SEND_OPS + RECV_OPS + VERDICT_OPS
        allows_peer = needs_peer or self.op in VERIFY_OPS
        problems = []
        if needs_mb and self.mb is None:
            problems.append("a microbatch")
        if not needs_mb and self.mb is not None:
            problems.append("no microbatch")
        if needs_peer and self.peer is None:
            problems.append("a peer rank")
        if not allows_peer and self.peer is not None:
            problems.append("no peer rank")
        if self.op not in VERIFY_OPS and self.dest is not None:
            problems.append("no verdict destination")
        if self.op == "VERIFY_F" and self.stage == 0:
            problems.append("a stage >= 1 (stage 0 receives no activation)")
        if self.op in ("RECV_F", "VERDICT_F") and self.stage == 0:
            problems.append("a stage >= 1 (stage 0 receives no activation)")
        if problems:
            raise InvalidInputError(f"instruction {self.op} (stage {self.stage}, mb {self.mb})",
                                    expected=" and ".join(problems),
                                    found=f"mb={self.mb} peer={self.peer} dest={self.dest}")

    def _derived_boundary(self) -> int | None:
        if self.op in VERIFY_OPS + VERDICT_OPS:
            return self.stage - 1 if self.op.endswith("_F") else self.stage
        return None

    @property
    def direction(self) -> str:
        return direction(self.op)

    def __str__(self) -> str:
        return format_instruction(self)


def format_instruction(ins: Instruction) -> str:
    """The short string form, e.g. ``1F3``, ``1SEND_F3>2``, ``2VERIFY_F3<1>4``."""
    text = f"{ins.stage}{ins.op}"
    if ins.mb is not None:
        text += str(ins.mb)
    if ins.op in SEND_OPS:
        return f"{text}>{ins.peer}"
    if ins.peer is not None:
        text += f"<{ins.peer}"
    if ins.dest is not None:
        text += f">{ins.dest}"
    return text


def _int_or_none(digits: str | None) -> int | None:
    return None if digits is None else int(digits)


def parse_instruction(text: str) -> Instruction:
    """Inverse of :func:`format_instruction`; raises InvalidInputError on anything else."""
    match = _PATTERN.match(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise InvalidInputError(
            f"instruction {text!r}",
            expected="STAGE OP [MB] [<SRC] [>DST], e.g. '1F3', '1SEND_F3>2', '2RECV_F3<1', '1OPTIM'",
            found=repr(text))
    stage, op, mb, src, dst = match.groups()
    if op in SEND_OPS:
        if src is not None:
            raise InvalidInputError(f"instruction {text!r}", expected=f"{op} with '>DEST' only",
                                    found="a '<' source")
        return Instruction(op=op, stage=int(stage), mb=_int_or_none(mb), peer=_int_or_none(dst))
    if op not in VERIFY_OPS and dst is not None:
        raise InvalidInputError(f"instruction {text!r}", expected=f"{op} without '>'", found="a '>' part")
    return Instruction(op=op, stage=int(stage), mb=_int_or_none(mb), peer=_int_or_none(src), dest=_int_or_none(dst))


def message_keys(ins: Instruction, rank: int) -> tuple[tuple[str, tuple], ...]:
    """The messages ``ins`` (run on ``rank``) sends and receives, as ("send"|"recv", key) pairs.

    A key is ``(kind, boundary, mb, src rank, dst rank)`` with kind ``F``/``B``
    for a tensor and ``VF``/``VB`` for a verdict; a send and the receive that
    matches it have equal keys. Compute, ALLREDUCE and OPTIM have none.
    """
    d = ins.direction
    if ins.op in SEND_OPS:
        boundary = ins.stage if d == "F" else ins.stage - 1
        return (("send", (d, boundary, ins.mb, rank, ins.peer)),)
    if ins.op in RECV_OPS:
        boundary = ins.stage - 1 if d == "F" else ins.stage
        return (("recv", (d, boundary, ins.mb, ins.peer, rank)),)
    if ins.op in VERDICT_OPS:
        return (("recv", ("V" + d, ins.boundary, ins.mb, ins.peer, rank)),)
    if ins.op in VERIFY_OPS:
        keys: tuple[tuple[str, tuple], ...] = ()
        if ins.peer is not None:
            keys += (("recv", (d, ins.boundary, ins.mb, ins.peer, rank)),)
        if ins.dest is not None:
            keys += (("send", ("V" + d, ins.boundary, ins.mb, rank, ins.dest)),)
        return keys
    return ()


def format_program(program: Iterable[Instruction]) -> tuple[str, ...]:
    return tuple(format_instruction(i) for i in program)


def parse_program(texts: Iterable[str]) -> tuple[Instruction, ...]:
    return tuple(parse_instruction(t) for t in texts)
