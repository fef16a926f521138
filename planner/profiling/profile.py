"""Measure this machine's device and write a profile JSON (``planner.profiling`` alone times hardware).

What is measured (``profile_device``):

- matmul throughput per dtype (``float32``; ``bfloat16``/``float16`` where the
  device runs them), fastest of a few square matmuls: the profile's "peak" FLOP/s;
- memory bandwidth: a large tensor copy (bytes read + bytes written);
- the fixed cost of an optimizer step's kernels: ``torch.optim.Adam`` stepping
  many tiny tensors (``DeviceSpec.optim_op_ms``, per element-wise kernel);
- the forward and backward time of each top-level unit (``embed``/``stem``,
  ``layers.i``, ``head``) of a model preset built with real weights, each unit
  run alone on the inputs it saw in a full forward pass, each timed pass right
  after an untimed sweep that evicts the caches (``ProfileSettings.evict_bytes``):
  a rank of a run finds its weights cold, not as a tight loop leaves them;
- point-to-point bandwidth and latency between two local processes over
  ``torch.distributed`` (gloo; NCCL with two or more GPUs), by running
  ``python -m planner.runtime.rank.p2p_probe`` twice as subprocesses, and the CPU
  time a message costs the sending and the receiving process
  (:class:`~cost_models.measured.MessageCost`: posting it, and the backend's threads moving its bytes);
- the CPU time the runtime's executor itself costs per message instruction and
  per pass (``MessageCost.executor_ms``/``executor_pass_ms``), by running
  ``python -m planner.profiling.overhead_probe`` (a small 2-rank plan of the
  profiled model on the real runtime) as a subprocess (gloo only);
- a calibration: the ``efficiency`` and per-op ``op_overhead_ms`` with which
  ``cost_models.compute`` (roofline + overhead, with the measured peak and
  bandwidth) best reproduces the measured unit times of the planner's blocks;
- optionally (``sharing``), how fast ``k = 1, 2, ...`` single-thread
  processes that compute at once progress, each relative to one alone
  (:class:`~cost_models.measured.CoreSharing`): what ranks that share this machine's cores get
  (``planner.simulate.simulate(plan, cores=..., sharing=...)``).

The result's ``device`` entry is a :class:`~cost_models.devices.DeviceSpec`
that a cluster file can name as a device ``type`` (by the JSON's path). The
values measured and the fits that make them live in ``cost_models.measured``.

This module settles what to measure (``ProfileSettings``), runs the measurements
in order and writes the document; they live beside it: ``clocks`` (clocks and
repeat statistics), ``throughput`` (matmul, bandwidth, optimizer kernel),
``units`` (the model's units), ``probes`` (p2p and executor, in subprocesses)
and ``sharing`` (core sharing).
"""
from __future__ import annotations

import json
import os
import platform
import socket
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

import psutil

from cost_models.devices import PROFILE_SCHEMA, DeviceSpec
from cost_models.measured import (
    BlockSample,
    Calibration,
    P2PResult,
    fit_calibration,
    with_executor_cost,
)
from models.registry import build_model
from planner.coarsen import coarsen
from planner.errors import InvalidInputError
from planner.outputs import write_atomic
from planner.profiling.clocks import STATISTICS, Clock, Statistic, clock_reader
from planner.profiling.probes import measure_executor, measure_p2p
from planner.profiling.sharing import measure_core_sharing
from planner.profiling.throughput import (
    measure_matmul_flops,
    measure_memory_bandwidth,
    measure_optimizer_op_ms,
)
from planner.profiling.units import UnitTiming, time_units
from planner.trace import trace

Step = Callable[[str], None]
# Swept before each timed pass: past the last-level cache (e.g. a 48 MiB L3), so a pass finds the caches as cold
# as in a run; a tight loop's warm caches, or sweeping only L2, time passes faster than a run does them
# (tuning history: benchmarks/README.md).
EVICT_BYTES = 64 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileSettings:
    """How hard to measure. ``quick`` trades accuracy for a run of seconds.

    ``statistic`` summarises the repeats: ``min`` (the default) is what the device
    can do when nothing disturbs it; ``median`` is what a long run of the same
    work averages on a machine that other processes share, which is what a
    step time made of many passes adds up to.
    """

    model: str = "gpt-small"
    batch: int = 2
    seq: int | None = 64
    matmul_size: int = 1024
    copy_bytes: int = 64 << 20
    repeats: int = 5
    p2p: bool = True
    p2p_sizes: tuple[int, ...] = (1 << 10, 1 << 16, 1 << 20, 1 << 22, 1 << 24, 1 << 26)
    p2p_timeout_s: float = 120.0
    p2p_posts: int = 8  # messages per size and side whose CPU time is measured (MessageCost); 0: none
    # Steps of the executor probe (MessageCost.executor_*: the runtime's own CPU per message and pass, with
    # gloo; after p2p); 0: not measured.
    executor_steps: int = 6
    clock: Clock = "wall"
    statistic: Statistic = "min"
    sharing: bool = False
    sharing_processes: int = 0  # 0: twice the cores
    sharing_window_s: float = 1.5
    sharing_rounds: int = 2
    # Microbatches each sharing worker holds in flight (their forwards, then their backwards), as a
    # pipeline stage does: its saved activations and gradients are what the caches must hold.
    sharing_microbatches: int = 1
    evict_bytes: int = EVICT_BYTES  # untimed cache sweep before each timed unit pass; 0: none (warm, tight loop)

    def __post_init__(self) -> None:
        if self.batch < 1 or self.repeats < 1 or self.matmul_size < 1 or self.copy_bytes < 4 or self.p2p_posts < 0:
            raise InvalidInputError("profile settings", expected="batch, repeats, sizes >= 1, p2p posts >= 0",
                                    found=f"batch={self.batch}, repeats={self.repeats}, p2p_posts={self.p2p_posts}")
        if self.executor_steps < 0 or self.executor_steps == 1:
            raise InvalidInputError("profile executor_steps", expected="0 (not measured) or >= 2 (one warms up)",
                                    found=repr(self.executor_steps))
        if isinstance(self.evict_bytes, bool) or not isinstance(self.evict_bytes, int) or self.evict_bytes < 0:
            raise InvalidInputError("profile evict_bytes", expected="a whole number of bytes >= 0 (0: no sweep)",
                                    found=repr(self.evict_bytes))
        if self.clock not in ("wall", "cpu"):
            raise InvalidInputError("clock", expected="wall or cpu", found=repr(self.clock))
        if (self.sharing_processes < 0 or self.sharing_window_s <= 0 or self.sharing_rounds < 1
                or self.sharing_microbatches < 1):
            raise InvalidInputError("core sharing settings",
                                    expected="processes >= 0, window > 0 s, rounds >= 1, microbatches >= 1",
                                    found=f"{self.sharing_processes}, {self.sharing_window_s}, {self.sharing_rounds}, "
                                          f"{self.sharing_microbatches}")
        if self.statistic not in STATISTICS:
            raise InvalidInputError("profile statistic", expected=" or ".join(STATISTICS),
                                    found=repr(self.statistic))

    @classmethod
    def quick(cls, model: str | None = None) -> "ProfileSettings":
        return cls(model=model or "gpt-tiny", batch=2, seq=32, matmul_size=384, copy_bytes=32 << 20,
                   repeats=3, p2p_sizes=(1 << 10, 1 << 22, 1 << 24), p2p_timeout_s=60.0)



# --- the whole profile -------------------------------------------------------
def model_chain(spec: str, *, batch: int, seq: int | None) -> Any:
    """The planner's BlockChain of a preset at this shape (trace + coarsen on meta: no weights)."""
    bundle = build_model(spec, batch=batch, seq=seq, device="meta")
    return coarsen(trace(bundle.module, bundle.example_inputs, name=spec), granularity="layer")


def pair_samples(chain: Any, timings: Sequence[UnitTiming]) -> tuple[BlockSample, ...]:
    """Measured units beside the planner's blocks of the same names (``embed``, ``layers.i``, ``head``)."""
    by_name = {t.name: t for t in timings}
    samples = tuple(BlockSample(name=b.name, fwd_ms=by_name[b.name].fwd_ms, bwd_ms=by_name[b.name].bwd_ms,
                                fwd_flops=b.fwd_flops, bwd_flops=b.bwd_flops,
                                mem_traffic_bytes=b.mem_traffic_bytes, n_ops=len(b.node_names))
                    for b in chain.blocks if b.name in by_name)
    if not samples:
        raise InvalidInputError(f"blocks of {chain.model_name}", expected="block names matching its top-level modules",
                                found=f"blocks {[b.name for b in chain.blocks][:4]}..., "
                                      f"modules {[t.name for t in timings][:4]}...")
    return samples


def _device_identity(device: Any) -> tuple[str, str, int]:
    import psutil
    import torch
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.name.replace(" ", "-"), "gpu", int(props.total_memory)
    return f"{socket.gethostname()}-cpu", "cpu", int(psutil.virtual_memory().total) or 1 << 30


def profile_device(settings: ProfileSettings, *, step: Step | None = None) -> dict[str, Any]:
    """Measure everything and return the profile document (see the module docstring)."""
    import torch

    say = step or (lambda _msg: None)
    busy_before = psutil.cpu_percent(interval=0.5) / 100  # others' work: a busy machine's timings are not its speed
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name, kind, mem_bytes = _device_identity(device)
    if settings.clock == "cpu" and device.type != "cpu":
        raise InvalidInputError("--clock cpu", expected="a CPU device", found=str(device),
                                fix="use the wall clock on GPUs")
    clock_reader(settings.clock)  # checks the thread count before anything is measured
    say(f"tracing {settings.model}")  # first: a bad model spec fails before any measuring
    chain = model_chain(settings.model, batch=settings.batch, seq=settings.seq)
    matmul, mem_bw = _measure_throughput(settings, device, say)
    say("optimizer step")
    optim_op = measure_optimizer_op_ms(repeats=settings.repeats, device=device, clock=settings.clock,
                                       statistic=settings.statistic)
    say(f"blocks of {settings.model}")
    bundle = build_model(settings.model, batch=settings.batch, seq=settings.seq, device=str(device))
    timings = time_units(bundle.module, bundle.example_inputs, repeats=settings.repeats, device=device,
                         clock=settings.clock, statistic=settings.statistic, evict_bytes=settings.evict_bytes)
    del bundle
    say("calibration")
    samples = pair_samples(chain, timings)
    calib = fit_calibration(samples, peak_flops=matmul["float32"], mem_bw_bytes_per_s=mem_bw)
    p2p = None
    if settings.p2p:
        backend = "nccl" if device.type == "cuda" and torch.cuda.device_count() >= 2 else "gloo"
        say(f"p2p ({backend})")
        p2p = measure_p2p(sizes=settings.p2p_sizes, repeats=settings.repeats, backend=backend,
                          timeout_s=settings.p2p_timeout_s, posts=settings.p2p_posts)
        if p2p.messages is not None and settings.executor_steps and backend == "gloo":
            say("executor (a 2-rank run)")
            report = measure_executor(model=settings.model, batch=settings.batch, seq=settings.seq,
                                      steps=settings.executor_steps, timeout_s=settings.p2p_timeout_s)
            p2p = replace(p2p, messages=with_executor_cost(p2p.messages, report), executor=report)
    sharing = None
    if settings.sharing:
        say("core sharing")
        sharing = measure_core_sharing(model=settings.model, batch=settings.batch, seq=settings.seq,
                                       processes=settings.sharing_processes or 2 * (os.cpu_count() or 1),
                                       window_s=settings.sharing_window_s, rounds=settings.sharing_rounds,
                                       microbatches=settings.sharing_microbatches)
    peaks = {**matmul, "float32": matmul["float32"] * calib.peak_scale}
    spec = DeviceSpec(name=name, kind=kind, peak_flops=tuple(peaks.items()), mem_bytes=mem_bytes,
                      mem_bw_bytes_per_s=mem_bw, efficiency=max(calib.efficiency, 1e-3),
                      op_overhead_ms=calib.op_overhead_ms, optim_op_ms=optim_op, measured=True,
                      source=f"stagewise profile of {platform.node()} on {datetime.now(timezone.utc):%Y-%m-%d}",
                      p2p_bandwidth_gbps=p2p.bandwidth_gbps if p2p else None,
                      p2p_latency_ms=p2p.latency_ms if p2p else None)
    doc = _profile_document(settings, device, spec, samples, calib, p2p, matmul["float32"])
    doc["host"].update(cpus=os.cpu_count() or 1, busy_fraction_before=busy_before)
    doc["sharing"] = None if sharing is None else sharing.to_dict()
    return doc


def _measure_throughput(settings: ProfileSettings, device: Any, say: Step) -> tuple[dict[str, float], float]:
    """Matmul FLOP/s per dtype the device runs, and memory bandwidth (bytes/s)."""
    dtypes = ["float32"] + (["bfloat16", "float16"] if device.type == "cuda" else ["bfloat16"])
    matmul: dict[str, float] = {}
    for dtype in dtypes:
        say(f"matmul {dtype}")
        matmul[dtype] = measure_matmul_flops(dtype, size=settings.matmul_size, repeats=settings.repeats,
                                             device=device, clock=settings.clock)
    say("memory bandwidth")
    mem_bw = measure_memory_bandwidth(nbytes=settings.copy_bytes, repeats=settings.repeats, device=device,
                                      clock=settings.clock)
    return matmul, mem_bw


def _profile_document(settings: ProfileSettings, device: Any, spec: DeviceSpec, samples: Sequence[BlockSample],
                      calib: Calibration, p2p: P2PResult | None, matmul_flops: float) -> dict[str, Any]:
    """The profile JSON (schema :data:`PROFILE_SCHEMA`): the spec, and what it was fitted from."""
    import torch
    return {
        "schema": PROFILE_SCHEMA,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": {"hostname": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
                 "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "device": str(device)},
        "device": spec.to_dict(),
        "settings": {"model": settings.model, "batch": settings.batch, "seq": settings.seq,
                     "matmul_size": settings.matmul_size, "copy_bytes": settings.copy_bytes,
                     "repeats": settings.repeats, "clock": settings.clock, "statistic": settings.statistic,
                     "sharing": settings.sharing, "sharing_microbatches": settings.sharing_microbatches,
                     "evict_bytes": settings.evict_bytes, "executor_steps": settings.executor_steps},
        "blocks": [{"name": s.name, "fwd_ms": s.fwd_ms, "bwd_ms": s.bwd_ms, "fwd_flops": s.fwd_flops,
                    "bwd_flops": s.bwd_flops, "mem_traffic_bytes": s.mem_traffic_bytes, "n_ops": s.n_ops}
                   for s in samples],
        "calibration": {"efficiency": calib.efficiency, "peak_scale": calib.peak_scale,
                        "matmul_float32_flops": matmul_flops, "op_overhead_ms": calib.op_overhead_ms,
                        "median_abs_rel_err": calib.median_abs_rel_err, "max_abs_rel_err": calib.max_abs_rel_err,
                        "n_samples": calib.n_samples},
        "p2p": None if p2p is None else {"backend": p2p.backend, "bandwidth_gbps": p2p.bandwidth_gbps,
                                         "latency_ms": p2p.latency_ms,
                                         "points": [{"bytes": b, "one_way_ms": t} for b, t in p2p.points],
                                         "messages": None if p2p.messages is None else p2p.messages.to_dict(),
                                         "posting": list(p2p.posting), "executor": p2p.executor},
    }


def write_profile(doc: dict[str, Any], path: str | Path) -> Path:
    """Write atomically (``planner.outputs``)."""
    return write_atomic(path, json.dumps(doc, indent=2) + "\n")
