"""Rehearse a heterogeneous plan on one machine: pad each rank's compute to its device's speed.

Choice of scale: the *fastest* planned device for a stage maps to this
machine's speed; a rank whose device the cost model says is ``f`` times
slower on its stage sleeps after each forward and backward until the pass has
lasted ``f x`` its CPU time, so its compute takes ``f x`` what it costs this
CPU. The CPU time (one torch thread per rank, so the compute runs on the
calling thread) is what the pass costs here when nothing else runs: time the
rank spent descheduled by other processes is part of the target, not
multiplied by ``f`` (padding by wall time would turn a moment of contention
into ``f`` times as much). With intra-op threads or on a GPU, where a pass
does not run on the calling thread alone, its wall time stands in for its CPU
time. Nothing runs faster than the local hardware (``f >= 1``), and a
homogeneous plan runs unpadded.

The planned devices are told apart by id, not type name: devices profiled on
one machine share a name, and a cluster can scale one copy's efficiency.

``f`` is per stage and per pass, from the same roofline the planner used
(``cost_models.compute.block_fwd_ms``/``block_bwd_ms`` on the stage's blocks), so a
memory-bound stage is scaled by memory bandwidth and a compute-bound one by
FLOP/s. Communication is not emulated: local links are what they are.

A ``slowdown`` above 1 makes even the fastest planned device that much slower
than this machine. On accelerators the host CPU idles while a kernel runs, and
that idle time is where the runtime's own CPU work (posting messages, the
verifier's checks on a stage device's host) overlaps compute; here a rank's
compute holds its core unless padded, so without a slowdown that work can
only add to the step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from cost_models.cluster_file import parse_cluster
from cost_models.compute import block_bwd_ms, block_fwd_ms
from cost_models.devices import DeviceSpec
from planner.errors import InvalidInputError
from planner.plan import Plan
from planner.plan_values import StageInfo


@dataclass(frozen=True, slots=True, kw_only=True)
class Emulation:
    """Slow-down factors of one rank: its compute takes ``factor x`` the local time. ``device_type`` is
    the rank's planned device type, ``reference_device`` the id of the fastest planned device for its stage."""

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

    def pad(self, op: str, elapsed_s: float, cpu_s: float | None = None) -> float:
        """Sleep so that a pass of ``cpu_s`` CPU seconds (default: ``elapsed_s``), which took ``elapsed_s``
        wall seconds, lasts ``factor x cpu_s`` in all; return the seconds slept."""
        factor = self.fwd_factor if op == "F" else self.bwd_factor
        work_s = elapsed_s if cpu_s is None else cpu_s
        extra = factor * work_s - elapsed_s
        if extra <= 0:
            return 0.0
        time.sleep(extra)
        return extra


def stage_ms(stage: "StageInfo", spec: "DeviceSpec", dtype: str) -> tuple[float, float]:
    """(forward, backward) ms of one microbatch of ``stage`` on ``spec``: the planner's own block costs
    (a recomputing stage's backward runs its forward again)."""
    fwd = sum(block_fwd_ms(b, spec, dtype) for b in stage.blocks)
    return fwd, sum(block_bwd_ms(b, spec, dtype) for b in stage.blocks) + (fwd if stage.recompute else 0.0)


def emulation_for(plan: "Plan", rank: int, *, slowdown: float = 1.0) -> Emulation:
    """The padding of ``rank``: its stage's time on its device over the time on the fastest planned device,
    times ``slowdown`` (see the module docstring)."""

    info = plan.ranks[rank]
    if info.stage is None:
        return Emulation(device_type=info.device_type)
    cluster = parse_cluster(plan.cluster)
    stage = plan.stages[info.stage]
    dtype = plan.config.dtype
    # Keyed by device id, not type name: devices profiled on one machine share a name but may differ
    # (a cluster entry can override one device's efficiency), and keying by name would merge them.
    planned = {r.device: cluster.device(r.device).spec for r in plan.ranks if r.stage is not None}
    by_spec = {spec: stage_ms(stage, spec, dtype) for spec in set(planned.values())}
    times = {device: by_spec[spec] for device, spec in planned.items()}
    reference = min(times, key=lambda device: sum(times[device]))
    own_fwd, own_bwd = times[info.device]
    ref_fwd, ref_bwd = times[reference]
    return Emulation(fwd_factor=slowdown * max(1.0, own_fwd / ref_fwd) if ref_fwd > 0 else slowdown,
                     bwd_factor=slowdown * max(1.0, own_bwd / ref_bwd) if ref_bwd > 0 else slowdown,
                     device_type=info.device_type, reference_device=reference)
