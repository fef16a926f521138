"""Rehearse a heterogeneous plan on one machine: pad each rank's compute to its device's speed.

Choice of scale: the *fastest* planned device for a stage maps to this
machine's speed; a rank whose device the cost model says is ``f`` times
slower on its stage sleeps ``(f - 1) x`` the measured compute time after each
forward and backward, so its compute takes ``f x`` the local time. Nothing runs
faster than the local hardware (``f >= 1``), and a homogeneous plan runs
unpadded.

``f`` is per stage and per pass, from the same roofline the planner used
(``cost_models.compute.block_fwd_ms``/``block_bwd_ms`` on the stage's blocks), so a
memory-bound stage is scaled by memory bandwidth and a compute-bound one by
FLOP/s. Communication is not emulated: local links are what they are.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner.errors import InvalidInputError

if TYPE_CHECKING:
    from cost_models.devices import DeviceSpec
    from planner.plan import Plan, StageInfo


@dataclass(frozen=True, slots=True, kw_only=True)
class Emulation:
    """Slow-down factors of one rank: its compute takes ``factor x`` the local time."""

    fwd_factor: float = 1.0
    bwd_factor: float = 1.0
    device_type: str = ""
    reference_device: str = ""

    def __post_init__(self) -> None:
        if self.fwd_factor < 1.0 or self.bwd_factor < 1.0:
            raise InvalidInputError("emulation factors", expected=">= 1 (nothing runs faster than this machine)",
                                    found=f"{self.fwd_factor}, {self.bwd_factor}")

    @property
    def active(self) -> bool:
        return self.fwd_factor > 1.0 or self.bwd_factor > 1.0

    def pad(self, op: str, elapsed_s: float) -> float:
        """Sleep so that ``elapsed_s`` of compute lasts ``factor x`` as long; return the seconds slept."""
        factor = self.fwd_factor if op == "F" else self.bwd_factor
        extra = (factor - 1.0) * elapsed_s
        if extra > 0:
            time.sleep(extra)
        return extra


def stage_ms(stage: "StageInfo", spec: "DeviceSpec", dtype: str) -> tuple[float, float]:
    """(forward, backward) ms of one microbatch of ``stage`` on ``spec``: the planner's own block costs."""
    from cost_models.compute import block_bwd_ms, block_fwd_ms

    return (sum(block_fwd_ms(b, spec, dtype) for b in stage.blocks),
            sum(block_bwd_ms(b, spec, dtype) for b in stage.blocks))


def emulation_for(plan: "Plan", rank: int) -> Emulation:
    """The padding of ``rank``: its stage's time on its device over the time on the fastest planned device."""
    from cost_models.cluster import ClusterSpec

    info = plan.ranks[rank]
    if info.stage is None:
        return Emulation(device_type=info.device_type)
    cluster = ClusterSpec.from_dict(plan.cluster)
    stage = plan.stages[info.stage]
    dtype = plan.config.dtype
    planned = {r.device_type: cluster.device(r.device).spec for r in plan.ranks if r.stage is not None}
    times = {name: stage_ms(stage, spec, dtype) for name, spec in planned.items()}
    reference = min(times, key=lambda name: sum(times[name]))
    own_fwd, own_bwd = times[info.device_type]
    ref_fwd, ref_bwd = times[reference]
    return Emulation(fwd_factor=max(1.0, own_fwd / ref_fwd) if ref_fwd > 0 else 1.0,
                     bwd_factor=max(1.0, own_bwd / ref_bwd) if ref_bwd > 0 else 1.0,
                     device_type=info.device_type, reference_device=reference)
