"""Memory of a pipeline stage on one device. Pure functions.

Per trainable parameter (``bytes_per_param``), with ``w`` the bytes of the
compute dtype (4 for float32, 2 for bfloat16/float16):

====================  =======  =====  ==================================  =====
config                weights  grads  optimizer state                     total
====================  =======  =====  ==================================  =====
fp32, Adam or AdamW   4        4      8  (two fp32 moments)               16
fp32, SGD             4        4      0  (4 with momentum)                8/12
mixed bf16, Adam      2        2      12 (fp32 master 4 + two moments 8)  16
mixed bf16, SGD       2        2      4  (fp32 master; +4 momentum)       8/12
pure bf16, Adam       2        2      4  (two bf16 moments)               8
====================  =======  =====  ==================================  =====

``mixed_precision`` with a float32 compute dtype is plain fp32 (no master copy
is needed). Saved activations are the chain's ``saved_act_bytes`` per
microbatch (scaled from the traced microbatch size and dtype to the
configured ones) times the microbatches in flight on the stage: GPipe keeps
all ``M``; 1F1B keeps ``min(M, S - k)`` on 0-based stage ``k``. Communication
buffers hold one microbatch's incoming and outgoing activation and, off the
first stage, the matching gradients.
"""
from __future__ import annotations

from dataclasses import dataclass

from cost_models.compute import check_block_range
from cost_models.devices import DeviceSpec
from cost_models.training import ADAM_LIKE, SCHEDULES, TrainingConfig
from planner.errors import InvalidInputError
from planner.ir import BlockChain, dtype_bytes

# Share of device memory a plan may fill: the rest is the CUDA context, the
# caching allocator's fragmentation and temporaries the trace does not see.
USABLE_MEMORY_FRACTION = 0.9


@dataclass(frozen=True, slots=True, kw_only=True)
class BytesPerParam:
    weights: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryBreakdown:
    """Bytes one device holds for its stage at the peak of a training step."""

    weights_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    buffers_bytes: int

    def __post_init__(self) -> None:
        for name in ("weights_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "buffers_bytes"):
            if getattr(self, name) < 0:
                raise InvalidInputError(f"memory {name}", expected=">= 0", found=str(getattr(self, name)))

    @property
    def total_bytes(self) -> int:
        return (self.weights_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes
                + self.buffers_bytes)

    @property
    def static_bytes(self) -> int:
        """What does not depend on the schedule: weights, gradients, optimizer state."""
        return self.weights_bytes + self.grads_bytes + self.optimizer_bytes

    def to_dict(self) -> dict[str, int]:
        return {"weights_bytes": self.weights_bytes, "grads_bytes": self.grads_bytes,
                "optimizer_bytes": self.optimizer_bytes, "activations_bytes": self.activations_bytes,
                "buffers_bytes": self.buffers_bytes, "total_bytes": self.total_bytes}


def bytes_per_param(config: TrainingConfig, *, sgd_momentum: bool = False) -> BytesPerParam:
    """Weights, gradient and optimizer-state bytes per trainable parameter (see the module table)."""
    w = dtype_bytes(config.dtype)
    low_precision = w < 4
    master = 4 if (config.mixed_precision and low_precision) else 0
    state_elem = 4 if (config.mixed_precision or not low_precision) else w
    moments = 2 if config.optimizer in ADAM_LIKE else (1 if sgd_momentum else 0)
    return BytesPerParam(weights=w, grads=w, optimizer=master + moments * state_elem)


def in_flight_microbatches(schedule: str, num_stages: int, stage_idx: int, num_microbatches: int) -> int:
    """Microbatches whose activations stage ``stage_idx`` holds at once (GPipe: M; 1F1B: min(M, S-k))."""
    if schedule not in SCHEDULES:
        raise InvalidInputError("schedule", expected=" or ".join(SCHEDULES), found=repr(schedule))
    if num_stages < 1 or not 0 <= stage_idx < num_stages or num_microbatches < 1:
        raise InvalidInputError("pipeline shape", expected="S >= 1, 0 <= k < S, M >= 1",
                                found=f"S={num_stages}, k={stage_idx}, M={num_microbatches}")
    if schedule == "gpipe":
        return num_microbatches
    return min(num_microbatches, num_stages - stage_idx)


def trace_dtype(chain: BlockChain) -> str:
    """The dtype the chain was traced in: ``meta['dtype']``, else inferred from parameter bytes."""
    meta = dict(chain.meta)
    if "dtype" in meta:
        return meta["dtype"]
    if chain.param_count:
        per = round(chain.param_bytes / chain.param_count)
        return {2: "bfloat16", 8: "float64"}.get(per, "float32")
    return "float32"


def activation_scale(chain: BlockChain, config: TrainingConfig) -> float:
    """From the traced microbatch and dtype to the configured ones (activations are linear in both)."""
    return (config.microbatch_size / chain.microbatch_size) * (dtype_bytes(config.dtype)
                                                               / dtype_bytes(trace_dtype(chain)))


def stage_param_count(chain: BlockChain, lo: int, hi: int) -> int:
    """Trainable parameters a stage over blocks ``lo..hi`` holds.

    A tied parameter is counted in the first block that reads it; a stage that
    reads it without holding that block keeps its own copy (and gradient).
    """
    check_block_range(chain, lo, hi)
    count = sum(b.param_count for b in chain.blocks[lo:hi + 1])
    elem = dtype_bytes(trace_dtype(chain))
    for tied in chain.tied_params:
        uses = [i for i in tied.blocks if lo <= i <= hi]
        if uses and not lo <= min(tied.blocks) <= hi:
            count += tied.nbytes // elem
    return count


def stage_comm_buffer_bytes(chain: BlockChain, lo: int, hi: int, config: TrainingConfig) -> int:
    """Receive/send buffers of one microbatch: activations in and out, and their gradients."""
    check_block_range(chain, lo, hi)
    scale = activation_scale(chain, config)
    batch_scale = config.microbatch_size / chain.microbatch_size
    in_act = chain.input_bytes * batch_scale if lo == 0 else chain.blocks[lo - 1].out_bytes * scale
    out_act = chain.blocks[hi].out_bytes * scale if hi < len(chain.blocks) - 1 else 0.0
    in_grad = 0.0 if lo == 0 else in_act  # the first stage sends no gradient back
    return round(in_act + out_act + in_grad + out_act)


def stage_memory(chain: BlockChain, lo: int, hi: int, config: TrainingConfig, in_flight_mb: int,
                 comm_buffer_bytes: int | None = None, *, sgd_momentum: bool = False,
                 recompute: bool = False) -> MemoryBreakdown:
    """Peak memory of a stage over blocks ``lo..hi`` holding ``in_flight_mb`` microbatches' activations.

    ``comm_buffer_bytes`` defaults to :func:`stage_comm_buffer_bytes`. ``recompute``: each block is
    checkpointed, so a microbatch in flight holds only the blocks' inputs, and the block recomputing in
    a backward holds its full activations once.
    """
    if in_flight_mb < 1:
        raise InvalidInputError("in-flight microbatches", expected=">= 1", found=str(in_flight_mb))
    params = stage_param_count(chain, lo, hi)
    per = bytes_per_param(config, sgd_momentum=sgd_momentum)
    scale = activation_scale(chain, config)
    saved = sum(b.saved_act_bytes for b in chain.blocks[lo:hi + 1]) * scale
    peak = 0.0
    if recompute:
        first = chain.input_bytes * config.microbatch_size / chain.microbatch_size if lo == 0 \
            else chain.blocks[lo - 1].out_bytes * scale
        saved = first + sum(b.out_bytes for b in chain.blocks[lo:hi]) * scale
        peak = max(b.saved_act_bytes for b in chain.blocks[lo:hi + 1]) * scale
    buffers = stage_comm_buffer_bytes(chain, lo, hi, config) if comm_buffer_bytes is None else comm_buffer_bytes
    if buffers < 0:
        raise InvalidInputError("comm_buffer_bytes", expected=">= 0", found=str(buffers))
    return MemoryBreakdown(weights_bytes=params * per.weights, grads_bytes=params * per.grads,
                           optimizer_bytes=params * per.optimizer,
                           activations_bytes=round(saved) * in_flight_mb + round(peak), buffers_bytes=int(buffers))


def usable_memory_bytes(spec: DeviceSpec) -> int:
    """Memory a plan may use on a device of this kind (:data:`USABLE_MEMORY_FRACTION` of it)."""
    return int(spec.mem_bytes * USABLE_MEMORY_FRACTION)
