"""Boundary codecs: what a stage's activations (and the gradients sent back for them) cost on the wire.

* ``none``: the compute dtype as is.
* ``fp8``: forward e4m3, backward e5m2 (gradients need e5m2's range), one fp32 scale per tensor.
* ``int8`` / ``int4``: blockwise absmax (SWARM's 8-bit blockwise scheme; 4 bits packed two to a byte), one fp32
  scale per block of ``BLOCK[codec]`` values.

Encoding and decoding are memory bound: priced as ``PASSES`` reads and writes of the tensor at the device's
memory bandwidth each, one per eager torch op the runtime runs (``planner.runtime.wire.codecs``: absmax,
scale, round, clamp, cast and pack; decoding unpack, cast and scale). On a CPU the ops run far below its
memory bandwidth (measured 2026-12-05, one thread, 1M fp32 values: int8 encode 17 ms, decode 3.5 ms), which
this does not model: a rehearsal's compressed boundaries cost more than priced. Errors: ``REL_ERROR[codec]`` bounds the decoded tensor's
elementwise error relative to its block's (or tensor's) absmax; verifiers widen their fences by it.
"""
from __future__ import annotations

import math

from planner.errors import InvalidInputError

CODECS: tuple[str, ...] = ("none", "fp8", "int8", "int4")
COMPRESS_CHOICES: tuple[str, ...] = ("none", "auto", "fp8", "int8", "int4")
BLOCK = {"int8": 128, "int4": 64}
BITS = {"fp8": 8, "int8": 8, "int4": 4}
SCALE_BYTES = 4
PASSES = {"encode": 6, "decode": 3}
# Elementwise error over the block's absmax: half a quantisation step (int), half an ulp at the top of e4m3's /
# e5m2's mantissa (fp8: 3 / 2 mantissa bits, the backward's e5m2 the coarser).
REL_ERROR = {"none": 0.0, "fp8": 2.0 ** -3, "int8": 0.5 / 127, "int4": 0.5 / 7}


def check_codec(name: str, *, allowed: tuple[str, ...] = CODECS) -> str:
    if name not in allowed:
        raise InvalidInputError(f"codec {name!r}", expected=f"one of {', '.join(allowed)}", found=repr(name),
                                fix="pass --compress none|auto|fp8|int8|int4")
    return name


def wire_bytes(codec: str, nbytes: float, elem_bytes: int) -> float:
    """Bytes on the wire for a tensor of ``nbytes`` (``elem_bytes`` per value) under ``codec``."""
    if codec == "none":
        return nbytes
    n = nbytes / elem_bytes
    if codec == "fp8":
        return n + SCALE_BYTES
    return math.ceil(n * BITS[codec] / 8) + SCALE_BYTES * math.ceil(n / BLOCK[codec])  # int4: an odd count pads a nibble


def codec_ms(codec: str, nbytes: float, mem_bw_bytes_per_s: float, op: str) -> float:
    """Time to encode (``op="encode"``) or decode a tensor of ``nbytes`` on a device of that memory bandwidth."""
    if codec == "none":
        return 0.0
    return 1e3 * PASSES[op] * 2 * nbytes / mem_bw_bytes_per_s
