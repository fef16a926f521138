"""The device's raw throughput: matmul FLOP/s, memory bandwidth, and the fixed cost of an optimizer kernel."""
from __future__ import annotations

from typing import Any

from cost_models.training import OPTIM_OPS_PER_TENSOR
from planner.profiling.clocks import Clock, Statistic, best_ms


def measure_matmul_flops(dtype: str, *, size: int, repeats: int, device: Any, clock: Clock = "wall") -> float:
    """Achieved FLOP/s of ``size x size`` matmuls in ``dtype`` (2 n^3 flops each)."""
    import torch
    tdtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(device=device, dtype=tdtype)
    b = torch.randn(size, size, generator=gen).to(device=device, dtype=tdtype)
    ms = best_ms(lambda: torch.mm(a, b), device, repeats, clock=clock)
    return 2.0 * size**3 / (ms / 1e3)


def measure_memory_bandwidth(*, nbytes: int, repeats: int, device: Any, clock: Clock = "wall") -> float:
    """Bytes/s of a large copy, counting the bytes read and the bytes written."""
    import torch
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms = best_ms(lambda: dst.copy_(src), device, repeats, clock=clock)
    return 2.0 * src.numel() * 4 / (ms / 1e3)


# Tensors of the optimizer probe: enough that the per-tensor loop dominates, small enough that
# their bytes (64 floats each) cost nothing; Adam's cost per tensor is flat in their count, so the
# per-kernel figure does not depend on it (tuning history: benchmarks/README.md).
OPTIM_PROBE_TENSORS = 128


def measure_optimizer_op_ms(*, repeats: int, device: Any, clock: Clock = "wall", statistic: Statistic = "min",
                            tensors: int = OPTIM_PROBE_TENSORS) -> float:
    """Time per element-wise kernel of ``torch.optim.Adam``'s step (its default implementation on
    ``device``), from steps over ``tensors`` tiny parameters: the fixed cost that
    ``cost_models.optim.optim_ms`` charges per kernel of every parameter tensor."""
    import torch
    params = [torch.nn.Parameter(torch.zeros(64, device=device)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.Adam(params, lr=1e-3)
    ms = best_ms(opt.step, device, repeats, warmup=2, clock=clock, statistic=statistic)
    return ms / (tensors * OPTIM_OPS_PER_TENSOR["adam"])
