"""The solver's input: plain cost tables built from a BlockChain, a ClusterSpec and the cost models
(``problem_build``).

Everything the solver, the baselines, the DP and the brute-force tests need is
in one :class:`Problem` of numpy arrays, so the search code never calls a cost
model in an inner loop and synthetic instances can be built directly.

Devices are grouped into *classes* of interchangeable devices: same device
spec, same trust status, same links to every other device, and (when it
matters for verification) the same trust domain. A class is either the
devices of one spec on one host, or the single devices of several one-device
hosts that differ only in name (a volunteer swarm). Two plans that only
permute devices of one class are the same plan, so the solver searches over
classes, not devices.

Memory figures are integers that never undercount ``cost_models.memory``
(per-block activation bytes are rounded up), so a plan that fits here fits
when ``planner.check`` recomputes it.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from cost_models import codecs, comm, optim
from cost_models.cluster import Link
from cost_models.devices import DeviceSpec
from planner.errors import InvalidInputError
from planner.solver.policy import VerificationPolicy

# A verifier keeps an EMA reference and the received copy per boundary and direction.
VERIFIER_STATE_COPIES = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceClass:
    """Interchangeable devices (see the module docstring).

    ``stage_capable``: may run a stage (not on a ``role: verifier`` host).
    ``verifier_host``: a CPU-only trusted verifier device (policy placement ``cpu``).
    ``domain`` is the trust domain when it matters (a domain holding both
    trusted and untrusted devices), else ``None``: a trusted verifier is then
    outside every untrusted sender's domain by construction.
    """

    index: int
    name: str
    device_ids: tuple[str, ...]
    spec: DeviceSpec
    trusted: bool
    domain: str | None
    stage_capable: bool
    verifier_host: bool
    mem_bytes: int
    verify_ms_per_byte: float
    verify_fixed_ms: float

    @property
    def count(self) -> int:
        return len(self.device_ids)


@dataclass(frozen=True, slots=True, kw_only=True)
class TiedCopy:
    """A tied parameter: a stage reading it without holding ``first_block`` keeps its own copy."""

    first_block: int
    readers: tuple[int, ...]
    param_count: int


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Problem:
    """Cost tables of one planning problem at a fixed microbatch count.

    Per block ``l`` (per microbatch): ``time_ms[l, c]`` = forward + backward
    on class ``c``; ``param_count[l]``; ``act_bytes[l]`` saved activations;
    ``out_bytes[l]`` the boundary tensor crossing its right edge (float, for
    times) and ``out_bytes_int`` (rounded up, for memory). Per class pair,
    ``links[a][b]`` joins two *distinct* devices of those classes.
    ``state_bytes_per_param`` = weights + gradients + optimizer state.

    ``recompute``: every block's forward runs again in its backward (``torch.utils.checkpoint`` per
    block), so ``time_ms``/``bwd_ms`` include a second forward, ``act_bytes`` hold only each block's
    input, and a stage also holds one microbatch's full activations of the block recomputing: every
    device class's ``mem_bytes`` keeps the largest block's aside (one rule every search applies).
    ``twin``: the same problem with the other choice, so a plan can mix stages that recompute and
    stages that do not (``tables``).
    """

    name: str
    block_names: tuple[str, ...]
    time_ms: np.ndarray
    param_count: np.ndarray
    act_bytes: np.ndarray
    out_bytes: np.ndarray
    out_bytes_int: np.ndarray
    input_bytes: int
    tied: tuple[TiedCopy, ...]
    state_bytes_per_param: int
    grad_bytes_per_param: int
    classes: tuple[DeviceClass, ...]
    links: tuple[tuple[Link | None, ...], ...]
    num_microbatches: int
    schedule: str
    policy: VerificationPolicy
    max_replicas: int | None = None
    bwd_ms: np.ndarray | None = None  # backward alone per block and class (None: 2/3 of ``time_ms``)
    # The optimizer step (``cost_models.optim``): bytes moved per parameter, kernels per parameter tensor,
    # parameter tensors per block (None: the step is not priced).
    optim_traffic_per_param: int = 0
    optim_kernels_per_tensor: int = 0
    param_tensors: np.ndarray | None = None
    recompute: bool = False
    twin: "Problem | None" = None
    # Boundary codec the search assumes (``cost_models.codecs``; ``auto``'s searches assume int8, the plan's
    # stages then choose their own) and the bytes of one boundary value.
    codec: str = "none"
    elem_bytes: int = 4
    compress: str = "none"  # what the user asked (``auto``: each stage's codec is chosen at the end)
    # Gradient bytes per parameter the searches' all-reduces move (None: ``grad_bytes_per_param``); under
    # ``auto`` PowerSGD's, so the search explores the replication it makes affordable.
    search_grad_bytes_per_param: float | None = None
    # Per block, its ops that draw random numbers (``ir.Block.random_ops``): no audit recomputes their stage.
    random_ops: tuple[tuple[str, ...], ...] = ()
    # Per block, its backward FLOPs and, of those, its activations' gradients' (``ir.Block.bwd_input_flops``; None:
    # not recorded): the share of a stage's backward an audit recomputes (``audit_price.input_grad_share``).
    bwd_split: tuple[tuple[int, int | None], ...] = ()
    _time_prefix: np.ndarray = field(init=False, repr=False)
    _bwd_prefix: np.ndarray = field(init=False, repr=False)
    _param_prefix: np.ndarray = field(init=False, repr=False)
    _act_prefix: np.ndarray = field(init=False, repr=False)
    _class_of: dict = field(init=False, repr=False)
    _transfers: dict = field(init=False, repr=False)
    _wire: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        L, C = self.num_blocks, len(self.classes)
        if L < 1:
            raise InvalidInputError("problem blocks", expected="at least one block", found="none")
        if self.time_ms.shape != (L, C):
            raise InvalidInputError("problem time_ms", expected=f"shape ({L}, {C})", found=str(self.time_ms.shape))
        for name in ("param_count", "act_bytes", "out_bytes", "out_bytes_int"):
            arr = getattr(self, name)
            if arr.shape != (L,) or (arr < 0).any():
                raise InvalidInputError(f"problem {name}", expected=f"{L} values >= 0", found=str(arr.shape))
        if not np.isfinite(self.time_ms).all() or (self.time_ms < 0).any():
            raise InvalidInputError("problem time_ms", expected="finite times >= 0")
        if self.num_microbatches < 1:
            raise InvalidInputError("microbatches", expected=">= 1", found=str(self.num_microbatches))
        if self.schedule not in ("1f1b", "gpipe"):
            raise InvalidInputError("schedule", expected="1f1b or gpipe", found=repr(self.schedule))
        for i, c in enumerate(self.classes):
            if c.index != i:
                raise InvalidInputError(f"device class {c.name}", expected=f"index {i}", found=str(c.index))
        # Prefix sums make every range cost O(1).
        object.__setattr__(self, "_time_prefix", np.vstack([np.zeros((1, C)), np.cumsum(self.time_ms, axis=0)]))
        bwd = self.time_ms * (2.0 / 3.0) if self.bwd_ms is None else self.bwd_ms
        object.__setattr__(self, "_bwd_prefix", np.vstack([np.zeros((1, C)), np.cumsum(bwd, axis=0)]))
        object.__setattr__(self, "_param_prefix", np.concatenate([[0], np.cumsum(self.param_count)]))
        object.__setattr__(self, "_act_prefix", np.concatenate([[0], np.cumsum(self.act_bytes)]))
        object.__setattr__(self, "_class_of", {d: c.index for c in self.classes for d in c.device_ids})
        object.__setattr__(self, "_transfers", {})
        codecs.check_codec(self.codec)
        object.__setattr__(self, "_wire", np.array([codecs.wire_bytes(self.codec, float(b), self.elem_bytes)
                                                    for b in self.out_bytes], dtype=float))

    def tables(self, recompute: bool | None) -> "Problem":
        """The problem whose cost tables price a stage with this recompute choice (None: this problem's)."""
        if recompute is None or recompute == self.recompute:
            return self
        if self.twin is None:
            raise InvalidInputError("stage recompute choice", expected=f"recompute={self.recompute} in this problem",
                                    found=f"recompute={recompute}", fix="build the problem with its twin")
        return self.twin

    # --- sizes and lookups ------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.block_names)

    @property
    def device_ids(self) -> tuple[str, ...]:
        return tuple(d for c in self.classes for d in c.device_ids)

    def class_of(self, device_id: str) -> int:
        try:
            return self._class_of[device_id]
        except KeyError:
            raise InvalidInputError(f"device {device_id!r}", expected="a device of the cluster",
                                    found="an unknown id") from None

    def link(self, a: str, b: str) -> Link:
        """The link between two distinct devices."""
        lk = self.links[self.class_of(a)][self.class_of(b)]
        assert lk is not None, f"no link between {a} and {b}"
        return lk

    # --- range costs ------------------------------------------------------
    def range_time_ms(self, first: int, last: int, cls: int) -> float:
        p = self._time_prefix
        return float(p[last + 1, cls] - p[first, cls])

    def range_bwd_ms(self, first: int, last: int, cls: int) -> float:
        """The backward pass alone of blocks ``first..last`` on class ``cls`` (per microbatch)."""
        p = self._bwd_prefix
        return float(p[last + 1, cls] - p[first, cls])

    def range_optim_ms(self, first: int, last: int, cls: int) -> float:
        """One optimizer step of blocks ``first..last`` on class ``cls``."""
        if self.param_tensors is None:
            return 0.0
        tensors = int(self.param_tensors[first:last + 1].sum())
        return optim.step_ms(self.range_params(first, last), self.optim_traffic_per_param,
                             tensors * self.optim_kernels_per_tensor, self.classes[cls].spec)

    def range_params(self, first: int, last: int) -> int:
        """Parameters a stage over ``first..last`` holds, tied copies included."""
        p = self._param_prefix
        count = int(p[last + 1] - p[first])
        for t in self.tied:
            if not first <= t.first_block <= last and any(first <= r <= last for r in t.readers):
                count += t.param_count
        return count

    def range_act_bytes(self, first: int, last: int) -> int:
        p = self._act_prefix
        return int(p[last + 1] - p[first])

    def allreduce_line(self, cls: int, replicas: int) -> tuple[float, float]:
        """``(a0, a1)``: ``replicas`` devices of class ``cls`` all-reduce ``p > 0`` parameters' gradients in
        ``a0 + a1 p`` ms (a ring over the class's link; ``(0, 0)`` without replicas)."""
        if replicas < 2:
            return 0.0, 0.0
        ring = (self.links[cls][cls],) * replicas
        one = comm.allreduce_ms(1e9, ring, replicas)
        two = comm.allreduce_ms(2e9, ring, replicas)
        return one - (two - one), (two - one) / 1e9 * self.ar_bytes_per_param

    @property
    def ar_bytes_per_param(self) -> float:
        """Gradient bytes per parameter in the searches' all-reduces (``search_grad_bytes_per_param``)."""
        return self.grad_bytes_per_param if self.search_grad_bytes_per_param is None \
            else self.search_grad_bytes_per_param

    @property
    def allreduce_codec(self) -> str:
        """The all-reduce codec a stage without its own (``StagePlacement.allreduce_codec`` None) is priced at."""
        return "powersgd" if self.compress == "auto" else "none"

    def boundary_bytes(self, last_block: int) -> float:
        """Bytes sent across the cut after ``last_block`` (activation forward, gradient back), encoded with the
        codec the search assumes."""
        return float(self._wire[last_block])

    def raw_bytes(self, last_block: int) -> float:
        """The boundary tensor's own bytes (what a verifier checks, decoded)."""
        return float(self.out_bytes[last_block])

    def wire_bytes(self, last_block: int, codec: str | None) -> float:
        """The boundary's bytes on the wire under ``codec`` (None: the search's)."""
        if codec is None or codec == self.codec:
            return self.boundary_bytes(last_block)
        return codecs.wire_bytes(codec, float(self.out_bytes[last_block]), self.elem_bytes)

    def codec_ms(self, last_block: int, codec: str, cls: int, op: str, direction: str = "F") -> float:
        """Encoding (``op="encode"``) or decoding the boundary after ``last_block`` on class ``cls``, its
        activation (``direction="F"``) or gradient (``"B"``)."""
        spec = self.classes[cls].spec
        return codecs.codec_ms(codec, float(self.out_bytes[last_block]), spec.mem_bw_bytes_per_s, op,
                               op_overhead_ms=spec.op_overhead_ms, kind=spec.kind, direction=direction)

    def boundary_transfer_ms(self, link: Link) -> np.ndarray:
        """ms to send the boundary after each block ``e = 0..L-2`` over ``link`` (read-only): one table per
        link, shared by every stage sequence priced (pricing a plan built these entry by entry)."""
        got = self._transfers.get(link)
        if got is None:
            got = comm.transfer_ms_array(self._wire[:-1], link)
            got.flags.writeable = False
            self._transfers[link] = got
        return got

    def buffer_bytes(self, first: int, last: int) -> int:
        """Send/receive buffers of one microbatch, as ``cost_models.memory.stage_comm_buffer_bytes``."""
        L = self.num_blocks
        in_act = self.input_bytes if first == 0 else int(self.out_bytes_int[first - 1])
        out_act = int(self.out_bytes_int[last]) if last < L - 1 else 0
        in_grad = 0 if first == 0 else in_act
        return in_act + in_grad + 2 * out_act

    def transfer_ms(self, nbytes: float, a: str, b: str) -> float:
        return comm.transfer_ms(nbytes, self.link(a, b))

    def verify_ms(self, nbytes: float, cls: int) -> float:
        c = self.classes[cls]
        return c.verify_fixed_ms + c.verify_ms_per_byte * nbytes

    def replica_choices(self, cls: int) -> tuple[int, ...]:
        """Useful replica counts on a class: the smallest ``r`` for each busiest-replica share ceil(M/r)."""
        M = self.num_microbatches
        cap = min(self.classes[cls].count, M, self.max_replicas or M)
        out: dict[int, int] = {}
        for r in range(1, cap + 1):
            out.setdefault(math.ceil(M / r), r)
        return tuple(sorted(out.values()))


def bound_problem(problem: Problem) -> Problem:
    """A relaxation of every mix of ``problem``'s stages: times without recomputation, activations with it."""
    if not problem.recompute:
        return problem
    base = problem.tables(False)
    return dataclasses.replace(problem, time_ms=base.time_ms, bwd_ms=base.bwd_ms, classes=base.classes,
                               recompute=False, twin=None)


def recompute_problem(base: Problem) -> Problem:
    """``base`` with every block recomputed in its backward (see :class:`Problem`); its twin is ``base``."""
    if base.recompute:
        return base
    bwd = base._bwd_prefix[1:] - base._bwd_prefix[:-1]
    fwd = base.time_ms - bwd
    inputs = np.concatenate([[base.input_bytes], base.out_bytes_int[:-1]]).astype(np.int64)
    peak = int(base.act_bytes.max())  # the block recomputing holds its activations once
    classes = tuple(dataclasses.replace(c, mem_bytes=max(0, c.mem_bytes - peak)) for c in base.classes)
    return dataclasses.replace(base, time_ms=base.time_ms + fwd, bwd_ms=bwd + fwd, act_bytes=inputs,
                               classes=classes, recompute=True, twin=base)


# A link no transfer or all-reduce costs anything on (finite, as a Link must be).
FREE_LINK = Link(bandwidth_gbps=1e15, latency_ms=0.0)


def comm_free_for_bound(problem: Problem) -> Problem:
    """The problem with every link free: a bound on it bounds the cost of the compiled programs.

    The search's closed form (``objective.evaluate``) counts a stage's sends as time its replica is busy;
    the compiled programs send without blocking, so a plan's program cost (``program_cost``) can be below
    that closed form, and a bound on the closed form need not bound it. With free links the closed form is
    the stages' compute and checks alone, which no program beats: each replica is busy that long, and a
    microbatch passes every other stage on its way (``program_cost``'s path is at least the other stages'
    share of it).
    """
    links = tuple(tuple(None if lk is None else FREE_LINK for lk in row) for row in problem.links)
    return dataclasses.replace(problem, links=links)
