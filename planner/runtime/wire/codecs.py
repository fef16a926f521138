"""Boundary codecs on the wire: what a stage sends for a tensor under its plan's ``out_codec``.

``cost_models.codecs`` prices them; this module runs them, in pure torch on the tensor's own device.
A floating tensor travels as one flat ``uint8`` payload, its fp32 scales first (4-byte aligned) and its
codes after, so a boundary keeps one message per tensor (the tags' tensor index stays within bounds):

* ``fp8``: one scale per block of ``BLOCK["fp8"]`` values (the block's absmax / the format's largest value, so
  nothing overflows), then the values scaled into float8 (forward e4m3fn, backward e5m2: gradients need its
  range). Per block, not per tensor (DeepSeek-V3's 1x128 tiles): an outlier token no longer pushes the rest of
  the tensor into e4m3's subnormals.
* ``int8`` / ``int4``: blockwise absmax (SWARM's scheme): one scale (absmax / 127 or / 7) per block
  of ``BLOCK[codec]`` values, then the rounded codes (int4: biased by 8, two to a byte, low nibble first).

Rounding is to nearest, except int4's backward gradients (``STOCHASTIC``), rounded stochastically: round to
nearest zeroes every value under half a step (absmax / 14 of its block), most of a heavy-tailed gradient, and
so biases the gradient every step; stochastic rounding is unbiased (Gupta et al. 2015) at twice the worst-case
error (``rel_error``). Forward activations stay round to nearest: the loss is taken on them, and the extra
variance costs more than the bias (measured: benchmarks/convergence.py). The dither is a hash of each value's
bits and position, so one tensor always encodes to the same bytes (a verifier's copy is the consumer's, a twin
sends what its twin sends) and no RNG stream is consumed.

``none`` and non-floating tensors (token ids, masks) travel as they are. The payload's size follows from the
tensor's shape alone (:func:`payload_specs`), so a receiver posts it ahead; its bytes equal
``cost_models.codecs.wire_bytes``.

Non-finite values: a block holding an inf or NaN gets a NaN scale and zero codes, so every
value of it decodes to NaN: never finite garbage, and the receiver's loss or a verifier sees it.

No error feedback: activations change every step, so last step's residual does not apply to this step's
tensor (nor a gradient's to the next: each is another microbatch's, with respect to another activation);
AQ-SGD's remedy (an activation-delta cache) needs per-sample state this runtime does not keep.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from cost_models.codecs import BLOCK, SCALE_BYTES, STOCHASTIC, check_codec

FP8_DTYPES = {"F": torch.float8_e4m3fn, "B": torch.float8_e5m2}
INT_MAX = {"int8": 127, "int4": 7}
_INT4_BIAS = 8

Spec = tuple[tuple[int, ...], torch.dtype]


def compressed(codec: str, dtype: torch.dtype) -> bool:
    """Whether a tensor of ``dtype`` is encoded under ``codec`` (floating tensors only)."""
    return check_codec(codec) != "none" and dtype.is_floating_point


def num_scales(codec: str, numel: int) -> int:
    return math.ceil(numel / BLOCK[codec])


def code_bytes(codec: str, numel: int) -> int:
    return math.ceil(numel / 2) if codec == "int4" else numel


def payload_specs(shape: Sequence[int], dtype: torch.dtype, codec: str) -> list[Spec]:
    """The (shape, dtype) of each payload tensor a tensor of ``shape``/``dtype`` travels as."""
    if not compressed(codec, dtype):
        return [(tuple(shape), dtype)]
    n = math.prod(shape)
    return [((SCALE_BYTES * num_scales(codec, n) + code_bytes(codec, n),), torch.uint8)]


def payload_bytes(payloads: Sequence[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in payloads)


def encode(tensor: torch.Tensor, codec: str, direction: str) -> list[torch.Tensor]:
    """The payload tensors that carry ``tensor`` (``direction``: "F" activations, "B" gradients)."""
    if not compressed(codec, tensor.dtype):
        return [tensor]
    flat = tensor.detach().reshape(-1).float()
    if codec == "fp8":
        scales, codes = _encode_fp8(flat, FP8_DTYPES[direction])
    else:
        scales, codes = _encode_int(flat, codec, stochastic=(codec, direction) in STOCHASTIC)
    return [torch.cat([scales.reshape(-1).view(torch.uint8), codes])]


def decode(payloads: Sequence[torch.Tensor], codec: str, shape: Sequence[int], dtype: torch.dtype,
           direction: str) -> torch.Tensor:
    """The tensor of ``shape``/``dtype`` that :func:`encode`'s payloads stand for."""
    if not compressed(codec, dtype):
        (tensor,) = payloads
        return tensor
    (payload,) = payloads
    n = math.prod(shape)
    k = num_scales(codec, n)
    scales = payload[:SCALE_BYTES * k].view(torch.float32)
    codes = payload[SCALE_BYTES * k:]
    if codec == "fp8":
        values = _unblock(codes.view(FP8_DTYPES[direction]).float(), scales, codec, n)
    else:
        values = _decode_int(codes, scales, codec, n)
    return values.reshape(tuple(shape)).to(dtype)


def _scale(absmax: torch.Tensor, top: float, finite: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scales to store (NaN where a block is not finite) and the divisors to encode with (never 0)."""
    scale = torch.where(finite, absmax / top, torch.full_like(absmax, math.nan))
    divisor = torch.where(finite & (scale > 0), scale, torch.ones_like(scale))
    return scale, divisor


def _encode_fp8(flat: torch.Tensor, fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    top = torch.finfo(fp8).max
    blocks = _blocks(flat, BLOCK["fp8"])
    finite = torch.isfinite(blocks).all(dim=1, keepdim=True)
    scale, divisor = _scale(blocks.abs().amax(dim=1, keepdim=True), top, finite)
    scaled = torch.where(finite, blocks / divisor, torch.zeros_like(blocks)).clamp(-top, top)
    return scale, scaled.reshape(-1)[:flat.numel()].to(fp8).view(torch.uint8)


def _blocks(flat: torch.Tensor, block: int) -> torch.Tensor:
    """``flat`` zero-padded to whole blocks, one per row."""
    pad = (-flat.numel()) % block
    return torch.nn.functional.pad(flat, (0, pad)).reshape(-1, block)


def _unblock(values: torch.Tensor, scales: torch.Tensor, codec: str, n: int) -> torch.Tensor:
    """The first ``n`` of ``values`` times their blocks' scales."""
    return (_blocks(values, BLOCK[codec]) * scales.reshape(-1, 1)).reshape(-1)[:n]


_MASK32 = 0xFFFFFFFF


def _dither(blocks: torch.Tensor) -> torch.Tensor:
    """A uniform [0, 1) value per element, a hash of its fp32 bits and its position (murmur3's finaliser)."""
    pos = torch.arange(blocks.numel(), device=blocks.device, dtype=torch.int64).reshape(blocks.shape)
    h = (blocks.contiguous().view(torch.int32).to(torch.int64) ^ (pos * 0x9E3779B1)) & _MASK32
    h = ((h ^ (h >> 16)) * 0x85EBCA6B) & _MASK32
    h = ((h ^ (h >> 13)) * 0xC2B2AE35) & _MASK32
    return ((h ^ (h >> 16)) >> 8).float() * 2.0 ** -24


def _encode_int(flat: torch.Tensor, codec: str, *, stochastic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    top = INT_MAX[codec]
    blocks = _blocks(flat, BLOCK[codec])
    finite = torch.isfinite(blocks).all(dim=1, keepdim=True)
    scale, divisor = _scale(blocks.abs().amax(dim=1, keepdim=True), float(top), finite)
    scaled = blocks / divisor
    rounded = torch.floor(scaled + _dither(blocks)) if stochastic else torch.round(scaled)
    q = torch.where(finite, rounded, torch.zeros_like(blocks)).clamp(-top, top)
    q = q.reshape(-1)[:flat.numel()]
    if codec == "int8":
        return scale, q.to(torch.int8).view(torch.uint8)
    nibbles = torch.nn.functional.pad((q + _INT4_BIAS).to(torch.uint8), (0, flat.numel() % 2))
    return scale, nibbles[0::2] | (nibbles[1::2] << 4)


def _decode_int(codes: torch.Tensor, scales: torch.Tensor, codec: str, n: int) -> torch.Tensor:
    if codec == "int8":
        q = codes.view(torch.int8).float()
    else:
        q = torch.stack([codes & 0xF, codes >> 4], dim=1).reshape(-1)[:n].float() - _INT4_BIAS
    return _unblock(q, scales, codec, n)
