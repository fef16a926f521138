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
import psutil

from cost_models.devices import PROFILE_SCHEMA, DeviceSpec
from cost_models.measured import (
    BlockSample,
    Calibration,
    CoreSharing,
    P2PResult,
    fit_calibration,
    fit_message_cost,
    fit_p2p,
    sharing_speeds,
    with_executor_cost,
)
from cost_models.training import OPTIM_OPS_PER_TENSOR
from models.registry import build_model
from planner.coarsen import coarsen
from planner.errors import InvalidInputError, RankFailureError
from planner.outputs import write_atomic
from planner.trace import trace

Step = Callable[[str], None]
Clock = Literal["wall", "cpu"]
Statistic = Literal["min", "median"]
STATISTICS: tuple[str, ...] = ("min", "median")
# Swept before each timed pass: past the last-level cache (e.g. a 48 MiB L3), so a pass finds the caches as cold
# as in a run; a tight loop's warm caches, or sweeping only L2, time passes faster than a run does them
# (tuning history: benchmarks/README.md).
EVICT_BYTES = 64 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class UnitTiming:
    """Forward and backward time of one top-level unit (the settings' statistic of the repeats), in ms."""

    name: str
    fwd_ms: float
    bwd_ms: float


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
    alone (:class:`~cost_models.measured.CoreSharing`). Rounds go through every ``k`` in turn, each ratio against the same
    round's lone process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([os.getcwd(), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [sys.executable, "-c", "from planner.profiling.profile import _sharing_worker; _sharing_worker()",
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
    """Run ``planner.profiling.overhead_probe`` (a 2-stage plan of ``model`` on the real runtime, two gloo
    processes) and return its report: the executor thread's CPU per message instruction posting it
    (``comm_cpu_per_message_ms``), the backend threads' per message (``backend_cpu_per_message_ms``), the
    executor's other CPU per pass (``bookkeeping_per_pass_ms``) and the probe's message size."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "planner.profiling.overhead_probe", "--model", model, "--batch", str(batch),
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
