"""Codecs for a replicated stage's gradient all-reduce (``StageInfo.allreduce_codec``): PowerSGD (Vogels et al.
2019), and blockwise int8 with error feedback (:class:`Int8ReduceState`, an all-gather).

PowerSGD: every replica sums, over its stage's group, a rank-``POWERSGD_RANK`` approximation of its gradient plus the
error it left out before (error feedback): per matrix ``M_i = g_i + e_i``, ``P = sum_i M_i Q`` (one flat
all-reduce of every matrix's ``P`` together with the values sent whole), ``P`` orthonormalised,
``Q_i = M_i^T P``, ``Q = sum_i Q_i`` (a second flat all-reduce), the sum taken as ``P Q^T`` and
``e_i = M_i - P Q_i^T``: what every replica applies plus what they all still hold is the exact sum of their
gradients. ``Q`` starts from a fixed seed (the same on every replica) and is warm-started from the last step's
sum, so every replica computes the same ``P`` and ``P Q^T``, bit for bit. Tensors of one dimension, small ones
and ones the rank would not shrink are summed uncompressed (``cost_models.codecs`` prices the same split).
Summing is done in float32 whatever the gradients' dtype.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import pairwise

import torch

from cost_models.codecs import POWERSGD_MIN_VALUES, POWERSGD_RANK
from planner.errors import ProtocolError
from planner.runtime.wire import codecs

SEED = 20190523
EPS = 1e-8

AllReduce = Callable[[torch.Tensor], None]


def _matrix_shape(shape: torch.Size, rank: int) -> tuple[int, int] | None:
    """The ``(m, n)`` a parameter is compressed as, or None when it is sent whole."""
    if len(shape) < 2 or shape.numel() < POWERSGD_MIN_VALUES:
        return None
    m = shape[0]
    n = shape.numel() // m
    r = min(rank, m, n)
    return (m, n) if r * (m + n) < m * n else None


def orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``p``'s (QR; a zero column stays zero rather than dividing by zero)."""
    q, r = torch.linalg.qr(p, mode="reduced")
    return q * torch.sign(torch.diagonal(r) + EPS)


class PowerSGDState:
    """One stage's PowerSGD state on one replica: its error-feedback buffers and the warm-started ``Q``s."""

    def __init__(self, shapes: Sequence[torch.Size], *, rank: int = POWERSGD_RANK, seed: int = SEED) -> None:
        self.shapes = tuple(torch.Size(s) for s in shapes)
        self.numels = tuple(s.numel() for s in self.shapes)
        self.matrices = tuple(_matrix_shape(s, rank) for s in self.shapes)
        gen = torch.Generator().manual_seed(seed)
        self.q: list[torch.Tensor | None] = []
        for mn in self.matrices:
            self.q.append(None if mn is None else torch.randn(mn[1], min(rank, *mn), generator=gen))
        self.errors: list[torch.Tensor | None] = [None] * len(self.shapes)

    @property
    def param_values(self) -> int:
        return sum(self.numels)

    def wire_values(self) -> int:
        """Values each replica all-reduces per step (both rounds), the uncompressed tail excluded."""
        return sum(n if mn is None else q.shape[1] * (mn[0] + mn[1])
                   for n, mn, q in zip(self.numels, self.matrices, self.q))

    def reduce(self, flat: torch.Tensor, all_reduce: AllReduce) -> None:
        """Replace ``flat`` (the parameters' gradients in order, then any values to sum exactly) by the
        replicas' PowerSGD sum, calling ``all_reduce`` (an in-place float32 sum over the stage) twice."""
        offsets = [0]
        for n in self.numels:
            offsets.append(offsets[-1] + n)
        views = [flat[a:b] for a, b in pairwise(offsets)]
        tail = flat[offsets[-1]:]
        ms: dict[int, torch.Tensor] = {}
        first: list[torch.Tensor] = []
        for i, (view, mn) in enumerate(zip(views, self.matrices)):
            if mn is None:
                first.append(view.float())
                continue
            m = view.float().reshape(mn)
            if self.errors[i] is not None:
                m = m + self.errors[i]
            ms[i] = m
            first.append((m @ self.q[i].to(m.device)).reshape(-1))
        first.append(tail.float())
        round1 = torch.cat(first)
        all_reduce(round1)
        offset, ps = 0, {}
        for i, n in enumerate(self.numels):
            mn = self.matrices[i]
            size = n if mn is None else mn[0] * self.q[i].shape[1]
            chunk = round1[offset:offset + size]
            offset += size
            if mn is None:
                views[i].copy_(chunk)
            else:
                ps[i] = orthonormalize(chunk.reshape(mn[0], -1))
        tail.copy_(round1[offset:])
        if not ms:
            return
        local_q = {i: ms[i].t() @ ps[i] for i in ms}
        round2 = torch.cat([local_q[i].reshape(-1) for i in sorted(ms)])
        all_reduce(round2)
        offset = 0
        for i in sorted(ms):
            q_sum = round2[offset:offset + local_q[i].numel()].reshape(local_q[i].shape)
            offset += local_q[i].numel()
            self.errors[i] = ms[i] - ps[i] @ local_q[i].t()
            views[i].copy_((ps[i] @ q_sum.t()).reshape(-1))
            self.q[i] = q_sum.clone()


AllGather = Callable[[torch.Tensor], list[torch.Tensor]]


class Int8ReduceState:
    """One stage's blockwise-int8 all-reduce on one replica, with error feedback (Karimireddy et al. 2019).

    Each replica encodes ``M = g + e`` (its gradient plus the residual it kept) as the int8 boundary codec does
    (``wire.codecs``: absmax per block of ``BLOCK["int8"]``), keeps ``e = M - decode(M)`` and all-gathers the
    payload; every replica decodes every payload and sums them in fp32 in rank order, so every replica applies
    the same sum, bit for bit, and what they apply plus what they hold is the exact sum. Values after the
    ``param_values`` gradients (a verified run's trained count) ride as raw fp32 bytes and sum exactly.
    Every payload's size follows from ``param_values`` and the tail's length alone; a peer sends bytes, never
    code, and a non-finite block decodes to NaN (the loss sees it). As for the robust sum
    (``rank.replica_checks``), with three replicas or more gloo's all-gather forwards payloads through other
    replicas, which could alter them per receiver; the residual is not checkpointed (a resumed run restarts it)."""

    def __init__(self, param_values: int) -> None:
        self.param_values = int(param_values)
        self.error: torch.Tensor | None = None

    def payload_bytes(self, tail: int = 0) -> int:
        """Bytes of one replica's message: ``tail`` raw fp32 values, then the int8 payload (first: every fp32
        view stays 4-byte aligned)."""
        (spec,) = codecs.payload_specs((self.param_values,), torch.float32, "int8")
        return spec[0][0] + 4 * tail

    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        """This replica's message for ``flat`` (gradients, then the exact tail); keeps the new residual."""
        n = self.param_values
        m = flat[:n].float()
        if self.error is not None:
            m = m + self.error
        (payload,) = codecs.encode(m, "int8", "B")
        self.error = m - self._decode(payload)
        tail = flat[n:].float().contiguous().view(torch.uint8)
        return torch.cat([tail, payload])

    def _decode(self, payload: torch.Tensor) -> torch.Tensor:
        return codecs.decode([payload], "int8", (self.param_values,), torch.float32, "B")

    def combine(self, parts: Sequence[torch.Tensor], out: torch.Tensor, ranks: Sequence[int]) -> None:
        """Write the sum of the gathered ``parts`` (from ``ranks``, in order) into ``out`` (shaped as the flat
        sent)."""
        tail = out.numel() - self.param_values
        want = self.payload_bytes(tail)
        for rank, part in zip(ranks, parts, strict=True):
            if part.dtype != torch.uint8 or part.numel() != want:
                raise ProtocolError(f"rank {rank}'s int8 gradient message", sender=rank, expected=f"{want} uint8 bytes",
                                    found=f"{part.numel()} {part.dtype} values", fix="run every rank from the same plan")
        head = 4 * tail
        total = torch.zeros(self.param_values, dtype=torch.float32, device=out.device)
        tails = torch.zeros(tail, dtype=torch.float32, device=out.device)
        for part in parts:   # rank order on every replica: the same fp32 sums, bit for bit
            total += self._decode(part[head:])
            tails += part[:head].view(torch.float32)
        out[:self.param_values].copy_(total)
        out[self.param_values:].copy_(tails)

    def reduce(self, flat: torch.Tensor, all_gather: AllGather, ranks: Sequence[int]) -> None:
        """Replace ``flat`` by the int8 sum over ``ranks``; ``all_gather`` returns every replica's message, in
        ``ranks``' order, into buffers of this replica's message's size."""
        self.combine(all_gather(self.encode(flat)), flat, ranks)
