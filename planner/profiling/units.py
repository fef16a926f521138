"""Forward and backward time of a model's top-level units, each run alone on the inputs it saw in a full pass."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from planner.profiling.clocks import Clock, Statistic, clock_reader, summarize_ms, sync


@dataclass(frozen=True, slots=True, kw_only=True)
class UnitTiming:
    """Forward and backward time of one top-level unit (the settings' statistic of the repeats), in ms."""

    name: str
    fwd_ms: float
    bwd_ms: float


def _top_level_units(module: Any) -> dict[Any, str]:
    """``embed``/``stem``, ``layers.i``, ``head``...: children, with ModuleLists expanded."""
    import torch.nn as nn
    units: dict[Any, str] = {}
    for name, child in module.named_children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)):
            for sub_name, sub in child.named_children():
                units[sub] = f"{name}.{sub_name}"
        else:
            units[child] = name
    return units


def _capture_unit_inputs(module: Any, inputs: Sequence[Any]) -> list[tuple[str, Any, tuple, dict]]:
    """Run the model once and record each top-level unit's call (outermost calls only), in order."""
    import torch
    units = _top_level_units(module)
    calls: list[tuple[str, Any, tuple, dict]] = []
    depth = [0]
    handles = []

    def pre(mod: Any, args: tuple, kwargs: dict) -> None:
        if depth[0] == 0:
            calls.append((units[mod], mod, args, kwargs))
        depth[0] += 1

    def post(mod: Any, args: tuple, kwargs: dict, out: Any) -> None:
        depth[0] -= 1

    for unit in units:
        handles.append(unit.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(unit.register_forward_hook(post, with_kwargs=True))
    try:
        with torch.no_grad():
            module(*inputs)
    finally:
        for h in handles:
            h.remove()
    return calls


def _fresh(value: Any) -> Any:
    """A detached copy; floating tensors require grad so the unit's input gradient is timed too."""
    import torch
    if isinstance(value, torch.Tensor):
        copy = value.detach().clone()
        return copy.requires_grad_(True) if copy.is_floating_point() else copy
    return value


def _sweeper(evict_bytes: int, device: Any) -> Callable[[], None]:
    """A sweep (read and write) over ``evict_bytes`` of ``device`` memory: run before a timed pass, it leaves
    the caches as a run does, where other ranks, messages and the optimizer pass through them between two
    passes of a stage. ``0``: no sweep."""
    if evict_bytes <= 0:
        return lambda: None
    import torch
    scratch = torch.ones(max(evict_bytes // 4, 1), dtype=torch.float32, device=device)

    def sweep() -> None:
        scratch.mul_(1.0)
        sync(device)

    return sweep


def time_units(module: Any, inputs: Sequence[Any], *, repeats: int, device: Any, warmup: int = 1,
               clock: Clock = "wall", statistic: Statistic = "min", evict_bytes: int = 0) -> tuple[UnitTiming, ...]:
    """Forward and backward ms (``statistic`` of the repeats) of every top-level unit, run alone on
    its captured inputs; with ``evict_bytes``, each timed forward and backward right after an untimed
    cache sweep over that many bytes (:data:`planner.profiling.profile.EVICT_BYTES`)."""
    import torch
    now = clock_reader(clock)
    sweep = _sweeper(evict_bytes, device)
    module.train()
    results = []
    for name, unit, args, kwargs in _capture_unit_inputs(module, inputs):
        args = tuple(_fresh(a) for a in args)
        kwargs = {k: _fresh(v) for k, v in kwargs.items()}
        fwd, bwd = [], []
        grad = None
        for i in range(warmup + repeats):
            sweep()
            sync(device)
            t0 = now()
            out = unit(*args, **kwargs)
            sync(device)
            t1 = now()
            if grad is None:
                gen = torch.Generator().manual_seed(1)
                grad = torch.randn(out.shape, generator=gen, dtype=out.dtype).to(out.device)
            sweep()
            sync(device)
            t1_bwd = now()
            torch.autograd.backward(out, grad)
            sync(device)
            t2 = now()
            unit.zero_grad(set_to_none=True)
            for a in args:
                if isinstance(a, torch.Tensor):
                    a.grad = None
            if i >= warmup:
                fwd.append((t1 - t0) * 1e3)
                bwd.append((t2 - t1_bwd) * 1e3)
        results.append(UnitTiming(name=name, fwd_ms=summarize_ms(fwd, statistic),
                                  bwd_ms=summarize_ms(bwd, statistic)))
    return tuple(results)
