"""Whether both ends of every point-to-point stream post it in one order: what NCCL's pairing needs.

NCCL ignores tags: it pairs the n-th send of a rank to a peer with that peer's
n-th receive from the rank in the same communicator. A run with
``STAGEWISE_P2P_LOG=DIR`` logs every posted op (``comm.post``: one JSON line each
in ``DIR/rank<r>.jsonl``); :func:`mismatches` lines up, per (sender, receiver,
channel), the sender's sends with the receiver's receives and names the first
position where the tags differ. ``by_channel=False`` checks per pair alone, as
one communicator for every channel would pair them. The log is parsed as JSON
and checked, never executed.

    python -m planner.runtime.wire.p2p_order DIR [--per-pair]
"""
from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from planner.errors import InvalidInputError
from planner.runtime.wire.comm import split_tag

_FIELDS: dict[str, type] = {"me": int, "peer": int, "op": str, "channel": list, "tag": int, "numel": int,
                            "dtype": str, "doing": str}


@dataclass(frozen=True, slots=True)
class PostedOp:
    """One logged point-to-point op of rank ``me`` with ``peer``."""

    me: int
    peer: int
    op: str                      # "send" or "recv"
    channel: tuple
    tag: int
    numel: int
    dtype: str
    doing: str

    @property
    def sender(self) -> int:
        return self.me if self.op == "send" else self.peer

    @property
    def receiver(self) -> int:
        return self.peer if self.op == "send" else self.me


def parse_line(text: str, *, where: str) -> PostedOp:
    """One log line as a PostedOp; ``where`` (file:line) names it in the error."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidInputError(f"p2p log line {where}", expected="one JSON object", found=exc.msg) from None
    bad = sorted(k for k, t in _FIELDS.items() if not isinstance(obj, dict) or not isinstance(obj.get(k), t)
                 or isinstance(obj.get(k), bool))
    if bad or obj["op"] not in ("send", "recv"):
        raise InvalidInputError(f"p2p log line {where}", expected=f"fields {', '.join(_FIELDS)}, op send or recv",
                                found=f"bad {', '.join(bad) or 'op'}",
                                fix="give the folder a run's STAGEWISE_P2P_LOG wrote")
    return PostedOp(**{**obj, "channel": tuple(obj["channel"])})


def read_logs(folder: str | Path) -> list[PostedOp]:
    """Every op of every ``rank*.jsonl`` in ``folder``, each rank's in its posting order."""
    files = sorted(Path(folder).glob("rank*.jsonl"))
    if not files:
        raise InvalidInputError(f"p2p log folder {folder}", expected="rank<r>.jsonl files", found="none",
                                fix="run with STAGEWISE_P2P_LOG set to this folder")
    return [parse_line(line, where=f"{path}:{n}") for path in files
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if line.strip()]


StreamKey = tuple  # (sender, receiver, channel); channel None when checked per pair alone


@dataclass(frozen=True, slots=True)
class Mismatch:
    """The first position where a stream's sends and receives disagree (None: that side has no op there)."""

    sender: int
    receiver: int
    channel: tuple | None
    position: int
    sent: PostedOp | None
    received: PostedOp | None

    def describe(self) -> str:
        where = f"rank {self.sender} -> rank {self.receiver}" + (f" on {self.channel}" if self.channel else "")
        return f"{where}, op {self.position}: sent {_op_text(self.sent)}, received {_op_text(self.received)}"


def _op_text(op: PostedOp | None) -> str:
    if op is None:
        return "nothing"
    kind, boundary, mb, index = split_tag(op.tag)
    return f"{kind.name} b{boundary} mb{mb} #{index} ({op.numel} x {op.dtype}, {op.doing})"


def streams(ops: Iterable[PostedOp], *, by_channel: bool = True
            ) -> dict[StreamKey, tuple[list[PostedOp], list[PostedOp]]]:
    """Per (sender, receiver, channel): the sender's sends and the receiver's receives, each in posting order."""
    out: dict[StreamKey, tuple[list[PostedOp], list[PostedOp]]] = {}
    for op in ops:
        key = (op.sender, op.receiver, op.channel if by_channel else None)
        out.setdefault(key, ([], []))[0 if op.op == "send" else 1].append(op)
    return out


def mismatches(ops: Sequence[PostedOp], *, by_channel: bool = True) -> list[Mismatch]:
    """Every stream whose sends and receives differ in tag at some position, or in count (first position each)."""
    out = []
    for (sender, receiver, chan), (sent, received) in sorted(streams(ops, by_channel=by_channel).items(),
                                                             key=lambda kv: repr(kv[0])):
        for i in range(max(len(sent), len(received))):
            s = sent[i] if i < len(sent) else None
            r = received[i] if i < len(received) else None
            if s is None or r is None or s.tag != r.tag:
                out.append(Mismatch(sender, receiver, chan, i, s, r))
                break
    return out


def main(argv: Sequence[str]) -> int:
    args = [a for a in argv if a != "--per-pair"]
    if len(args) != 1:
        print("usage: python -m planner.runtime.wire.p2p_order DIR [--per-pair]", file=sys.stderr)
        return 2
    try:
        found = mismatches(read_logs(args[0]), by_channel="--per-pair" not in argv)
    except InvalidInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for m in found:
        print(m.describe())
    print(f"{len(found)} streams out of order")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
