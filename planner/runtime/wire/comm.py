"""Point-to-point helpers, message tags and process groups for the runtime.

Every message carries a tag that encodes (kind, boundary, microbatch, tensor
index), so two messages between the same pair of ranks never cross even when
a schedule has several in flight. Gloo honours tags. NCCL ignores them and pairs
by posting order per communicator, and the ends of a pair post different kinds in
different orders; so under NCCL every :func:`channel` (kind and boundary or topic),
in which both ends post in one order, has its own communicator (:func:`open_channels`).
``STAGEWISE_P2P_LOG=DIR`` logs every posted op; ``p2p_order`` checks the orders.

Every failure of a transfer is turned into :class:`RankFailureError` naming
the peer rank: a peer that died closes its connections (gloo: "Connection
closed by peer") and one that hangs trips the process group's timeout.
"""
from __future__ import annotations

import enum
import json
import os
import re
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Iterable, Sequence, TextIO

import torch
import torch.distributed as dist

from planner.errors import InvalidInputError, RankFailureError, first_line


class Kind(enum.IntEnum):
    """What a message holds (the high bits of its tag)."""

    ACT = 0          # a stage's output activation
    GRAD = 1         # the gradient of a stage's input
    TAINT_ACT = 2    # 1-element header: this microbatch's activation was dropped upstream
    TAINT_GRAD = 3
    VERDICT_ACT = 4  # 2 ints from a verifier: [flagged, tainted]
    VERDICT_GRAD = 5
    METRICS = 6      # per-step metrics of a rank, to rank 0
    CONTROL = 7      # a decision or its evidence (``planner.runtime.wire.control``); the boundary field names it


# Bit widths of the tag fields; the total stays below 2**31 (gloo and MPI take an int tag).
_INDEX_BITS, _MB_BITS, _BOUNDARY_BITS, _KIND_BITS = 5, 13, 9, 3
MAX_TENSORS = 1 << _INDEX_BITS
MAX_MICROBATCHES = 1 << _MB_BITS
MAX_BOUNDARIES = 1 << _BOUNDARY_BITS


def make_tag(kind: Kind, boundary: int, mb: int, index: int = 0) -> int:
    """A unique, deterministic tag for one tensor of one message."""
    if not 0 <= index < MAX_TENSORS:
        raise InvalidInputError("tensors crossing one stage edge", expected=f"< {MAX_TENSORS}", found=str(index + 1),
                                fix="cut the model where fewer tensors are live")
    if not 0 <= mb < MAX_MICROBATCHES:
        raise InvalidInputError("microbatch index", expected=f"< {MAX_MICROBATCHES}", found=str(mb))
    if not 0 <= boundary < MAX_BOUNDARIES:
        raise InvalidInputError("stage boundary index", expected=f"< {MAX_BOUNDARIES}", found=str(boundary))
    tag = int(kind)
    for value, bits in ((boundary, _BOUNDARY_BITS), (mb, _MB_BITS), (index, _INDEX_BITS)):
        tag = (tag << bits) | value
    assert tag < 2 ** 31
    return tag


def split_tag(tag: int) -> tuple[Kind, int, int, int]:
    """Inverse of :func:`make_tag`: (kind, boundary, mb, index)."""
    index = tag & (MAX_TENSORS - 1)
    tag >>= _INDEX_BITS
    mb = tag & (MAX_MICROBATCHES - 1)
    tag >>= _MB_BITS
    boundary = tag & (MAX_BOUNDARIES - 1)
    return Kind(tag >> _BOUNDARY_BITS), boundary, mb, index


# --------------------------------------------------------------------------- failures
_PEER_CLOSED = re.compile(r"connection closed by peer|connection reset|broken pipe|end of file", re.I)
_TIMED_OUT = re.compile(r"timed out|timeout", re.I)


def failure(exc: BaseException, *, peer: int | None, doing: str) -> RankFailureError:
    """A RankFailureError naming ``peer`` (the rank this one was talking to) from a backend error."""
    text = first_line(exc)
    who = f"rank {peer}" if peer is not None else "a peer rank"
    if _TIMED_OUT.search(text):
        reason = f"{who} did not answer within the timeout (hung or too slow)"
    elif _PEER_CLOSED.search(text):
        reason = f"{who} died (its connection closed)"
    else:
        reason = f"{who} failed: {text[:200]}"
    err = RankFailureError(f"{reason} while {doing}",
                           fix="see that rank's own error; raise --timeout if it is merely slow")
    err.peer = peer  # type: ignore[attr-defined]  # read by the launcher to find the root cause
    return err


BACKEND_ERRORS: tuple[type[BaseException], ...] = (RuntimeError, dist.DistError, ConnectionError, TimeoutError)


# --------------------------------------------------------------------------- p2p
@dataclass(slots=True)
class Pending:
    """Posted receives (or sends) of one message; ``wait`` raises RankFailureError naming the peer."""

    works: list
    tensors: list[torch.Tensor]
    peer: int
    doing: str

    def completed(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def wait(self) -> list[torch.Tensor]:
        try:
            for work in self.works:
                work.wait()
        except BACKEND_ERRORS as exc:
            raise failure(exc, peer=self.peer, doing=self.doing) from exc
        self.works = []
        return self.tensors


# --------------------------------------------------------------------------- channels
Channel = tuple  # ("act", b), ("grad", b), ("verdict_act", b), ("verdict_grad", b), ("metrics",), ("control", topic)

_CHANNEL_NAMES: dict[Kind, str] = {
    Kind.ACT: "act", Kind.TAINT_ACT: "act", Kind.GRAD: "grad", Kind.TAINT_GRAD: "grad",
    Kind.VERDICT_ACT: "verdict_act", Kind.VERDICT_GRAD: "verdict_grad", Kind.CONTROL: "control"}
_BOUNDARY_CHANNELS = ("act", "grad", "verdict_act", "verdict_grad")

# Channel -> its communicator; empty (every channel on the default group) unless :func:`open_channels` filled it.
_CHANNEL_GROUPS: dict[Channel, dist.ProcessGroup] = {}


def channel(kind: Kind, boundary: int) -> Channel:
    """The stream a message pairs in (a header shares its message's): its kind's, of its boundary (CONTROL: of
    its topic, which the boundary field holds); every rank posts one channel's messages to a peer in one order."""
    kind = Kind(kind)
    if kind is Kind.METRICS:
        return ("metrics",)
    return (_CHANNEL_NAMES[kind], boundary)


def run_channels(num_boundaries: int, topics: Iterable[int]) -> tuple[Channel, ...]:
    """Every channel of a run with ``num_boundaries`` stage boundaries and these control topics, in the one
    order every rank creates their groups in."""
    return (*((name, b) for b in range(num_boundaries) for name in _BOUNDARY_CHANNELS), ("metrics",),
            *(("control", int(t)) for t in sorted(topics)))


def open_channels(channels: Sequence[Channel], *, timeout_s: float, force: bool = False) -> int:
    """Under NCCL (or ``force``), one communicator per channel over every rank, created on every rank in
    ``channels``' order; gloo pairs by tag already, so it needs none. Returns how many were created."""
    _CHANNEL_GROUPS.clear()
    if not force and dist.get_backend() != "nccl":
        return 0
    world = list(range(dist.get_world_size()))
    try:
        for key in channels:
            _CHANNEL_GROUPS[tuple(key)] = dist.new_group(ranks=world, timeout=timedelta(seconds=timeout_s))
    except BACKEND_ERRORS as exc:
        raise failure(exc, peer=None, doing="creating the channels' process groups") from exc
    return len(_CHANNEL_GROUPS)


def channel_group(kind: Kind, boundary: int) -> dist.ProcessGroup | None:
    """The communicator of a message's channel (None: the default group)."""
    return _CHANNEL_GROUPS.get(channel(kind, boundary)) if _CHANNEL_GROUPS else None


# --------------------------------------------------------------------------- the op log
P2P_LOG_ENV = "STAGEWISE_P2P_LOG"


_op_log_file: TextIO | None = None
_op_log_read = False   # whether this process has looked at P2P_LOG_ENV (once: a post then costs one test)


def _op_log() -> TextIO | None:
    global _op_log_file, _op_log_read
    if not _op_log_read:
        _op_log_read = True
        folder = os.environ.get(P2P_LOG_ENV)
        if folder:
            path = os.path.join(folder, f"rank{dist.get_rank()}.jsonl")
            try:
                os.makedirs(folder, exist_ok=True)
                _op_log_file = open(path, "a", encoding="utf-8")
            except OSError as exc:
                raise InvalidInputError(P2P_LOG_ENV, expected="a folder this rank can write its op log in",
                                        found=f"{path}: {exc.strerror}", fix=f"unset {P2P_LOG_ENV} or point it "
                                        "at a writable folder") from None
    return _op_log_file


def _log_ops(file: TextIO, ops: Sequence[dist.P2POp], doing: str) -> None:
    me = dist.get_rank()
    for op in ops:
        kind, boundary, _, _ = split_tag(op.tag)
        file.write(json.dumps({"me": me, "peer": op.peer, "op": "send" if op.op is dist.isend else "recv",
                               "channel": list(channel(kind, boundary)), "tag": op.tag,
                               "numel": op.tensor.numel(), "dtype": str(op.tensor.dtype), "doing": doing}) + "\n")
    file.flush()  # a rank that then hangs or dies still leaves its last posts


def _ops(op, tensors: Sequence[torch.Tensor], peer: int, kind: Kind, boundary: int, mb: int,
         group: dist.ProcessGroup | None) -> list[dist.P2POp]:
    return [dist.P2POp(op, t, peer, group=group, tag=make_tag(kind, boundary, mb, i)) for i, t in enumerate(tensors)]


def post(ops: list[dist.P2POp], tensors: list[torch.Tensor], *, peer: int, doing: str) -> Pending:
    """Issue point-to-point ops as one batch (one NCCL group call; gloo issues them in turn)."""
    log = _op_log()
    if log is not None:
        _log_ops(log, ops, doing)
    try:
        works = dist.batch_isend_irecv(ops) if len(ops) > 1 else [
            (dist.isend if ops[0].op is dist.isend else dist.irecv)(
                ops[0].tensor, ops[0].peer, group=ops[0].group, tag=ops[0].tag)]
    except BACKEND_ERRORS as exc:
        raise failure(exc, peer=peer, doing=doing) from exc
    return Pending(works=list(works), tensors=tensors, peer=peer, doing=doing)


def send(tensors: Sequence[torch.Tensor], *, peer: int, kind: Kind, boundary: int, mb: int,
         doing: str, header: torch.Tensor | None = None, header_kind: Kind | None = None,
         group: dist.ProcessGroup | None = None) -> Pending:
    """Non-blocking send of a message (and optionally its 1-element header) to ``peer``; ``group`` None: its
    channel's."""
    group = group if group is not None else channel_group(kind, boundary)
    tensors = [t.contiguous() for t in tensors]
    ops = _ops(dist.isend, tensors, peer, kind, boundary, mb, group)
    if header is not None:
        assert header_kind is not None
        ops += _ops(dist.isend, [header], peer, header_kind, boundary, mb, group)
    return post(ops, tensors, peer=peer, doing=doing)


def recv(specs: Iterable[tuple[tuple[int, ...], torch.dtype]], *, peer: int, kind: Kind, boundary: int, mb: int,
         doing: str, device: torch.device, header_kind: Kind | None = None, header_numel: int = 1,
         group: dist.ProcessGroup | None = None) -> Pending:
    """Post receives for a message of the given static shapes; the header, if any, comes last; ``group`` None:
    its channel's."""
    group = group if group is not None else channel_group(kind, boundary)
    tensors = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs]
    ops = _ops(dist.irecv, tensors, peer, kind, boundary, mb, group)
    if header_kind is not None:
        header = torch.zeros(header_numel, dtype=torch.int64, device=device)
        ops += _ops(dist.irecv, [header], peer, header_kind, boundary, mb, group)
        tensors.append(header)
    return post(ops, tensors, peer=peer, doing=doing)


# --------------------------------------------------------------------------- groups
@dataclass(slots=True)
class Groups:
    """Process groups this rank belongs to (None where it is not a member or needs none)."""

    stage: dist.ProcessGroup | None = None          # the replicas of this rank's stage
    stage_ranks: tuple[int, ...] = ()
    verifiers: dist.ProcessGroup | None = None      # all verifier ranks, for exchanging flags
    verifier_ranks: tuple[int, ...] = ()
    tied: list[tuple[dist.ProcessGroup, tuple[int, ...], tuple[str, ...]]] = field(default_factory=list)


def init_process_group(*, backend: str, rank: int, world_size: int, timeout_s: float,
                       init_method: str | None = None, store: dist.Store | None = None) -> None:
    """``init_process_group`` with the runtime's timeout (a hung peer fails the wait after ``timeout_s``)."""
    kwargs = {"init_method": init_method} if init_method else {}
    _CHANNEL_GROUPS.clear()  # a previous group's channels died with it
    if store is not None:
        kwargs["store"] = dist.PrefixStore("default_pg", store)  # the keys env:// would use
    try:
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s), **kwargs)
    except BACKEND_ERRORS as exc:
        raise failure(exc, peer=None, doing="joining the process group (rendezvous)") from exc


LOOPBACK = "127.0.0.1"


def bound_store(*, rank: int, world_size: int, addr: str, port: int, timeout_s: float) -> dist.Store:
    """The run's own store: rank 0 hosts it on a socket bound to ``addr`` alone (torch's own binds every
    interface), the others connect to it there. It holds bytes (rank claims, gloo's addresses), never a
    pickle; a stranger who reaches it can disturb the start, not pass the membership proof."""
    try:
        if rank != 0:
            return dist.TCPStore(addr, port, world_size, False, timedelta(seconds=timeout_s))
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((addr, port))
        listener.listen(max(128, world_size))
        # The store takes the descriptor over (and closes it): Python must not close it too.
        return dist.TCPStore(addr, port, world_size, True, timedelta(seconds=timeout_s),
                             wait_for_workers=False, master_listen_fd=listener.detach())
    except (OSError, *BACKEND_ERRORS) as exc:
        raise failure(exc, peer=None if rank else 0, doing=f"opening the run's store on {addr}:{port}") from exc


def loopback_store(*, rank: int, world_size: int, port: int, timeout_s: float) -> dist.Store:
    """A store for ranks that all run on this machine, bound to the loopback address."""
    return bound_store(rank=rank, world_size=world_size, addr=LOOPBACK, port=port, timeout_s=timeout_s)


def env_store(*, launcher_rank: int, world_size: int, timeout_s: float) -> dist.Store:
    """The store ``env://`` makes (under torchrun: a client of its agent's store), for the rank the
    launcher gave this process, which decides where that store lives whatever rank the plan gives it."""
    try:
        store, _, _ = next(dist.rendezvous("env://", rank=launcher_rank, world_size=world_size,
                                           timeout=timedelta(seconds=timeout_s)))
    except BACKEND_ERRORS as exc:
        raise failure(exc, peer=None, doing="reaching the launcher's store (rendezvous)") from exc
    store.set_timeout(timedelta(seconds=timeout_s))
    return store


def keep_gloo_on_loopback() -> None:
    """gloo binds its own sockets to the interface GLOO_SOCKET_IFNAME names (default: the address the host
    name resolves to, often a public one): for ranks that all run here, the loopback interface."""
    names = [name for _, name in socket.if_nameindex()]
    loop = next((n for n in ("lo", "lo0") if n in names), None)
    if loop is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = loop


def new_groups(rank_sets: Sequence[Sequence[int]], *, timeout_s: float) -> list[dist.ProcessGroup | None]:
    """One process group per rank set, created on every rank in the same order (as torch requires).

    Returns, per set, the group when this rank is a member, else None. Sets
    with a single rank need no group and get None.
    """
    me = dist.get_rank()
    out: list[dist.ProcessGroup | None] = []
    for ranks in rank_sets:
        ranks = sorted(set(ranks))
        if len(ranks) < 2:
            out.append(None)
            continue
        group = dist.new_group(ranks=ranks, timeout=timedelta(seconds=timeout_s))
        out.append(group if me in ranks else None)
    return out


def barrier(*, ranks: Sequence[int], doing: str) -> None:
    """Every rank of the default group reaches this point (a dead or hung one is named by the failure)."""
    try:
        dist.barrier()
    except BACKEND_ERRORS as exc:
        raise failure(exc, peer=None, doing=f"{doing} (ranks {list(ranks)})") from exc


def all_reduce_sum(tensor: torch.Tensor, *, group: dist.ProcessGroup | None, ranks: Sequence[int],
                   doing: str) -> None:
    """Sum ``tensor`` over ``group`` (None: every rank)."""
    try:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    except BACKEND_ERRORS as exc:
        raise failure(exc, peer=None, doing=f"{doing} (ranks {list(ranks)})") from exc


def flat_grads(params: Sequence[torch.nn.Parameter]) -> torch.Tensor:
    """The gradients of ``params`` as one flat buffer (zeros where a parameter got none)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def unflatten_grads(flat: torch.Tensor, params: Sequence[torch.nn.Parameter]) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p).clone()
        offset += n
