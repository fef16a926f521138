"""Time of one optimizer step on a device. Pure functions."""
from __future__ import annotations

from cost_models import memory
from cost_models.devices import DeviceSpec
from cost_models.training import OPTIM_OPS_PER_TENSOR, TrainingConfig


def traffic_bytes_per_param(config: TrainingConfig) -> int:
    """Bytes a step moves per parameter: read and write weights and optimizer state, read gradients."""
    per = memory.bytes_per_param(config)
    return 2 * per.weights + per.grads + 2 * per.optimizer


def step_ms(param_count: int, traffic_per_param: int, kernels: int, spec: DeviceSpec) -> float:
    """A memory-bound pass over the state plus ``kernels`` launches at the device's measured ``optim_op_ms``
    (without one, its ``op_overhead_ms``)."""
    op_ms = spec.op_overhead_ms if spec.optim_op_ms is None else spec.optim_op_ms
    return 1e3 * param_count * traffic_per_param / spec.mem_bw_bytes_per_s + kernels * op_ms


def optim_ms(param_count: int, config: TrainingConfig, spec: DeviceSpec, *, param_tensors: int = 0) -> float:
    """One optimizer step over ``param_count`` parameters in ``param_tensors`` tensors, each tensor costing
    ``cost_models.training.OPTIM_OPS_PER_TENSOR`` kernels."""
    kernels = param_tensors * OPTIM_OPS_PER_TENSOR.get(config.optimizer, 1)
    return step_ms(param_count, traffic_bytes_per_param(config), kernels, spec)
