"""The stateless corruptions of the attack harness (``attacks``): each kind's rule on one tensor, the fixed
feature pattern of a bias, a boundary codec's rounding step, and the process-independent seeds they draw from."""
from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch

from cost_models.codecs import BITS, BLOCK

__all__ = ["corrupt", "feature_pattern", "quant_step", "stable_seed"]


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts``, identical in every process (``hash`` is salted)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def feature_pattern(x: torch.Tensor, seed: int) -> torch.Tensor:
    """A fixed random +-1 pattern over the features of ``x`` (the last dim; channels of a
    4-D feature map), shaped to broadcast against ``x``; the same for every call with ``seed``."""
    dim = 1 if x.dim() == 4 else x.dim() - 1
    gen = torch.Generator().manual_seed(stable_seed("pattern", seed, x.shape[dim]))
    signs = torch.randint(0, 2, (x.shape[dim],), generator=gen).float() * 2 - 1
    shape = [1] * x.dim()
    shape[dim] = x.shape[dim]
    return signs.reshape(shape)


def corrupt(kind: str, x: torch.Tensor, params: Mapping[str, Any], gen: torch.Generator, *,
            pattern_seed: int = 0) -> torch.Tensor:
    """Apply one stateless attack ``kind`` to ``x``; returns a new tensor of ``x``'s dtype.
    ``gen`` drives the per-call randomness; ``pattern_seed`` fixes the bias pattern."""
    xf = x.detach().float()
    if kind == "constant":
        out = torch.full_like(xf, float(params.get("value", 1.0)))
    elif kind == "zeros":
        out = torch.zeros_like(xf)
    elif kind == "random":
        noise = torch.randn(xf.shape, generator=gen)
        out = xf.mean() + xf.std(correction=0) * noise
    elif kind == "scale":
        out = xf * float(params.get("factor", -1.0))
    elif kind == "sign_flip":
        out = -xf
    elif kind == "random_sign":
        signs = torch.randint(0, 2, xf.shape, generator=gen).float() * 2 - 1
        out = xf * signs
    elif kind == "bias":
        value = params.get("value")
        shift = float(value) if value is not None else float(params.get("rel", 1.0)) * float(xf.std(correction=0))
        out = xf + shift * feature_pattern(xf, pattern_seed)
    elif kind == "noise":
        out = xf + float(params.get("std", 0.5)) * xf.std(correction=0) * torch.randn(xf.shape, generator=gen)
    elif kind == "taint":   # the values honest: only the taint header lies (``hooks.AttackHooks.taints``)
        out = xf
    else:
        raise AssertionError(f"{kind} is not a stateless attack")
    return out.to(dtype=x.dtype)


# float8 formats' mantissa bits and smallest normal exponent (activations e4m3fn, gradients e5m2: the wire's choice)
_FP8_FORMATS = {"act": (3, -6, torch.float8_e4m3fn), "grad": (2, -14, torch.float8_e5m2)}


def quant_step(x: torch.Tensor, codec: str, direction: str) -> torch.Tensor:
    """The spacing of ``codec``'s grid at each element of ``x`` (the wire's scheme, ``planner.runtime.wire.codecs``):
    for int8/int4 its block's absmax / (2^(bits-1) - 1) over the flattened tensor, for fp8 the float8 spacing at
    the element under its block's (else the tensor's) absmax scale. Rounding to nearest errs by half of it."""
    flat = x.detach().float().reshape(-1)
    block = BLOCK.get(codec, max(1, flat.numel()))
    pad = (-flat.numel()) % block
    blocks = torch.nn.functional.pad(flat, (0, pad)).reshape(-1, block)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    if codec == "fp8":
        mantissa, min_exp, fmt = _FP8_FORMATS["grad" if direction == "grad" else "act"]
        scale = absmax.clamp_min(1e-30) / torch.finfo(fmt).max
        exp = torch.floor(torch.log2((blocks.abs() / scale).clamp_min(1e-30))).clamp_min(min_exp)
        steps = torch.exp2(exp - mantissa) * scale
    else:
        steps = (absmax / (2 ** (BITS[codec] - 1) - 1)).expand_as(blocks)
    return steps.reshape(-1)[:flat.numel()].reshape(x.shape)
