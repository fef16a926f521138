"""Measure this machine's device and write a profile JSON: the only code that times hardware.

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
  ``python -m planner.runtime.p2p_probe`` twice as subprocesses, and the CPU
  time a message costs the sending and the receiving process
  (:class:`MessageCost`: posting it, and the backend's threads moving its bytes);
- the CPU time the runtime's executor itself costs per message instruction and
  per pass (``MessageCost.executor_ms``/``executor_pass_ms``), by running
  ``python -m planner.runtime.overhead_probe`` (a small 2-rank plan of the
  profiled model on the real runtime) as a subprocess (gloo only);
- a calibration: the ``efficiency`` and per-op ``op_overhead_ms`` with which
  ``cost_models.compute`` (roofline + overhead, with the measured peak and
  bandwidth) best reproduces the measured unit times of the planner's blocks;
- optionally (``sharing``), how fast ``k = 1, 2, ...`` single-thread
  processes that compute at once progress, each relative to one alone
  (:class:`CoreSharing`): what ranks that share this machine's cores get
  (``planner.simulate.simulate(plan, cores=..., sharing=...)``).

The result's ``device`` entry is a :class:`~cost_models.devices.DeviceSpec`
that a cluster file can name as a device ``type`` (by the JSON's path).
"""
from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import numpy as np

from cost_models.compute import BWD_OPS_FACTOR, BWD_TRAFFIC_FACTOR
from cost_models.devices import PROFILE_SCHEMA, DeviceSpec
from cost_models.training import OPTIM_OPS_PER_TENSOR
from planner.errors import InvalidInputError, RankFailureError

Step = Callable[[str], None]
Clock = Literal["wall", "cpu"]
Statistic = Literal["min", "median"]
STATISTICS: tuple[str, ...] = ("min", "median")
# Swept before each timed pass: past the last-level cache (48 MiB L3 on the 2-core dev host). On that host (4 runs
# each of a 2- and a 4-rank plan, others' load ~1 core), the runs' pass CPU time over passes timed so was 0.97 and
# 1.02 (medians); over a tight loop's (warm caches) 1.07 and 1.13. Sweeping only L2 (4 MiB), or timing the units
# in a stage's own 1F1B order, did not close that gap.
EVICT_BYTES = 64 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class UnitTiming:
    """Forward and backward time of one top-level unit (the settings' statistic of the repeats), in ms."""

    name: str
    fwd_ms: float
    bwd_ms: float


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockSample:
    """A measured block beside the figures the cost model prices it from."""

    name: str
    fwd_ms: float
    bwd_ms: float
    fwd_flops: int
    bwd_flops: int
    mem_traffic_bytes: int
    n_ops: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Calibration:
    """Fitted ``efficiency`` and ``op_overhead_ms``, and how well they fit (relative errors).

    ``peak_scale`` (>= 1) multiplies the peak the fit was given: blocks that ran
    faster than that peak allows mean the matmul that measured it was disturbed
    (another process) or too small to reach it. The peak then becomes what the
    blocks reached and ``efficiency`` is 1, which prices every block exactly as
    the fit does; clamping the efficiency to 1 instead would price every block
    slower than measured (and a device scaled down from it would not be as slow
    as meant).
    """

    efficiency: float
    op_overhead_ms: float
    median_abs_rel_err: float
    max_abs_rel_err: float
    n_samples: int
    peak_scale: float = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class MessageCost:
    """CPU time a point-to-point message costs the processes at its two ends, beyond its time on the wire:
    posting it and moving its bytes through the backend (gloo's threads, the kernel's socket copies).

    ``send_ms + nbytes * send_ms_per_mib / 2**20`` on the sender, likewise ``recv_*`` on the receiver,
    fitted over message sizes (:func:`fit_message_cost`) of what ``planner.runtime.p2p_probe`` measures:
    messages posted with the runtime's own calls, each right after a sweep that leaves the caches as
    a pass does (posting from cold caches costs a few times what a tight loop of posts does). Ranks that
    share a machine's cores pay it out of their compute (``planner.simulate.simulate(plan, messages=...)``).

    ``executor_ms`` and ``executor_pass_ms``: what the runtime's executor itself costs on top, per message
    instruction (its bookkeeping around each post, and what its messages cost the process beyond the bare
    probe's) and per forward/backward pass (preparing inputs, prefetching, freeing, the step's metrics), as
    ``planner.runtime.overhead_probe`` measures it running a small plan (:func:`with_executor_cost`);
    0 in profiles taken before that probe existed.
    """

    send_ms: float
    recv_ms: float
    send_ms_per_mib: float = 0.0
    recv_ms_per_mib: float = 0.0
    executor_ms: float = 0.0
    executor_pass_ms: float = 0.0

    def __post_init__(self) -> None:
        values = (self.send_ms, self.recv_ms, self.send_ms_per_mib, self.recv_ms_per_mib, self.executor_ms,
                  self.executor_pass_ms)
        if any(not (v >= 0.0) for v in values):  # also rejects NaN
            raise InvalidInputError("message CPU costs", expected="ms >= 0", found=repr(values),
                                    fix="measure them again (stagewise profile)")

    def send_cpu_ms(self, nbytes: float) -> float:
        return self.send_ms + nbytes * self.send_ms_per_mib / 2**20

    def recv_cpu_ms(self, nbytes: float) -> float:
        return self.recv_ms + nbytes * self.recv_ms_per_mib / 2**20

    def to_dict(self) -> dict[str, float]:
        return {"send_ms": self.send_ms, "recv_ms": self.recv_ms, "send_ms_per_mib": self.send_ms_per_mib,
                "recv_ms_per_mib": self.recv_ms_per_mib, "executor_ms": self.executor_ms,
                "executor_pass_ms": self.executor_pass_ms}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> "MessageCost":
        try:
            return cls(send_ms=float(doc["send_ms"]), recv_ms=float(doc["recv_ms"]),
                       send_ms_per_mib=float(doc.get("send_ms_per_mib", 0.0)),
                       recv_ms_per_mib=float(doc.get("recv_ms_per_mib", 0.0)),
                       executor_ms=float(doc.get("executor_ms", 0.0)),
                       executor_pass_ms=float(doc.get("executor_pass_ms", 0.0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidInputError("message CPU costs", expected="{send_ms, recv_ms, ...}",
                                    found=repr(doc)[:120]) from exc


@dataclass(frozen=True, slots=True, kw_only=True)
class P2PResult:
    backend: str
    bandwidth_gbps: float
    latency_ms: float
    points: tuple[tuple[int, float], ...]  # (bytes, one-way ms)
    messages: MessageCost | None = None
    posting: tuple[dict[str, float], ...] = ()  # the probe's per-size posting and CPU measurements
    executor: dict[str, Any] | None = None  # planner.runtime.overhead_probe's report (MessageCost.executor_*)


@dataclass(frozen=True, slots=True, kw_only=True)
class CoreSharing:
    """How fast passes progress when ``k`` single-thread processes compute at once on one machine.

    ``speed[k - 1]`` is each process's rate with ``k`` computing, as a fraction of one process
    computing alone (so ``speed[0] == 1``), measured on a machine with ``cores`` processors. Even
    processor sharing would be ``min(1, cores / k)``; measured rates are lower where cores share
    an execution unit (hyperthreads), caches or memory bandwidth, and where more processes than
    cores pay for switching. Past the table, the last measured aggregate rate is shared evenly.
    """

    cores: int
    speed: tuple[float, ...]
    window_s: float = 0.0
    rounds: int = 0
    microbatches: int = 1  # in flight in each probe process (see ProfileSettings.sharing_microbatches)

    def __post_init__(self) -> None:
        if isinstance(self.cores, bool) or not isinstance(self.cores, int) or self.cores < 1:
            raise InvalidInputError("core sharing cores", expected="a whole number >= 1", found=repr(self.cores))
        if not self.speed or any(not (0.0 < v <= 1.0 + 1e-9) for v in self.speed) or abs(self.speed[0] - 1.0) > 1e-9:
            raise InvalidInputError("core sharing speeds", expected="1.0 for one process, then rates in (0, 1]",
                                    found=repr(self.speed), fix="measure them again (stagewise profile --sharing)")

    def rate(self, computing: int) -> float:
        """Each pass's progress (per ms of a pass alone) while ``computing`` passes compute at once."""
        if computing <= 0:
            return 0.0
        if computing <= len(self.speed):
            return self.speed[computing - 1]
        return self.speed[-1] * len(self.speed) / computing

    def to_dict(self) -> dict[str, Any]:
        return {"cores": self.cores, "speed": list(self.speed), "window_s": self.window_s, "rounds": self.rounds,
                "microbatches": self.microbatches}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> "CoreSharing":
        try:
            return cls(cores=doc["cores"], speed=tuple(float(v) for v in doc["speed"]),
                       window_s=float(doc.get("window_s", 0.0)), rounds=int(doc.get("rounds", 0)),
                       microbatches=int(doc.get("microbatches", 1)))
        except (KeyError, TypeError) as exc:
            raise InvalidInputError("core sharing table", expected="{cores, speed: [...]}",
                                    found=repr(doc)[:120]) from exc


def sharing_speeds(rates: Sequence[Sequence[float]], alone: Sequence[float]) -> tuple[float, ...]:
    """Per-process speeds from measured rounds: ``rates[r][k - 1]`` is the mean per-process pass rate of
    round ``r`` with ``k`` processes, ``alone[r]`` that round's rate of one. Each round's ratios, then
    their median (rounds are short and this host's speed drifts between them); capped at 1, since
    company never speeds a process up, and made non-increasing in ``k``."""
    if not rates or len(rates) != len(alone) or any(a <= 0 for a in alone):
        raise InvalidInputError("core sharing rounds", expected="one alone rate > 0 per round", found=repr(alone))
    ratios = np.array([[min(r / a, 1.0) for r in row] for row, a in zip(rates, alone)])
    speed = np.median(ratios, axis=0)
    speed[0] = 1.0
    return tuple(float(v) for v in np.minimum.accumulate(speed))


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


# --- raw measurements --------------------------------------------------------
def _sync(device: Any) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _clock(clock: Clock) -> Callable[[], float]:
    """``wall``: elapsed time. ``cpu``: this process's CPU time, which time-sharing with other
    processes does not inflate; it equals the work's duration only with one torch thread on a
    CPU device (for measuring on a shared machine)."""
    if clock == "wall":
        return time.perf_counter
    if clock == "cpu":
        import torch
        if torch.get_num_threads() != 1:
            raise InvalidInputError("cpu clock", expected="torch.get_num_threads() == 1",
                                    found=str(torch.get_num_threads()), fix="set one thread (--threads 1)")
        return time.process_time
    raise InvalidInputError("clock", expected="wall or cpu", found=repr(clock))


def summarize_ms(times: Sequence[float], statistic: Statistic = "min") -> float:
    """``min``: other processes only ever add time, so the minimum is the steadiest estimate of
    what the device itself takes. ``median``: what the same work takes in a typical repeat."""
    if not times:
        raise InvalidInputError("timings", expected="at least one repeat", found="none")
    if statistic == "min":
        return min(times)
    if statistic == "median":
        return float(np.median(times))
    raise InvalidInputError("profile statistic", expected=" or ".join(STATISTICS), found=repr(statistic))


def _best_ms(fn: Callable[[], Any], device: Any, repeats: int, warmup: int = 1, clock: Clock = "wall",
             statistic: Statistic = "min") -> float:
    """Fastest of ``repeats`` timed runs (the device's throughput figures are best-case by definition),
    or their ``statistic``."""
    now = _clock(clock)
    times = []
    for i in range(warmup + repeats):
        _sync(device)
        t0 = now()
        fn()
        _sync(device)
        if i >= warmup:
            times.append((now() - t0) * 1e3)
    return summarize_ms(times, statistic)


def measure_matmul_flops(dtype: str, *, size: int, repeats: int, device: Any, clock: Clock = "wall") -> float:
    """Achieved FLOP/s of ``size x size`` matmuls in ``dtype`` (2 n^3 flops each)."""
    import torch
    tdtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(device=device, dtype=tdtype)
    b = torch.randn(size, size, generator=gen).to(device=device, dtype=tdtype)
    ms = _best_ms(lambda: torch.mm(a, b), device, repeats, clock=clock)
    return 2.0 * size**3 / (ms / 1e3)


def measure_memory_bandwidth(*, nbytes: int, repeats: int, device: Any, clock: Clock = "wall") -> float:
    """Bytes/s of a large copy, counting the bytes read and the bytes written."""
    import torch
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms = _best_ms(lambda: dst.copy_(src), device, repeats, clock=clock)
    return 2.0 * src.numel() * 4 / (ms / 1e3)


# Tensors of the optimizer probe: enough that the per-tensor loop dominates, small enough that
# their bytes (64 floats each) cost nothing. On the 2-core dev host Adam took 73-78 us per tensor
# at 16, 64 and 256 tensors: a flat per-tensor cost, a ninth of it per kernel (8 us, where the
# model ops' fitted overhead is 64 us: those carry autograd's bookkeeping too).
OPTIM_PROBE_TENSORS = 128


def measure_optimizer_op_ms(*, repeats: int, device: Any, clock: Clock = "wall", statistic: Statistic = "min",
                            tensors: int = OPTIM_PROBE_TENSORS) -> float:
    """Time per element-wise kernel of ``torch.optim.Adam``'s step (its default implementation on
    ``device``), from steps over ``tensors`` tiny parameters: the fixed cost that
    ``planner.simulate.optim_ms`` charges per kernel of every parameter tensor."""
    import torch
    params = [torch.nn.Parameter(torch.zeros(64, device=device)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.Adam(params, lr=1e-3)
    ms = _best_ms(opt.step, device, repeats, warmup=2, clock=clock, statistic=statistic)
    return ms / (tensors * OPTIM_OPS_PER_TENSOR["adam"])


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
        _sync(device)

    return sweep


def time_units(module: Any, inputs: Sequence[Any], *, repeats: int, device: Any, warmup: int = 1,
               clock: Clock = "wall", statistic: Statistic = "min", evict_bytes: int = 0) -> tuple[UnitTiming, ...]:
    """Forward and backward ms (``statistic`` of the repeats) of every top-level unit, run alone on
    its captured inputs; with ``evict_bytes``, each timed forward and backward right after an untimed
    cache sweep over that many bytes (:data:`EVICT_BYTES`)."""
    import torch
    now = _clock(clock)
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
            _sync(device)
            t0 = now()
            out = unit(*args, **kwargs)
            _sync(device)
            t1 = now()
            if grad is None:
                gen = torch.Generator().manual_seed(1)
                grad = torch.randn(out.shape, generator=gen, dtype=out.dtype).to(out.device)
            sweep()
            _sync(device)
            t1_bwd = now()
            torch.autograd.backward(out, grad)
            _sync(device)
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


def _sharing_worker() -> None:
    """One process of :func:`measure_core_sharing` (run as ``python -c``, arguments model, batch, seq and
    microbatches ``m``): ``m`` forwards of the model held at once, then their backwards, one thread, as
    many times as fit in each window read from stdin (``start window_s`` on the machine-wide monotonic
    clock); it answers each with its rate (microbatches' passes per second)."""
    import torch

    from models.registry import build_model
    model, batch, seq = sys.argv[1], int(sys.argv[2]), None if sys.argv[3] == "-" else int(sys.argv[3])
    microbatches = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    torch.set_num_threads(1)
    bundle = build_model(model, batch=batch, seq=seq, device="cpu")
    module, inputs = bundle.module.train(), bundle.example_inputs

    def one_pass() -> None:
        outs = [module(*inputs) for _ in range(microbatches)]  # activations of m microbatches in flight
        for out in outs:
            (out if out.dim() == 0 else out.float().square().mean()).backward()
        module.zero_grad(set_to_none=True)

    one_pass()  # warm-up: allocations and kernel choices
    print("ready", flush=True)
    for line in sys.stdin:
        start, window_s = (float(x) for x in line.split())
        time.sleep(max(0.0, start - time.perf_counter()))
        passes, end = 0, start + window_s
        while (now := time.perf_counter()) < end:
            one_pass()
            passes += 1
        print(passes / (now - start), flush=True)


def measure_core_sharing(*, model: str, batch: int, seq: int | None, processes: int, window_s: float,
                         rounds: int, timeout_s: float = 120.0, microbatches: int = 1) -> CoreSharing:
    """Per-process progress of ``k = 1..processes`` single-thread processes computing at once (the
    model's forwards and backwards in a loop, ``microbatches`` in flight), each as a fraction of one
    alone (:class:`CoreSharing`). Rounds go through every ``k`` in turn, each ratio against the same
    round's lone process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([os.getcwd(), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [sys.executable, "-c", "from cost_models.profile import _sharing_worker; _sharing_worker()",
           model, str(batch), "-" if seq is None else str(seq), str(microbatches)]
    procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for _ in range(processes)]
    try:
        for proc in procs:
            _sharing_reply(proc, timeout_s)
        rates: list[list[float]] = []
        for _ in range(rounds):
            row = []
            for k in range(1, processes + 1):
                start = time.perf_counter() + 0.2
                for proc in procs[:k]:
                    proc.stdin.write(f"{start} {window_s}\n")
                    proc.stdin.flush()
                row.append(float(np.mean([float(_sharing_reply(proc, timeout_s + window_s)) for proc in procs[:k]])))
            rates.append(row)
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate()
    return CoreSharing(cores=os.cpu_count() or 1, speed=sharing_speeds(rates, [row[0] for row in rates]),
                       window_s=window_s, rounds=rounds, microbatches=microbatches)


def _sharing_reply(proc: subprocess.Popen, timeout_s: float) -> str:
    """The next line a sharing worker prints, or a RankFailureError if it dies or stays silent."""
    import select
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        err = (proc.communicate()[1] or "").strip().splitlines() or ["no output"]
        raise RankFailureError("core sharing probe worker", expected=f"a reply within {timeout_s:.0f} s",
                               found=err[-1], fix="check that the model spec imports from this directory")
    return line.strip()


# --- pure fits ---------------------------------------------------------------
def _fit_terms(samples: Sequence[BlockSample], peak_flops: float, mem_bw: float
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per measurement (forward and backward of every block): compute ms at efficiency 1, memory ms, ops, ms."""
    x, m, n, y = [], [], [], []
    for s in samples:
        x += [1e3 * s.fwd_flops / peak_flops, 1e3 * s.bwd_flops / peak_flops]
        m += [1e3 * s.mem_traffic_bytes / mem_bw, 1e3 * BWD_TRAFFIC_FACTOR * s.mem_traffic_bytes / mem_bw]
        n += [s.n_ops, BWD_OPS_FACTOR * s.n_ops]
        y += [s.fwd_ms, s.bwd_ms]
    return np.array(x), np.array(m), np.array(n), np.array(y)


def _log_err(eff: np.ndarray, ovh: np.ndarray, x: np.ndarray, m: np.ndarray, n: np.ndarray,
             y: np.ndarray) -> np.ndarray:
    pred = np.maximum(x[None, None, :] / eff[:, None, None], m[None, None, :]) + ovh[None, :, None] * n[None, None, :]
    return np.sum(np.log(np.maximum(pred, 1e-9) / y[None, None, :]) ** 2, axis=2)


def fit_calibration(samples: Sequence[BlockSample], *, peak_flops: float, mem_bw_bytes_per_s: float) -> Calibration:
    """Efficiency and per-op overhead minimising the squared log error of predicted block times.

    The model is exactly ``cost_models.compute``'s: ``max(flops / (peak * eff),
    traffic / bw) + ops * overhead``. A coarse log grid, then a fine one around
    the best point: robust, no derivatives, and cheap for tens of blocks. An
    efficiency above 1 is returned as ``efficiency=1`` and ``peak_scale`` (see
    :class:`Calibration`).
    """
    if not samples:
        raise InvalidInputError("calibration samples", expected="at least one measured block", found="none")
    x, m, n, y = _fit_terms(samples, peak_flops, mem_bw_bytes_per_s)
    if np.any(y <= 0):
        raise InvalidInputError("measured block times", expected="> 0 ms", found=repr(y.min()))
    eff = np.logspace(-3, 1, 121)
    ovh = np.concatenate(([0.0], np.logspace(-5, 1, 121)))
    err = _log_err(eff, ovh, x, m, n, y)
    i, j = np.unravel_index(np.argmin(err), err.shape)
    fine_eff = np.clip(eff[i] * np.logspace(-0.04, 0.04, 41), 1e-3, 10.0)
    fine_ovh = ovh[j] * np.logspace(-0.03, 0.03, 41) if ovh[j] > 0 else np.concatenate(([0.0], np.logspace(-6, -5, 11)))
    err = _log_err(fine_eff, fine_ovh, x, m, n, y)
    i, j = np.unravel_index(np.argmin(err), err.shape)
    best_eff, best_ovh = float(fine_eff[i]), float(fine_ovh[j])
    pred = np.maximum(x / best_eff, m) + best_ovh * n
    rel = np.abs(pred - y) / y
    return Calibration(efficiency=min(best_eff, 1.0), op_overhead_ms=best_ovh,
                       median_abs_rel_err=float(np.median(rel)), max_abs_rel_err=float(rel.max()),
                       n_samples=int(y.size), peak_scale=max(best_eff, 1.0))


def fit_p2p(points: Sequence[tuple[int, float]], backend: str) -> P2PResult:
    """Latency and bandwidth from (bytes, one-way ms) points by least squares ``t = lat + bytes / bw``."""
    if len(points) < 2 or len({b for b, _ in points}) < 2:
        raise InvalidInputError("p2p points", expected="two or more message sizes", found=repr(points))
    b = np.array([p[0] for p in points], dtype=float)
    t = np.array([p[1] for p in points], dtype=float)
    slope, intercept = np.polyfit(b, t, 1)
    if intercept < 0 or slope <= 0:
        # Noise swamped the line: latency from the smallest message, and (conservatively)
        # the whole time of the largest one as transfer time.
        intercept = float(t[np.argmin(b)])
        slope = float(t[np.argmax(b)] / b.max())
    bandwidth_gbps = 8.0 / (slope * 1e-3) / 1e9
    return P2PResult(backend=backend, bandwidth_gbps=float(bandwidth_gbps), latency_ms=float(intercept),
                     points=tuple((int(p[0]), float(p[1])) for p in points))


def _nonneg_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least-squares ``y = a + b x`` with ``a, b >= 0``: where the free fit makes one negative (noise),
    that term is 0 and the other is refitted alone."""
    if len(set(x.tolist())) >= 2:
        b, a = np.polyfit(x, y, 1)
        if a >= 0 and b >= 0:
            return float(a), float(b)
    through_origin = float(max(np.dot(x, y) / np.dot(x, x), 0.0)) if np.dot(x, x) > 0 else 0.0
    flat = float(max(np.mean(y), 0.0))
    err_origin = float(np.sum((y - through_origin * x) ** 2))
    err_flat = float(np.sum((y - flat) ** 2))
    return (0.0, through_origin) if err_origin < err_flat else (flat, 0.0)


def fit_message_cost(posting: Sequence[dict[str, float]]) -> MessageCost:
    """A :class:`MessageCost` from the probe's per-size measurements (``bytes``, ``send_cpu_ms``,
    ``recv_cpu_ms``: process CPU time per message on each side): a line in the size on each side."""
    if not posting:
        raise InvalidInputError("message CPU measurements", expected="at least one message size", found="none")
    mib = np.array([float(p["bytes"]) for p in posting]) / 2**20
    send = _nonneg_line(mib, np.array([float(p["send_cpu_ms"]) for p in posting]))
    recv = _nonneg_line(mib, np.array([float(p["recv_cpu_ms"]) for p in posting]))
    return MessageCost(send_ms=send[0], send_ms_per_mib=send[1], recv_ms=recv[0], recv_ms_per_mib=recv[1])


# --- p2p between two local processes ----------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


POSTING_MAX_BYTES = 1 << 22  # messages timed for their CPU cost: several of each size are in flight at once


def _posting_sizes(sizes: Sequence[int]) -> list[int]:
    """The probe's sizes up to :data:`POSTING_MAX_BYTES` (at least the smallest two): a line through them
    prices activations and gradients, without holding ``posts`` buffers of the largest sizes."""
    ordered = sorted(set(sizes))
    return [s for s in ordered if s <= POSTING_MAX_BYTES] or ordered[:2]


def measure_p2p(*, sizes: Sequence[int], repeats: int, backend: str, timeout_s: float, posts: int = 8) -> P2PResult:
    """Ping-pong between two ``planner.runtime.p2p_probe`` processes, then the CPU time of ``posts``
    messages posted back to back per size and side (0: not measured); rank 0 reports JSON on stdout."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "planner.runtime.p2p_probe", "--world-size", "2",
           "--init-method", f"tcp://127.0.0.1:{port}", "--backend", backend,
           "--sizes", ",".join(str(s) for s in sizes), "--repeats", str(repeats), "--timeout-s", str(timeout_s),
           "--posts", str(posts), "--post-sizes", ",".join(str(s) for s in _posting_sizes(sizes))]
    procs = [subprocess.Popen(cmd + ["--rank", str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for r in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout_s + 30))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
            p.communicate()
        raise RankFailureError("p2p probe", expected=f"two processes finishing within {timeout_s:.0f} s",
                               found="a hang", fix="rerun with --no-p2p to skip the P2P measurement") from None
    for rank, (p, (_, err)) in enumerate(zip(procs, outs)):
        if p.returncode != 0:
            last = (err.strip().splitlines() or ["no output"])[-1]
            raise RankFailureError(f"p2p probe rank {rank}", expected="exit 0",
                                   found=f"exit {p.returncode}: {last}", fix="rerun with --no-p2p to skip it")
    try:
        report = json.loads(outs[0][0].strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        raise RankFailureError("p2p probe rank 0", expected="a JSON report on stdout",
                               found=repr(outs[0][0][-200:])) from None
    result = fit_p2p([(int(p["bytes"]), float(p["one_way_ms"])) for p in report["points"]], report["backend"])
    posting = tuple(report.get("posting") or ())
    if not posting:
        return result
    return P2PResult(backend=result.backend, bandwidth_gbps=result.bandwidth_gbps, latency_ms=result.latency_ms,
                     points=result.points, messages=fit_message_cost(posting), posting=posting)


EXECUTOR_WARMUP_STEPS = 2  # the probe's first steps (start-up, cold caches), left out where it has more


def measure_executor(*, model: str, batch: int, seq: int | None, steps: int, timeout_s: float,
                     microbatches: int = 4) -> dict[str, Any]:
    """Run ``planner.runtime.overhead_probe`` (a 2-stage plan of ``model`` on the real runtime, two gloo
    processes) and return its report: the executor thread's CPU per message instruction posting it
    (``comm_cpu_per_message_ms``), the backend threads' per message (``backend_cpu_per_message_ms``), the
    executor's other CPU per pass (``bookkeeping_per_pass_ms``) and the probe's message size."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "planner.runtime.overhead_probe", "--model", model, "--batch", str(batch),
           "--microbatches", str(microbatches), "--steps", str(steps),
           "--warmup", str(min(EXECUTOR_WARMUP_STEPS, steps - 1)), "--timeout-s", str(timeout_s)]
    if seq is not None:
        cmd += ["--seq", str(seq)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s + 60)
    except subprocess.TimeoutExpired:
        raise RankFailureError("executor probe", expected=f"a run finishing within {timeout_s:.0f} s",
                               found="a hang", fix="rerun with --no-p2p to skip it") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RankFailureError("executor probe", expected="exit 0", found=f"exit {proc.returncode}: {last}",
                               fix="rerun with --no-p2p to skip it")
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        raise RankFailureError("executor probe", expected="a JSON report on stdout",
                               found=repr(proc.stdout[-200:])) from None


def with_executor_cost(messages: MessageCost, report: dict[str, Any]) -> MessageCost:
    """``messages`` with the executor probe's costs: per message instruction, the CPU its messages cost the
    probe's processes (the executor thread posting them, the backend's threads) beyond what ``messages``
    prices for a bare message of that size (mean of the two ends; never below 0), and per pass, the
    executor's bookkeeping."""
    nbytes = float(report["message_bytes"])
    bare = 0.5 * (messages.send_cpu_ms(nbytes) + messages.recv_cpu_ms(nbytes))
    per_message = float(report["comm_cpu_per_message_ms"]) + float(report["backend_cpu_per_message_ms"])
    return replace(messages, executor_ms=max(per_message - bare, 0.0),
                   executor_pass_ms=max(float(report["bookkeeping_per_pass_ms"]), 0.0))


# --- the whole profile -------------------------------------------------------
def model_chain(spec: str, *, batch: int, seq: int | None) -> Any:
    """The planner's BlockChain of a preset at this shape (trace + coarsen on meta: no weights)."""
    from models.registry import build_model
    from planner.coarsen import coarsen
    from planner.trace import trace
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

    from models.registry import build_model
    say = step or (lambda _msg: None)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name, kind, mem_bytes = _device_identity(device)
    if settings.clock == "cpu" and device.type != "cpu":
        raise InvalidInputError("--clock cpu", expected="a CPU device", found=str(device),
                                fix="use the wall clock on GPUs")
    _clock(settings.clock)  # checks the thread count before anything is measured
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


def load_sharing(profile: str | Path | dict[str, Any]) -> CoreSharing | None:
    """The core sharing table of a profile (a path or its document); None if it was not measured."""
    doc = profile if isinstance(profile, dict) else json.loads(Path(profile).read_text())
    table = doc.get("sharing")
    return None if table is None else CoreSharing.from_dict(table)


def load_message_cost(profile: str | Path | dict[str, Any]) -> MessageCost | None:
    """The per-message CPU costs of a profile (a path or its document); None if they were not measured."""
    doc = profile if isinstance(profile, dict) else json.loads(Path(profile).read_text())
    table = (doc.get("p2p") or {}).get("messages")
    return None if table is None else MessageCost.from_dict(table)


def write_profile(doc: dict[str, Any], path: str | Path) -> Path:
    """Write atomically: a temp file in the same folder, then ``os.replace``."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(doc, indent=2) + "\n")
        os.replace(tmp, out)
    except OSError:
        tmp.unlink(missing_ok=True)  # never leave a half-written temp file behind
        raise
    return out
