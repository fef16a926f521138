"""Mixed precision as the plan asks (``config.dtype``): autocast compute, fp32 master weights, loss scaling.

The stage modules keep their parameters, gradients and optimizer state in float32 (the master copy);
forwards run under ``torch.autocast`` in the plan's compute dtype, and the tensors that cross a stage
boundary (activations forward, their gradients back) travel in that dtype, as the cost model prices
them. float16 has too little range for small gradients, so its loss is scaled (``LossScaler``): the
last stage multiplies the loss, every stage divides its gradients back before the optimizer, and a
step whose gradients overflowed on any rank is skipped on every rank with a smaller scale.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from planner.errors import InvalidInputError

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class Precision:
    """The compute dtype of a run (float32: no autocast, no casts)."""

    dtype: torch.dtype = torch.float32

    @classmethod
    def of(cls, name: str) -> "Precision":
        if name not in _TORCH_DTYPES:
            raise InvalidInputError("plan compute dtype", expected=" or ".join(_TORCH_DTYPES), found=repr(name),
                                    fix="regenerate the plan with stagewise plan --dtype bf16|fp16|fp32")
        return cls(_TORCH_DTYPES[name])

    @property
    def mixed(self) -> bool:
        return self.dtype != torch.float32

    @property
    def scaled(self) -> bool:
        return self.dtype == torch.float16

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.dtype)

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a boundary value of traced ``dtype`` travels in (integers unchanged)."""
        return self.dtype if self.mixed and dtype.is_floating_point else dtype

    def to_wire(self, values: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Boundary outputs cast to the compute dtype (differentiably: their gradients come back in it)."""
        return tuple(v.to(self.wire_dtype(v.dtype)) if isinstance(v, torch.Tensor) else v for v in values)


@dataclass(slots=True)
class LossScaler:
    """Dynamic loss scaling (as ``torch.amp.GradScaler`` does it, agreed across the ranks of a pipeline)."""

    scale: float = 2.0 ** 16
    growth_interval: int = 2000
    good_steps: int = 0
    skipped: int = 0

    def unscale(self, params: Sequence[torch.nn.Parameter]) -> bool:
        """Divide the gradients by the scale; True when any is not finite on this rank."""
        bad = False
        for p in params:
            if p.grad is not None:
                p.grad.div_(self.scale)
                bad = bad or not bool(torch.isfinite(p.grad).all())
        return bad

    def update(self, overflow: bool) -> None:
        """After every rank's verdict: halve on overflow (the step is skipped), double after a clean run."""
        if overflow:
            self.scale = max(self.scale / 2.0, 1.0)
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale = min(self.scale * 2.0, 2.0 ** 24)
            self.good_steps = 0

    def state(self) -> dict[str, float | int]:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def restore(self, state: dict) -> None:
        scale = state.get("scale")
        if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale < 1.0:
            raise InvalidInputError("checkpoint loss scale", expected="a finite number >= 1", found=repr(scale),
                                    fix="resume from another checkpoint")
        self.scale = float(scale)
        self.good_steps = int(state.get("good_steps", 0))
        self.skipped = int(state.get("skipped", 0))

