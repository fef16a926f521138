"""Boundary codecs: what a stage's activations (and the gradients sent back for them) cost on the wire.

* ``none``: the compute dtype as is.
* ``fp8``: forward e4m3, backward e5m2 (gradients need e5m2's range), one fp32 scale per block of
  ``BLOCK["fp8"]`` values (DeepSeek-V3's 1x128 tiles; per tensor, an outlier pushed the rest into subnormals).
* ``int8`` / ``int4``: blockwise absmax (SWARM's 8-bit blockwise scheme; 4 bits packed two to a byte), one fp32
  scale per block of ``BLOCK[codec]`` values. int4's blocks are 16 values (6 bits a value on the wire, still
  27% under int8): its 15 levels are coarse, and a smaller block's absmax sits closer to its values (a tiny
  Llama's final loss, 3 seeds: 4.5% over the uncompressed run's in blocks of 32, 2.3% in blocks of 16;
  benchmarks/convergence.py). int4's backward gradients round stochastically (``STOCHASTIC``: unbiased,
  where round to nearest zeroes every value under absmax / 14).

Encoding and decoding on a GPU are memory bound: priced as ``PASSES`` reads and writes of the tensor at the
device's memory bandwidth each, one per eager torch op the runtime runs (``planner.runtime.wire.codecs``: absmax,
scale, round, clamp, cast and pack; decoding unpack, cast and scale). On a CPU (one thread per rank) the eager
ops run far below memory bandwidth and each call pays a fixed dispatch cost: ``CPU_FIT`` holds, per codec,
direction and op, that fixed cost in the device's ``op_overhead_ms`` and the per-byte cost as passes at its
``mem_bw_bytes_per_s`` (fitted by benchmarks/codec_timing.py on the profiled VM: within 0.7-1.4x from 4K to
256K fp32 values; at 1M values, the eager temporaries out of cache, 1.2-6x slower than it).

Errors: ``REL_ERROR[codec]`` bounds the decoded tensor's elementwise error relative to its block's absmax in
either direction, ``rel_error(codec, direction)`` in one; verifiers widen their fences by it.
"""
from __future__ import annotations

import math

from cost_models import comm
from cost_models.cluster import Link
from planner.errors import InvalidInputError

CODECS: tuple[str, ...] = ("none", "fp8", "int8", "int4")
COMPRESS_CHOICES: tuple[str, ...] = ("none", "auto", "fp8", "int8", "int4")
BLOCK = {"fp8": 128, "int8": 128, "int4": 16}
BITS = {"fp8": 8, "int8": 8, "int4": 4}
SCALE_BYTES = 4
PASSES = {"encode": 6, "decode": 3}
# (codec, direction) pairs rounded stochastically (unbiased; up to a whole step off): int4's backward gradients.
STOCHASTIC = frozenset({("int4", "B")})
# Elementwise error over the block's absmax, either direction: half a quantisation step (int; a whole one where
# stochastic), half an ulp at the top of e4m3's / e5m2's mantissa (fp8: 3 / 2 mantissa bits, e5m2 the coarser).
REL_ERROR = {"none": 0.0, "fp8": 2.0 ** -3, "int8": 0.5 / 127, "int4": 1.0 / 7}


def rel_error(codec: str, direction: str) -> float:
    """``REL_ERROR`` for one direction ("F" activations, "B" gradients): round to nearest errs by half a step."""
    if codec == "int4" and (codec, direction) not in STOCHASTIC:
        return 0.5 / 7
    return REL_ERROR[codec]


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
    # int4: an odd count pads a nibble
    return math.ceil(n * BITS[codec] / 8) + SCALE_BYTES * math.ceil(n / BLOCK[codec])


def codec_ms(codec: str, nbytes: float, mem_bw_bytes_per_s: float, op: str, *, op_overhead_ms: float = 0.0,
             kind: str = "gpu", direction: str = "F") -> float:
    """Time to encode (``op="encode"``) or decode a tensor of ``nbytes`` (fp32-sized values) on a device of that
    memory bandwidth and per-op overhead: ``PASSES`` at memory bandwidth (a GPU), the fit ``CPU_FIT`` (a CPU)."""
    if codec == "none":
        return 0.0
    if kind != "cpu":
        return 1e3 * PASSES[op] * 2 * nbytes / mem_bw_bytes_per_s
    overheads, passes = CPU_FIT[(codec, direction, op)]
    return overheads * op_overhead_ms + 1e3 * passes * 2 * nbytes / mem_bw_bytes_per_s


# (codec, direction, op) -> (fixed cost in op_overhead_ms, passes at mem_bw) on a CPU, one thread. Fitted
# 2026-12-05 on the VM of tests/fixtures/profile_cpu.json (op_overhead_ms 0.034, 32 GB/s): ~20 eager ops a call
# dispatch in about one profiled (autograd) op's time; e4m3's casts cost 5x e5m2's; the stochastic encode's hash
# 4x a rounding.
CPU_FIT = {
    ("fp8", "F", "encode"): (1.0, 24.0), ("fp8", "B", "encode"): (1.0, 20.0),
    ("fp8", "F", "decode"): (0.35, 19.0), ("fp8", "B", "decode"): (0.35, 4.0),
    ("int8", "F", "encode"): (1.1, 20.0), ("int8", "B", "encode"): (1.1, 20.0),
    ("int8", "F", "decode"): (0.35, 2.0), ("int8", "B", "decode"): (0.35, 2.0),
    ("int4", "F", "encode"): (1.4, 35.0), ("int4", "B", "encode"): (1.7, 79.0),
    ("int4", "F", "decode"): (0.7, 5.0), ("int4", "B", "decode"): (0.7, 5.0),
}


# --- a replicated stage's gradient all-reduce ---------------------------------------------------------------
ALLREDUCE_CODECS: tuple[str, ...] = ("none", "int8", "powersgd")   # least lossy first
POWERSGD_RANK = 4
POWERSGD_STATE_BYTES_PER_PARAM = 4   # the error-feedback buffer: one fp32 gradient copy (the Q's are small)
# The IR has no parameter shapes (a block has its parameter count and names): every tensor of a block is taken
# to hold the block's mean count, as a square matrix; tensors under this many values (LayerNorms, biases: the
# 1-D ones the runtime sends whole) and ones the rank would not shrink go uncompressed.
POWERSGD_MIN_VALUES = 4096
POWERSGD_ALLREDUCES = 2   # P, then Q: two rounds, twice the ring's latency
# Power iteration and orthogonalisation: 4 m n r FLOPs per matrix (P = M Q, Q = M^T P), Gram-Schmidt 2 m r^2,
# and the error-feedback add and subtract: passes over the gradient at memory bandwidth.
POWERSGD_GRAD_PASSES = 4


def powersgd_tensor_values(n: float, rank: int = POWERSGD_RANK) -> float:
    """fp32 values a tensor of ``n`` values sends under PowerSGD: ``rank * 2 sqrt(n)`` (``P`` and ``Q`` of a
    square matrix), or ``n`` itself when small or when the rank would not shrink it."""
    if n < POWERSGD_MIN_VALUES:
        return n
    return min(n, rank * 2.0 * math.sqrt(n))


def powersgd_bytes(params: float, tensors: float, rank: int = POWERSGD_RANK) -> float:
    """Bytes (fp32) a stage of ``params`` parameters in ``tensors`` tensors all-reduces under PowerSGD, each
    tensor approximated as square with the mean count (``POWERSGD_MIN_VALUES``; within 2x of the true bytes on
    GPT shapes: tests/unit/test_grad_codecs.py)."""
    if params <= 0:
        return 0.0
    t = max(1.0, float(tensors))
    return 4.0 * t * powersgd_tensor_values(params / t, rank)


def powersgd_flops(params: float, tensors: float, rank: int = POWERSGD_RANK) -> float:
    """FLOPs of one PowerSGD round on a stage (the square approximation of :func:`powersgd_bytes`)."""
    if params <= 0:
        return 0.0
    t = max(1.0, float(tensors))
    n = params / t
    if powersgd_tensor_values(n, rank) >= n:
        return 0.0
    side = math.sqrt(n)
    return t * (4.0 * n * rank + 2.0 * side * rank * rank)


def powersgd_compute_ms(params: float, tensors: float, flops_per_s: float, mem_bw_bytes_per_s: float,
                        rank: int = POWERSGD_RANK) -> float:
    """Time one replica spends compressing and decompressing its stage's gradients: the matrix products at
    ``flops_per_s`` (a device's effective rate) plus the error-feedback passes over the fp32 gradient."""
    if params <= 0:
        return 0.0
    flops_ms = 1e3 * powersgd_flops(params, tensors, rank) / flops_per_s
    return flops_ms + 1e3 * POWERSGD_GRAD_PASSES * 2 * 4.0 * params / mem_bw_bytes_per_s


def powersgd_allreduce_ms(params: float, tensors: float, links: tuple[Link, ...], replicas: int, flops_per_s: float,
                          mem_bw_bytes_per_s: float, rank: int = POWERSGD_RANK) -> float:
    """A ring of ``replicas`` over ``links`` (``cost_models.cluster.Link``) all-reducing a stage's gradients
    under PowerSGD: the compressed bytes, the ring latency once more (P then Q), and the slowest replica's
    compression (``flops_per_s``/``mem_bw_bytes_per_s``: its effective fp32 rate and memory bandwidth)."""
    if replicas < 2 or params <= 0:
        return 0.0
    wire = comm.allreduce_ms(powersgd_bytes(params, tensors, rank), links, replicas)
    extra_latency = (POWERSGD_ALLREDUCES - 1) * 2.0 * (replicas - 1) * max(lk.latency_ms for lk in links)
    return wire + extra_latency + powersgd_compute_ms(params, tensors, flops_per_s, mem_bw_bytes_per_s, rank)


# int8: each replica sends its blockwise-int8 gradient (plus the residual it kept, error feedback) to every other
# replica in an all-gather, and every replica decodes and sums them all (a summed int8 would overflow).
INT8_ALLREDUCE_STATE_BYTES_PER_PARAM = 4   # the error-feedback buffer: one fp32 gradient copy
ALLREDUCE_STATE_BYTES_PER_PARAM = {"none": 0, "int8": INT8_ALLREDUCE_STATE_BYTES_PER_PARAM,
                                   "powersgd": POWERSGD_STATE_BYTES_PER_PARAM}
# Beyond the codec's own passes: the residual added and kept (2), and each other replica's decoded part summed.
INT8_ALLREDUCE_EF_PASSES = 2


def int8_payload_bytes(params: float) -> float:
    """Bytes one replica's int8 contribution of ``params`` fp32 gradients travels as (codes and block scales)."""
    return wire_bytes("int8", 4.0 * params, 4) if params > 0 else 0.0


def int8_allreduce_bytes(params: float, replicas: int) -> float:
    """Bytes each replica receives in the all-gather: every other replica's payload (a ring all-reduce of fp32
    receives ``2 (r-1)/r * 4 params``; the all-gather is cheaper below 8 replicas)."""
    return max(0, replicas - 1) * int8_payload_bytes(params)


def int8_allreduce_compute_ms(params: float, replicas: int, mem_bw_bytes_per_s: float) -> float:
    """One replica's encode, its ``replicas`` decodes, the error-feedback passes and the sum, memory bound."""
    nbytes = 4.0 * params
    passes_ms = 1e3 * (INT8_ALLREDUCE_EF_PASSES + replicas - 1) * 2 * nbytes / mem_bw_bytes_per_s
    return (codec_ms("int8", nbytes, mem_bw_bytes_per_s, "encode")
            + replicas * codec_ms("int8", nbytes, mem_bw_bytes_per_s, "decode") + passes_ms)


def int8_allreduce_ms(params: float, links: tuple[Link, ...], replicas: int, mem_bw_bytes_per_s: float) -> float:
    """A ring all-gather of every replica's int8 payload over ``links``: ``r - 1`` steps, each moving one
    payload over every link at once (the slowest link and largest latency pace them), plus the slowest
    replica's (``mem_bw_bytes_per_s``) encoding, decoding and summing."""
    if replicas < 2 or params <= 0:
        return 0.0
    if not links:
        raise InvalidInputError("all-gather links", expected=f"the links of the {replicas}-device ring", found="none")
    slowest_bps = min(lk.bytes_per_s for lk in links)
    latency_ms = max(lk.latency_ms for lk in links)
    wire = 1e3 * int8_allreduce_bytes(params, replicas) / slowest_bps + (replicas - 1) * latency_ms
    return wire + int8_allreduce_compute_ms(params, replicas, mem_bw_bytes_per_s)
