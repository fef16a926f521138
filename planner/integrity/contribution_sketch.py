"""A replica's gradient contribution as a few floats: its norm, its density and a count sketch of its direction."""
from __future__ import annotations

import functools
import math

import torch

__all__ = ["SKETCH_DIMS", "SKETCH_SIZE", "sketch", "sketch_seed"]

SKETCH_DIMS = 64     # count-sketch buckets: cosine error ~ 1 / sqrt(64) on unrelated directions
SKETCH_SIZE = SKETCH_DIMS + 2   # [norm, density, buckets...]
SKETCH_CHUNK = 1 << 20   # coordinates hashed at a time: the sketch's working memory stays ~8 MB whatever the stage


def sketch_seed(run_seed: int, stage: int) -> int:
    """The count sketch's seed of one stage (the same on every replica and the verifier)."""
    return run_seed * 1_000_003 + 7919 * stage + 17


@functools.lru_cache(maxsize=8)
def _chunk_buckets(seed: int, device: str) -> torch.Tensor:
    """Bucket and sign of a chunk's coordinates (``b`` or ``b + SKETCH_DIMS`` for a minus sign): a multiplicative
    hash of the position, the same on every device, made once a stage (8 MB) and rotated per chunk
    (:func:`_chunk_shift`); hashing every coordinate afresh cost a replica 23-27% of its step at d >= 384."""
    idx = torch.arange(SKETCH_CHUNK, dtype=torch.int64, device=device) + seed
    mixed = torch.remainder(idx * 2654435761, 1 << 32)   # Knuth's multiplicative hash (int64 wraps alike)
    return torch.remainder(mixed >> 13, 2 * SKETCH_DIMS)


def _chunk_shift(seed: int, chunk: int) -> int:
    """How far chunk ``chunk``'s buckets are rotated (the same hash of the chunk's index)."""
    return (((chunk + 1) * 2654435761 + seed) % (1 << 32) >> 13) % (2 * SKETCH_DIMS)


def sketch(flat: torch.Tensor, *, seed: int) -> torch.Tensor:
    """``[norm, density, count sketch of flat / norm]`` (``SKETCH_SIZE`` float64, on the CPU): what a replica
    sends its verifier, density being ``l1 / (sqrt(n) norm)``. Computed where the gradient is, a chunk at a time
    (only the sketch leaves the device)."""
    x = flat.detach().reshape(-1)
    table = _chunk_buckets(seed, str(x.device))
    signed = torch.zeros(2 * SKETCH_DIMS, dtype=torch.float32, device=x.device)
    l1 = torch.zeros((), dtype=torch.float64, device=x.device)
    for chunk, start in enumerate(range(0, x.numel(), SKETCH_CHUNK)):
        part = x[start:start + SKETCH_CHUNK].float()
        sums = torch.zeros_like(signed).index_add_(0, table[:part.numel()], part)
        signed += torch.roll(sums, _chunk_shift(seed, chunk))
        l1 += part.abs().sum().double()
    out = signed[:SKETCH_DIMS] - signed[SKETCH_DIMS:]
    x = x.float()
    out, norm = out.to("cpu", torch.float64), float(x.norm())
    ok = norm > 0 and math.isfinite(norm)
    unit = out / norm if ok else out
    density = float(l1) / (math.sqrt(x.numel()) * norm) if ok else (0.0 if norm == 0 else math.nan)
    return torch.cat([torch.tensor([norm, density], dtype=torch.float64), unit])
