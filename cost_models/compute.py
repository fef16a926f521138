"""Compute time of blocks on a device: a roofline plus a per-op overhead. Pure functions.

``fwd_ms = max(fwd_flops / (peak(dtype) * efficiency), traffic / mem_bw) + n_ops * op_overhead_ms``

The backward pass reads the saved activations and writes both input and
weight gradients, so it moves about twice the forward's bytes
(:data:`BWD_TRAFFIC_FACTOR`); its FLOPs come from the trace (``bwd_flops``).
It dispatches only a little more ops than the forward (:data:`BWD_OPS_FACTOR`):
views need no backward kernel and autograd fuses the backward of several
elementwise ops (fitted to GPT and Llama layers: benchmarks/README.md).
``profile.py`` fits ``efficiency`` and ``op_overhead_ms`` with exactly these
formulas, so a calibrated spec reproduces the measured block times.

Block figures are per microbatch at the dtype the chain was traced in
(``trace_dtype``, float32 unless told); memory traffic scales with the bytes
per element of the compute ``dtype``.
"""
from __future__ import annotations

from cost_models.devices import DeviceSpec
from planner.errors import InvalidInputError
from planner.ir import Block, BlockChain, dtype_bytes

BWD_TRAFFIC_FACTOR = 2.0
BWD_OPS_FACTOR = 1.2


def roofline_ms(flops: float, traffic_bytes: float, n_ops: float, spec: DeviceSpec, dtype: str) -> float:
    """Time of work with ``flops`` and ``traffic_bytes`` split over ``n_ops`` ops on ``spec``."""
    if flops < 0 or traffic_bytes < 0 or n_ops < 0:
        raise InvalidInputError("roofline inputs", expected="flops, bytes and op count >= 0",
                                found=f"{flops}, {traffic_bytes}, {n_ops}")
    compute_ms = 1e3 * flops / spec.effective_flops_per_s(dtype)
    memory_ms = 1e3 * traffic_bytes / spec.mem_bw_bytes_per_s
    return max(compute_ms, memory_ms) + n_ops * spec.op_overhead_ms


def _traffic_scale(dtype: str, trace_dtype: str) -> float:
    return dtype_bytes(dtype) / dtype_bytes(trace_dtype)


def block_fwd_ms(block: Block, spec: DeviceSpec, dtype: str = "float32", *,
                 trace_dtype: str = "float32") -> float:
    """Forward time of one microbatch through ``block`` on ``spec``."""
    traffic = block.mem_traffic_bytes * _traffic_scale(dtype, trace_dtype)
    return roofline_ms(block.fwd_flops, traffic, len(block.node_names), spec, dtype)


def block_bwd_ms(block: Block, spec: DeviceSpec, dtype: str = "float32", *,
                 trace_dtype: str = "float32") -> float:
    """Backward time of one microbatch through ``block`` on ``spec``."""
    traffic = BWD_TRAFFIC_FACTOR * block.mem_traffic_bytes * _traffic_scale(dtype, trace_dtype)
    return roofline_ms(block.bwd_flops, traffic, BWD_OPS_FACTOR * len(block.node_names), spec, dtype)


def check_block_range(chain: BlockChain, lo: int, hi: int) -> None:
    """Raise unless ``lo..hi`` (inclusive) is a non-empty range of ``chain``'s blocks."""
    if not 0 <= lo <= hi < len(chain.blocks):
        raise InvalidInputError(f"block range of {chain.model_name}",
                                expected=f"0 <= lo <= hi < {len(chain.blocks)}", found=f"{lo}..{hi}",
                                fix="a stage covers blocks first..last of the chain it was solved for")


def range_fwd_ms(chain: BlockChain, lo: int, hi: int, spec: DeviceSpec, dtype: str = "float32", *,
                 trace_dtype: str = "float32") -> float:
    """Forward time of blocks ``lo..hi`` (inclusive) for one microbatch."""
    check_block_range(chain, lo, hi)
    return sum(block_fwd_ms(b, spec, dtype, trace_dtype=trace_dtype) for b in chain.blocks[lo:hi + 1])


def range_bwd_ms(chain: BlockChain, lo: int, hi: int, spec: DeviceSpec, dtype: str = "float32", *,
                 trace_dtype: str = "float32") -> float:
    """Backward time of blocks ``lo..hi`` (inclusive) for one microbatch."""
    check_block_range(chain, lo, hi)
    return sum(block_bwd_ms(b, spec, dtype, trace_dtype=trace_dtype) for b in chain.blocks[lo:hi + 1])


def block_times_ms(chain: BlockChain, spec: DeviceSpec, dtype: str = "float32", *,
                   trace_dtype: str = "float32") -> tuple[tuple[float, float], ...]:
    """``(fwd_ms, bwd_ms)`` of every block, for building prefix sums per device type."""
    return tuple((block_fwd_ms(b, spec, dtype, trace_dtype=trace_dtype),
                  block_bwd_ms(b, spec, dtype, trace_dtype=trace_dtype)) for b in chain.blocks)
