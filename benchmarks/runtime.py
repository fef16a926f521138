"""Runtime benchmark: our executor vs torch.distributed.pipelining, predicted vs measured, solver vs baselines.

Three measurements on this machine (gloo, one thread per rank), on an 8-layer
byte-level GPT (d=128, T=64, microbatch 4, 4 microbatches):

1. **Overhead**: step time of our runtime vs ``torch.distributed.pipelining``'s
   ``Schedule1F1B`` on the same 2-stage split and microbatches (goal: ratio <= 1.05), over twice the
   repeats of the other sections: single runs of either move by +-10% with this host's speed, and a
   median of 4 left the ratio +-6% from one benchmark run to the next.
2. **Prediction**: the simulator's step time vs the measured one, for 2- and
   4-rank plans, with and without emulated heterogeneity (the last device at a
   third of the profiled efficiency, padded by ``--emulate-speed``) (goal:
   within 10%). Every run is bracketed by two profiles of this CPU
   (``planner.profiling.profile``: matmul peak, bandwidth and the benchmark model's
   own blocks, median of the repeats, one thread), one just before and one
   just after it; the plan is priced with each and the prediction is their
   mean (the CPU's speed drifts on this shared host; the spread of the two is
   recorded as ``profile_drift_pct``). Gloo's latency and bandwidth between
   two local processes, the CPU time a message costs its two ends
   (``MessageCost``) and the executor's own CPU time per message and per
   pass (its ``executor_*``, from the profile's executor probe, a 2-rank run
   of this model; ``no_executor_ms``: priced without them), and how fast 1..4 single-thread processes computing
   at once progress on this machine (``CoreSharing``, each process holding
   a 1F1B stage's microbatches in flight: these two cores slow each other
   down even two at a time), are measured once, by the first profile, and
   priced (``previous_model_ms``: as before those two, one microbatch in
   flight and free messages). All ranks run on this machine's cores, so the
   prediction is ``simulate(plan, cores=os.cpu_count(), sharing=...,
   messages=..., emulated=...)``: the passes that overlap share the cores at the measured
   speeds, and an emulated slow device's padding (a sleep) holds no core.
   Beside it: the same with even sharing (the model before the table,
   ``even_sharing_ms``), and the plan simulated with the pass and optimizer
   times measured in the same run (``inrun_predicted_ms``: the simulator's
   composition without the profile's drift), with each rank's measured
   passes over the profile's (``pass_cpu_over_profile``), and the same with
   each rank's measured time posting messages and its unbooked executor time
   (``comm_ms`` + ``other_ms``) priced as part of its passes
   (``inrun_executor_ms``: what the simulator does not price yet). The
   profiles time every block pass right after a cache-evicting sweep
   (``ProfileSettings.evict_bytes``); each bracket also takes one without it
   (a tight loop, warm caches), which prices the plan as before
   (``warm_profile_ms``).
3. **Planning**: measured step time of the solver's plan vs the uniform and
   parameter-balanced baselines' plans on an emulated heterogeneous 2-device
   cluster (this CPU + one at a third of its efficiency), run side by side;
   each plan predicted with the first profile and one taken after the runs
   (their mean, as in 2.).

Other processes share this machine. Every run records the CPU the rest of the
machine used while its steps ran (``external_load_cores``: machine busy time
minus our ranks' CPU time, over the wall time); a run during which others
used more than ``--max-external-load`` cores is repeated (at most
``--retries`` times) and the least disturbed attempt counts; all attempts are
kept in the JSON. Repeats are interleaved across configurations and
summarised by their median.

    python benchmarks/runtime.py            # writes benchmarks/results/runtime.json
    python benchmarks/runtime.py --quick    # fewer steps and repeats (a smoke run): writes nothing

Run from the repository root: the ranks import this file's model factory.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from cost_models.cluster_file import parse_cluster
from planner.simulate import predict

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODEL = "benchmarks.runtime:bench_gpt"
MICROBATCH, NUM_MB, SEQ, LAYERS = 4, 4, 64, 8
RESULTS = ROOT / "benchmarks" / "results" / "runtime.json"


def bench_gpt():
    """The benchmark model (a factory for ``build_model``): 8 layers, d=128, byte vocabulary."""
    from models.gpt import GPT, GPTConfig
    return GPT(GPTConfig(vocab_size=256, max_seq=SEQ, n_layers=LAYERS, d_model=128, n_heads=4))


# --------------------------------------------------------------------------- plans
def chain():
    from models.registry import build_model
    from planner.coarsen import coarsen
    from planner.trace import trace
    bundle = build_model(MODEL, batch=MICROBATCH, seq=SEQ, device="meta")
    return coarsen(trace(bundle.module, bundle.example_inputs, name="bench-gpt"))


P2P_SIZES = (1 << 10, 1 << 17, 1 << 20, 1 << 22)  # around the 128 KiB activations the stages exchange


# Microbatches each core sharing probe process holds in flight: what a 1F1B stage of these plans holds
# (the 2-stage plan's first stage 2, the 4-stage plan's stages 4..1), so the caches see a stage's load.
SHARING_MICROBATCHES = 2


@dataclass(frozen=True)
class Machine:
    """What the first profile measured of how ranks on this machine's cores slow each other:
    ``sharing`` (passes that overlap, :data:`SHARING_MICROBATCHES` in flight per probe process) and
    ``messages`` (CPU time per message at each end, and the executor's own per message and per pass, as
    ``planner.profiling.overhead_probe`` measured it) price the predictions; ``previous_sharing`` (one
    microbatch in flight, no message costs) is the model before them, and ``bare_messages`` the model
    before the executor probe, priced beside it."""

    sharing: Any
    messages: Any
    previous_sharing: Any
    bare_messages: Any = None  # ``messages`` without the executor probe's costs (the model before them)


def profile_cpu(path: Path, *, p2p: bool = False, sharing: bool = False, warm: bool = False) -> Path:
    """A single-thread profile of this CPU, calibrated on the benchmark model's own blocks; with
    ``sharing``, also how fast 1..2 x cores processes computing at once progress here; with ``p2p``,
    gloo's latency, bandwidth and CPU time per message between two local processes. Block passes are
    timed after a cache-evicting sweep (the profile's default), or with ``warm`` in a tight loop (as before).

    The median of the repeats, not the minimum: a step adds up many passes, so it sees their
    typical time on this shared machine, not the best one."""
    from planner.profiling.profile import ProfileSettings, profile_device, write_profile
    torch.set_num_threads(1)
    settings = ProfileSettings(model=MODEL, batch=MICROBATCH, seq=SEQ, matmul_size=512, copy_bytes=32 << 20,
                               repeats=10, p2p=p2p, p2p_sizes=P2P_SIZES, statistic="median", sharing=sharing,
                               sharing_rounds=3, sharing_microbatches=SHARING_MICROBATCHES, executor_steps=10,
                               **({"evict_bytes": 0} if warm else {}))
    return write_profile(profile_device(settings), path)


def local_link(profile: Path) -> dict[str, float]:
    """Gloo between two processes of this machine, as a profile with ``p2p`` measured it."""
    p2p = json.loads(profile.read_text())["p2p"]
    return {"bandwidth_gbps": p2p["bandwidth_gbps"], "latency_ms": p2p["latency_ms"]}


def cluster(profile: Path, efficiencies: list[float], link: dict[str, float]):
    """One host per device, all this CPU's profile; a device's efficiency scale (<= 1) makes it slower."""
    base = json.loads(profile.read_text())["device"]["efficiency"]
    hosts = [{"name": f"cpu{i}", "region": "local", "trust": "operator", "trusted": True,
              "devices": [{"type": str(profile), "count": 1, "efficiency": base * e}]}
             for i, e in enumerate(efficiencies)]
    return parse_cluster({"name": "bench", "hosts": hosts, "links": {"intra_host": link, "default": link}})


def config(schedule: str = "1f1b"):
    from cost_models.training import TrainingConfig
    return TrainingConfig(global_batch=MICROBATCH * NUM_MB, microbatch_size=MICROBATCH, schedule=schedule,
                          optimizer="adam")


def compile_solution(solution, ch, cl, folder: Path, name: str) -> Path:
    from planner.compile import compile_plan
    from planner.plan_values import ModelRef
    from planner.solver.policy import VerificationPolicy
    ref = ModelRef(spec=MODEL, name="bench-gpt", fingerprint=ch.fingerprint, batch=MICROBATCH, seq=SEQ)
    plan = predict(compile_plan(solution, ch, cl, config(solution.schedule), VerificationPolicy(enabled=False), ref))
    return plan.save(folder / f"{name}.json")


def hand_solution(ch, cl, ranges: list[tuple[int, int]]):
    from planner.solver.solution import Solution, SolveReport, StagePlacement
    ids = [d.id for d in cl.devices]
    stages = tuple(StagePlacement(index=k, first_block=lo, last_block=hi, devices=(ids[k],),
                                  microbatches=(NUM_MB,)) for k, (lo, hi) in enumerate(ranges))
    report = SolveReport(method="hand", status="FEASIBLE", objective_ms=0.0, bound_ms=None, gap=None, solve_s=0.0)
    return Solution(stages=stages, verifiers=(), num_microbatches=NUM_MB, schedule="1f1b", predicted_step_ms=0.0,
                    memory_bytes=(), report=report)


# --------------------------------------------------------------------------- runs
def _busy_s() -> float:
    """Seconds all of this machine's cores have been busy (anyone's processes)."""
    import psutil
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


class _LoadProbe:
    """Machine busy time over the steps of a run: rank 0 reports step s when step s + 1 ends, so the
    window from the first step report to the end covers steps 2.. (and the run's short wind-down)."""

    def __init__(self) -> None:
        self.start: tuple[float, float] | None = None
        self.end: tuple[float, float] | None = None

    def __call__(self, event: dict[str, Any]) -> None:
        if event.get("event") == "step" and self.start is None:
            self.start = (time.perf_counter(), _busy_s())
        elif event.get("event") == "done":
            self.end = (time.perf_counter(), _busy_s())

    def external_cores(self, own_cpu_ms: float) -> float | None:
        """Cores the rest of the machine kept busy on average (our ranks' CPU time taken out)."""
        if self.start is None or self.end is None or self.end[0] <= self.start[0]:
            return None
        wall = self.end[0] - self.start[0]
        return max(0.0, (self.end[1] - self.start[1] - own_cpu_ms / 1e3) / wall)


def _rank_breakdown(rows, warmup: int) -> list[dict[str, float]]:
    """Per rank, the median over the steps after ``warmup`` of where its step went (ms); ``own_cpu_ms``:
    the executor thread's CPU time outside passes, waits and the optimizer (what the executor probe prices;
    beside ``comm_ms`` + ``other_ms``, wall time, it shows how much of that the rank was descheduled)."""
    out = []
    for rank in sorted({r.rank for r in rows}):
        mine = [r for r in rows if r.rank == rank and r.step >= warmup] or [r for r in rows if r.rank == rank]
        med = {k: statistics.median(getattr(r, k) for r in mine)
               for k in ("step_ms", "cpu_ms", "compute_ms", "compute_cpu_ms", "pad_ms", "wait_ms", "comm_ms",
                         "optim_ms", "thread_cpu_ms", "comm_cpu_ms", "own_cpu_ms")}
        other = [r.step_ms - r.compute_ms - r.pad_ms - r.wait_ms - r.comm_ms - r.optim_ms - r.verify_ms for r in mine]
        out.append({"rank": rank, **{k: round(v, 2) for k, v in med.items()},
                    "other_ms": round(statistics.median(other), 2)})
    return out


def in_run_prediction(plan_path: Path, ranks: list[dict[str, float]], messages=None) -> dict[str, Any]:
    """The plan simulated with the pass and optimizer times its own run measured (a device per rank,
    since the measured wall times already include any sharing of the cores): what is left between
    this and the measured step is the simulator's composition (bubbles, transfers, what it does not
    price), not the profile. Also each rank's measured passes over the profile's (its simulated passes,
    sharing included, and their CPU time over the profile's alone time)."""
    from planner.instruction_costs import CostModel
    from planner.plan_load import load_plan
    from planner.simulate import simulate
    plan = load_plan(plan_path)
    costs = CostModel.for_plan(plan)
    passes = {r: sum(1 for ins in plan.programs[r] if ins.op in ("F", "B")) // 2 for r in range(plan.num_ranks)}
    scale, cpu_ratio, unpriced = {}, {}, {}
    for row in ranks:
        r = row["rank"]
        planned = passes[r] * (costs.compute_ms(r, "F") + costs.compute_ms(r, "B"))
        local = passes[r] * (costs.local_ms(r, "F") + costs.local_ms(r, "B"))
        scale[r] = (row["compute_ms"] + row["pad_ms"]) / planned if planned else 1.0
        cpu_ratio[r] = row["compute_cpu_ms"] / local if local else 1.0
        # Wall time the rank spent posting messages and in the executor outside passes, waits and the
        # optimizer, per pass: the simulator prices neither (messages= only the probe's CPU per message).
        unpriced[r] = (row["comm_ms"] + row["other_ms"]) / (2 * passes[r]) if passes[r] else 0.0
    optim = {row["rank"]: row["optim_ms"] for row in ranks}
    measured = MeasuredPasses(costs, scale, optim)
    executor = MeasuredPasses(costs, scale, optim, extra_ms=unpriced)
    return {"inrun_predicted_ms": simulate(plan, measured).step_ms,
            "inrun_executor_ms": simulate(plan, executor).step_ms,
            "inrun_messages_ms": None if messages is None else simulate(plan, measured, messages=messages).step_ms,
            "pass_scale": [round(scale[r], 3) for r in sorted(scale)],
            "pass_cpu_over_profile": [round(cpu_ratio[r], 3) for r in sorted(cpu_ratio)]}


class MeasuredPasses:
    """A plan's cost model whose passes and optimizer steps take what a run measured: each rank's
    forward and backward scaled by one factor (the run's compute wall time over the planned), the
    optimizer step as measured; everything else (transfers, all-reduce) as planned. ``extra_ms``: per
    rank, ms added to each of its passes (its measured unpriced executor time, spread over them)."""

    def __init__(self, base, scale: dict[int, float], optim_ms: dict[int, float],
                 extra_ms: dict[int, float] | None = None) -> None:
        self.base, self.scale, self.optim, self.extra = base, scale, optim_ms, extra_ms or {}

    def compute_ms(self, rank: int, op: str) -> float:
        return self.base.compute_ms(rank, op) * self.scale.get(rank, 1.0) + self.extra.get(rank, 0.0)

    def local_ms(self, rank: int, op: str) -> float:
        return self.base.local_ms(rank, op) * self.scale.get(rank, 1.0) + self.extra.get(rank, 0.0)

    def optim_ms(self, rank: int) -> float:
        return self.optim.get(rank, self.base.optim_ms(rank))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)


def run_plan(plan_path: Path, steps: int, *, emulate: bool, messages=None) -> dict[str, Any]:
    """One local run: median step period after the first step, per-rank breakdown, external load."""
    from planner.runtime.launcher.launch import launch
    from planner.runtime.rank.metrics import read_metrics
    from planner.runtime.options import RunOptions
    probe = _LoadProbe()
    metrics = plan_path.with_suffix(".metrics.jsonl")
    result = launch(RunOptions(plan=str(plan_path), steps=steps, timeout_s=120, emulate=emulate,
                               metrics=str(metrics), model=MODEL), on_event=probe)
    rows = read_metrics(metrics)
    own = sum(r.cpu_ms for r in rows if r.step >= 2)
    load = probe.external_cores(own)
    ranks = _rank_breakdown(rows, warmup=1)
    return {"measured_ms": result["measured_step_ms"], "plan_predicted_ms": result["predicted_step_ms"],
            "step_ms": result["step_ms"], "cpu_ms": statistics.median(result["cpu_ms"][1:] or result["cpu_ms"]),
            "external_load_cores": None if load is None else round(load, 3),
            "ranks": ranks, **in_run_prediction(plan_path, ranks, messages)}


def run_quiet(attempt: Callable[[], dict[str, Any]], *, max_load: float, retries: int) -> dict[str, Any]:
    """``attempt()`` (a run's result with ``measured_ms`` and ``external_load_cores``), repeated while other
    processes kept more than ``max_load`` cores busy; the least disturbed attempt counts, and every
    attempt is listed."""
    attempts = []
    for _ in range(1 + retries):
        attempts.append(attempt())
        load = attempts[-1]["external_load_cores"]
        if load is not None and load <= max_load:
            break
    best = min(attempts, key=lambda a: math.inf if a["external_load_cores"] is None else a["external_load_cores"])
    return {**best, "attempts": [{"measured_ms": round(a["measured_ms"], 2),
                                  "external_load_cores": a["external_load_cores"]} for a in attempts]}


def run_torch_pipelining(steps: int, split_layer: int) -> dict[str, Any]:
    """The same split with torch.distributed.pipelining's Schedule1F1B, two processes."""
    from planner.runtime.launcher.launch import free_port
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        procs = [subprocess.Popen([sys.executable, __file__, "--torch-worker", tmp, "--steps", str(steps),
                                   "--split", str(split_layer)], env={**env, "RANK": str(r)}) for r in range(2)]
        for p in procs:
            if p.wait(timeout=600) != 0:
                raise RuntimeError("torch.distributed.pipelining worker failed")
        per_rank = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(2)]
    step_ms = [max(vals) for vals in zip(*(r["wall"] for r in per_rank))]
    cpu_ms = [sum(vals) for vals in zip(*(r["cpu"] for r in per_rank))]
    return {"measured_ms": statistics.median(step_ms[1:]), "step_ms": [round(s, 3) for s in step_ms],
            "cpu_ms": statistics.median(cpu_ms[1:])}


def torch_worker(out_dir: str, steps: int, split_layer: int) -> None:
    """One rank of the torch.distributed.pipelining baseline (started by run_torch_pipelining)."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from models.registry import build_model, lm_loss
    from planner.runtime.data import make_source

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    bundle = build_model(MODEL, batch=MICROBATCH, seq=SEQ, device="cpu", seed=0)
    model = bundle.module
    layers = list(model.layers)

    class Part(nn.Module):
        def __init__(self, first: bool) -> None:
            super().__init__()
            self.first = first
            self.embed = model.embed if first else None
            self.layers = nn.ModuleList(layers[:split_layer] if first else layers[split_layer:])
            self.head = None if first else model.head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.embed(x) if self.first else x
            for layer in self.layers:
                x = layer(x)
            return x if self.first else self.head(x)

    part = Part(rank == 0)
    act = torch.empty(MICROBATCH, SEQ, 128, device="meta", requires_grad=True)
    idx = torch.empty(MICROBATCH, SEQ, dtype=torch.long, device="meta")
    logits = torch.empty(MICROBATCH, SEQ, 256, device="meta", requires_grad=True)
    stage = PipelineStage(part, rank, 2, torch.device("cpu"), input_args=(idx,) if rank == 0 else (act,),
                          output_args=act if rank == 0 else logits)
    schedule = Schedule1F1B(stage, n_microbatches=NUM_MB, loss_fn=lm_loss)
    opt = torch.optim.Adam(part.parameters(), lr=1e-3)
    source = make_source(bundle, seq=SEQ, seed=0)
    times, cpu, last, last_cpu = [], [], time.perf_counter(), time.process_time()
    for step in range(steps):
        (x,), y = source.batch(step, MICROBATCH * NUM_MB)
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        now, now_cpu = time.perf_counter(), time.process_time()
        times.append(1e3 * (now - last))
        cpu.append(1e3 * (now_cpu - last_cpu))
        last, last_cpu = now, now_cpu
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps({"wall": times, "cpu": cpu}))
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- main
CASES = ((2, False), (2, True), (4, False), (4, True))  # (ranks, emulated heterogeneity)
SLOW = 1.0 / 3.0  # efficiency scale of the emulated slow device


def _pct(measured: float, predicted: float) -> float:
    return 100.0 * (measured - predicted) / predicted if predicted else float("nan")


def _profile_summary(profile: Path) -> dict[str, Any]:
    doc = json.loads(profile.read_text())
    layers = [b for b in doc["blocks"] if b["name"].startswith("layers.")]
    return {"efficiency": doc["device"]["efficiency"], "op_overhead_ms": doc["device"]["op_overhead_ms"],
            "peak_scale": doc["calibration"]["peak_scale"],
            "layer_fwd_ms": statistics.median(b["fwd_ms"] for b in layers),
            "layer_bwd_ms": statistics.median(b["bwd_ms"] for b in layers),
            "fit_median_abs_rel_err": doc["calibration"]["median_abs_rel_err"]}


def _predict(path: Path, cores: int, sharing=None, *, emulated: bool = False, messages=None) -> float:
    """The step time of ``path``'s plan with its ranks sharing ``cores`` cores (see the module docstring),
    at the measured ``sharing`` speeds (None: even sharing), rehearsing slower devices by padding, with
    ``messages`` costing their ends CPU time (None: free)."""
    from planner.plan_load import load_plan
    from planner.simulate import simulate
    return simulate(load_plan(path), cores=cores, sharing=sharing, emulated=emulated, messages=messages).step_ms


def overhead(tmp: Path, ch, profile: Path, link, two, steps: int, repeats: int) -> dict[str, Any]:
    """1. our runtime vs Schedule1F1B on the same split: interleaved repeats, medians."""
    homo2 = cluster(profile, [1.0, 1.0], link)
    two_path = compile_solution(hand_solution(ch, homo2, two), ch, homo2, tmp, "two")
    runs: dict[str, list[dict[str, Any]]] = {"ours": [], "torch": []}
    for i in range(repeats):
        order = ("ours", "torch") if i % 2 == 0 else ("torch", "ours")
        for who in order:
            runs[who].append(run_plan(two_path, steps, emulate=False) if who == "ours"
                             else run_torch_pipelining(steps, LAYERS // 2))
    med = {who: {k: statistics.median(r[k] for r in rs) for k in ("measured_ms", "cpu_ms")} for who, rs in runs.items()}
    return {"ours_ms": med["ours"]["measured_ms"], "torch_1f1b_ms": med["torch"]["measured_ms"],
            "ratio": med["ours"]["measured_ms"] / med["torch"]["measured_ms"], "goal_ratio": 1.05,
            "ours_cpu_ms": med["ours"]["cpu_ms"], "torch_cpu_ms": med["torch"]["cpu_ms"],
            "cpu_ratio": med["ours"]["cpu_ms"] / med["torch"]["cpu_ms"], "repeats": repeats,
            "ours_runs_ms": [r["measured_ms"] for r in runs["ours"]],
            "torch_runs_ms": [r["measured_ms"] for r in runs["torch"]],
            "ours_external_load_cores": [r["external_load_cores"] for r in runs["ours"]]}


def _timed_profile(path: Path, **kw: bool) -> tuple[Path, float]:  # kw: profile_cpu's p2p, sharing, warm
    """A fresh profile, and the cores other processes kept busy while it measured (roughly, with
    ``sharing``: its workers' CPU time counts as others')."""
    wall, busy, own = time.perf_counter(), _busy_s(), time.process_time()
    profile = profile_cpu(path, **kw)
    wall, busy, own = time.perf_counter() - wall, _busy_s() - busy, time.process_time() - own
    return profile, round(max(0.0, (busy - own) / wall), 3)


def _priced(tmp: Path, ch, link, effs: list[float], stages, cores: int, machine: Machine, name: str,
            warm_first: bool = True) -> tuple[Path, dict[str, Any]]:
    """A fresh profile of this CPU, and the case's plan priced with it: ranks sharing ``cores`` cores at
    the measured speeds, messages costing CPU time, slower devices rehearsed by padding (``predicted_ms``);
    as before the probe held a stage's microbatches and messages cost CPU (``previous_model_ms``); and
    with even sharing, padding on a core (``even_sharing_ms``); and as ``predicted_ms`` with a second
    profile whose passes were timed warm, in a tight loop (``warm_profile_ms``; taken first with
    ``warm_first``, else second, so that both kinds are as near the run on average)."""
    emulated = min(effs) < max(effs)
    kinds = (True, False) if warm_first else (False, True)
    taken = {warm: _timed_profile(tmp / f"cpu-{name}{'-warm' if warm else ''}.json", warm=warm) for warm in kinds}
    profile, load = taken[False]
    warm_cl = cluster(taken[True][0], effs, link)
    warm_path = compile_solution(hand_solution(ch, warm_cl, stages), ch, warm_cl, tmp, f"{name}-warm")
    cl = cluster(profile, effs, link)
    path = compile_solution(hand_solution(ch, cl, stages), ch, cl, tmp, name)
    return path, {**_profile_summary(profile), "external_load_cores": load,
                  "warm_profile_ms": _predict(warm_path, cores, machine.sharing, emulated=emulated,
                                              messages=machine.messages),
                  "warm_layer_fwd_ms": _profile_summary(taken[True][0])["layer_fwd_ms"],
                  "predicted_ms": _predict(path, cores, machine.sharing, emulated=emulated, messages=machine.messages),
                  "previous_model_ms": _predict(path, cores, machine.previous_sharing, emulated=emulated),
                  "no_executor_ms": _predict(path, cores, machine.sharing, emulated=emulated,
                                             messages=machine.bare_messages),
                  "even_sharing_ms": _predict(path, cores)}


def _bracketed_run(tmp: Path, ch, link, ranks: int, hetero: bool, stages, steps: int, cores: int,
                   machine: Machine, name: str) -> dict[str, Any]:
    """Profile this CPU, run the case, profile again; price the plan with each profile. The CPU's own
    speed moves on this shared host (by up to ~20% from one few-second window to the next, also with
    nothing else running in this machine), so the prediction is the mean of the two, and their
    spread shows how far it moved."""
    effs = [1.0] * (ranks - 1) + [SLOW if hetero else 1.0]
    path, before = _priced(tmp, ch, link, effs, stages, cores, machine, f"{name}-before", warm_first=True)
    run = run_plan(path, steps, emulate=hetero, messages=machine.messages)
    _, after = _priced(tmp, ch, link, effs, stages, cores, machine, f"{name}-after", warm_first=False)
    predicted = statistics.fmean((before["predicted_ms"], after["predicted_ms"]))
    previous = statistics.fmean((before["previous_model_ms"], after["previous_model_ms"]))
    even = statistics.fmean((before["even_sharing_ms"], after["even_sharing_ms"]))
    warm = statistics.fmean((before["warm_profile_ms"], after["warm_profile_ms"]))
    no_executor = statistics.fmean((before["no_executor_ms"], after["no_executor_ms"]))
    return {**run, "predicted_ms": round(predicted, 2),
            "warm_profile_ms": round(warm, 2), "warm_profile_error_pct": round(_pct(run["measured_ms"], warm), 2),
            "inrun_executor_error_pct": round(_pct(run["measured_ms"], run["inrun_executor_ms"]), 2),
            "error_pct": round(_pct(run["measured_ms"], predicted), 2),
            "previous_model_ms": round(previous, 2),
            "no_executor_ms": round(no_executor, 2),
            "no_executor_error_pct": round(_pct(run["measured_ms"], no_executor), 2),
            "previous_model_error_pct": round(_pct(run["measured_ms"], previous), 2),
            "even_sharing_ms": round(even, 2), "even_sharing_error_pct": round(_pct(run["measured_ms"], even), 2),
            "inrun_error_pct": round(_pct(run["measured_ms"], run["inrun_predicted_ms"]), 2),
            "profile_drift_pct": round(_pct(after["predicted_ms"], before["predicted_ms"]), 2),
            "profiles": [{"when": "before", **before}, {"when": "after", **after}]}


def prediction(tmp: Path, ch, link, ranges, steps: int, repeats: int, cores: int, machine: Machine,
               quiet: dict[str, float]) -> dict[str, Any]:
    """2. simulated vs measured, every case once per repeat (cases interleaved), each run priced with
    profiles of this CPU taken just before and just after it."""
    runs: dict[tuple[int, bool], list[dict[str, Any]]] = {case: [] for case in CASES}
    for i in range(repeats):
        order = CASES[i % len(CASES):] + CASES[:i % len(CASES)]  # a different case goes first each repeat
        for ranks, hetero in order:
            names = (f"p{ranks}{int(hetero)}-{i}-{n}" for n in itertools.count())
            res = run_quiet(lambda r=ranks, h=hetero, names=names: _bracketed_run(
                tmp, ch, link, r, h, ranges[r], steps, cores, machine, next(names)), **quiet)
            runs[(ranks, hetero)].append({"repeat": i, **res})
    rows = []
    for (ranks, hetero), rs in runs.items():
        calm_runs = [r for r in rs if r["external_load_cores"] is not None
                     and r["external_load_cores"] <= quiet["max_load"]]
        calm = [r["error_pct"] for r in calm_runs]
        rows.append({"ranks": ranks, "emulated_heterogeneity": hetero,
                     "quiet_error_pct": statistics.median(calm) if calm else None, "quiet_runs": len(calm),
                     "quiet_inrun_error_pct": (statistics.median(r["inrun_error_pct"] for r in calm_runs)
                                               if calm_runs else None),
                     "predicted_ms": statistics.median(r["predicted_ms"] for r in rs),
                     "measured_ms": statistics.median(r["measured_ms"] for r in rs),
                     "plan_predicted_ms": statistics.median(r["plan_predicted_ms"] for r in rs),
                     "error_pct": statistics.median(r["error_pct"] for r in rs),
                     "error_pcts": [r["error_pct"] for r in rs],
                     "previous_model_ms": statistics.median(r["previous_model_ms"] for r in rs),
                     "previous_model_error_pct": statistics.median(r["previous_model_error_pct"] for r in rs),
                     "previous_model_error_pcts": [r["previous_model_error_pct"] for r in rs],
                     "no_executor_error_pct": statistics.median(r["no_executor_error_pct"] for r in rs),
                     "no_executor_error_pcts": [r["no_executor_error_pct"] for r in rs],
                     "even_sharing_ms": statistics.median(r["even_sharing_ms"] for r in rs),
                     "even_sharing_error_pct": statistics.median(r["even_sharing_error_pct"] for r in rs),
                     "inrun_predicted_ms": statistics.median(r["inrun_predicted_ms"] for r in rs),
                     "inrun_error_pct": statistics.median(r["inrun_error_pct"] for r in rs),
                     "inrun_error_pcts": [r["inrun_error_pct"] for r in rs],
                     "warm_profile_ms": statistics.median(r["warm_profile_ms"] for r in rs),
                     "warm_profile_error_pct": statistics.median(r["warm_profile_error_pct"] for r in rs),
                     "warm_profile_error_pcts": [r["warm_profile_error_pct"] for r in rs],
                     "inrun_executor_error_pct": statistics.median(r["inrun_executor_error_pct"] for r in rs),
                     "inrun_executor_error_pcts": [r["inrun_executor_error_pct"] for r in rs],
                     "inrun_messages_error_pcts": [None if r["inrun_messages_ms"] is None
                                                   else round(_pct(r["measured_ms"], r["inrun_messages_ms"]), 2)
                                                   for r in rs],
                     "pass_scale": [r["pass_scale"] for r in rs],
                     "pass_cpu_over_profile": [r["pass_cpu_over_profile"] for r in rs],
                     "profile_drift_pcts": [r["profile_drift_pct"] for r in rs],
                     "external_load_cores": [r["external_load_cores"] for r in rs], "runs": rs})
    return {"goal_abs_error_pct": 10.0, "cores": cores,
            "error_pct": "median over repeats of (measured - predicted) / predicted; each run is priced with the "
                         "mean of two profiles of this CPU, one just before and one just after it",
            "quiet_error_pct": "the same over the runs during which other processes kept at most "
                               f"{quiet['max_load']} cores busy (quiet_runs of them)",
            "previous_model_error_pct": "the same, priced as before the sharing probe held a stage's microbatches "
                                        "in flight and messages cost CPU time",
            "inrun_messages_error_pcts": "as inrun_error_pct, with the messages' CPU time and the executor's own "
                                         "(per message and per pass, measured by the profile's executor probe) "
                                         "priced too",
            "no_executor_error_pct": "as error_pct, priced without the executor probe's costs (messages cost "
                                     "only the P2P probe's CPU time: the model before it)",
            "inrun_executor_error_pct": "as inrun_error_pct, with each rank's measured comm_ms (posting messages) "
                                        "and other_ms (executor time outside passes, waits and the optimizer) "
                                        "added to its passes: the part of the in-run gap the simulator leaves "
                                        "unpriced",
            "warm_profile_error_pct": "as error_pct, priced with profiles whose block passes were timed in a "
                                      "tight loop (warm caches; the profile's method before the eviction sweep), "
                                      "taken in the same brackets",
            "even_sharing_error_pct": "the same, priced as before the core sharing table: passes that overlap "
                                      "split the cores evenly, and an emulated device's padding holds a core",
            "inrun_error_pct": "measured against the plan simulated with the pass and optimizer times measured "
                               "in the same run (a device per rank: the wall times include the sharing): the "
                               "simulator's composition alone, without the profile",
            "pass_scale": "per run and rank: measured compute (+ padding) wall time over the planned, one device each",
            "pass_cpu_over_profile": "per run and rank: the passes' CPU time in the run over the profile's time "
                                     "of the same passes alone (CPU time inflated by company on the cores, or drift)",
            "rows": rows}


def planning(tmp: Path, ch, profile: Path, link, steps: int, repeats: int, cores: int, machine: Machine,
             quiet: dict[str, float]) -> dict[str, Any]:
    """3. the solver's plan vs the uniform and parameter-balanced baselines', emulated, interleaved."""
    from planner.solver.api import solve
    from planner.solver.baseline_plans import baseline
    from planner.solver.policy import VerificationPolicy
    cl = cluster(profile, [1.0, SLOW], link)
    cfg, policy = config(), VerificationPolicy(enabled=False)
    sols = {"solver": solve(ch, cl, cfg, policy, time_limit_s=20, workers=1),
            "uniform": baseline("uniform", ch, cl, cfg, policy),
            "params": baseline("params", ch, cl, cfg, policy)}
    paths = {name: compile_solution(sol, ch, cl, tmp, f"plan-{name}") for name, sol in sols.items()}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in sols}
    names = list(sols)
    for i in range(repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:
            runs[name].append(run_quiet(lambda name=name: run_plan(paths[name], steps, emulate=True), **quiet))
    # The same plans priced again with a profile taken after their runs: the CPU's speed drifts, so the
    # prediction is the mean of the two, as in section 2.
    after, _ = _timed_profile(tmp / "cpu-after-planning.json")
    cl_after = cluster(after, [1.0, SLOW], link)
    out = []
    for name, sol in sols.items():
        rs = runs[name]
        again = compile_solution(sol, ch, cl_after, tmp, f"plan-{name}-after")
        priced = [_predict(p, cores, machine.sharing, emulated=True, messages=machine.messages)
                  for p in (paths[name], again)]
        out.append({"plan": name, "stages": [[s.first_block, s.last_block, list(s.devices)] for s in sol.stages],
                    "predicted_ms": statistics.fmean(priced), "predicted_before_after_ms": priced,
                    "measured_ms": statistics.median(r["measured_ms"] for r in rs),
                    "measured_runs_ms": [r["measured_ms"] for r in rs],
                    "external_load_cores": [r["external_load_cores"] for r in rs]})
    fastest = min(out, key=lambda r: r["measured_ms"])["plan"]
    return {"plans": out, "fastest_measured": fastest, "cluster_efficiency_scales": [1.0, SLOW]}


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--torch-worker", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repeats of every measurement")
    ap.add_argument("--max-external-load", type=float, default=0.3,
                    help="cores other processes may keep busy during a run before it is repeated (default 0.3)")
    ap.add_argument("--retries", type=int, default=None, help="extra attempts of a disturbed run")
    ap.add_argument("--split", type=int, default=LAYERS // 2, help=argparse.SUPPRESS)
    ap.add_argument("--sections", default="overhead,prediction,planning",
                    help="comma-separated subset of overhead, prediction, planning (default: all three)")
    ap.add_argument("--out", type=Path, default=None,
                    help=f"result JSON (default {RESULTS.relative_to(ROOT)}; with --quick: none written)")
    args = ap.parse_args(argv)
    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    if not sections or sections - {"overhead", "prediction", "planning"}:
        ap.error(f"--sections: expected a subset of overhead,prediction,planning, found {args.sections!r}")
    if args.torch_worker:
        torch_worker(args.torch_worker, args.steps, args.split)
        return 0
    steps = args.steps or (3 if args.quick else 16)
    repeats = args.repeats or (1 if args.quick else 4)
    quiet = {"max_load": args.max_external_load, "retries": args.retries if args.retries is not None
             else (0 if args.quick else 2)}
    cores = os.cpu_count() or 1
    os.chdir(ROOT)
    console = Console()
    out: dict[str, Any] = {"model": MODEL, "microbatch": MICROBATCH, "num_microbatches": NUM_MB, "seq": SEQ,
                           "steps": steps, "repeats": repeats, "threads_per_rank": 1, "cpu_count": cores,
                           "max_external_load_cores": quiet["max_load"], "retries": quiet["retries"],
                           "load_avg_at_start": list(os.getloadavg())}
    if args.quick:  # a smoke run: the overhead section on a light profile, nothing else measured
        with tempfile.TemporaryDirectory() as tmp_dir:
            out["vs_torch_pipelining"] = _quick_overhead(Path(tmp_dir), steps, repeats)
        _print(console, out)
        return _write(console, out, args.out)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        console.print("profiling this CPU (single thread), its cores shared, and gloo between two local processes ...")
        first, first_load = _timed_profile(tmp / "cpu0.json", p2p=True, sharing=True)
        out["first_profile_machine_load_cores"] = first_load
        link = local_link(first)
        out["local_link"] = link
        from cost_models.measured import load_message_cost, load_sharing
        from planner.profiling.sharing import measure_core_sharing
        sharing = load_sharing(first)
        previous = measure_core_sharing(model=MODEL, batch=MICROBATCH, seq=SEQ, processes=2 * cores,
                                        window_s=sharing.window_s, rounds=sharing.rounds, microbatches=1)
        messages = load_message_cost(first)
        bare = None if messages is None else replace(messages, executor_ms=0.0, executor_pass_ms=0.0)
        machine = Machine(sharing=sharing, messages=messages, previous_sharing=previous, bare_messages=bare)
        out["core_sharing"] = sharing.to_dict()
        out["core_sharing_one_microbatch"] = previous.to_dict()
        out["message_cpu"] = None if machine.messages is None else machine.messages.to_dict()
        out["executor_probe"] = json.loads(first.read_text())["p2p"].get("executor")
        ch = chain()
        half = LAYERS // 2  # blocks: embed, layers.0..7, head
        ranges = {2: [(0, half), (half + 1, LAYERS + 1)], 4: [(0, 2), (3, 4), (5, 6), (7, LAYERS + 1)]}
        if "overhead" in sections:
            console.print("1. overhead vs torch.distributed.pipelining ...")
            out["vs_torch_pipelining"] = overhead(tmp, ch, first, link, ranges[2], steps, 2 * repeats)
        if "prediction" in sections:
            console.print("2. predicted vs measured ...")
            out["predicted_vs_measured"] = prediction(tmp, ch, link, ranges, steps, repeats, cores, machine, quiet)
        if "planning" in sections:
            console.print("3. solver vs baselines ...")
            out["solver_vs_baselines"] = planning(tmp, ch, first, link, steps, repeats, cores, machine, quiet)
    out["load_avg_at_end"] = list(os.getloadavg())
    _print(console, out)
    return _write(console, out, args.out or RESULTS)


def _quick_overhead(tmp: Path, steps: int, repeats: int) -> dict[str, Any]:
    """Section 1 on a profile of the blocks alone and a nominal local link (no p2p, sharing or executor probe)."""
    from planner.profiling.profile import ProfileSettings, profile_device, write_profile
    settings = replace(ProfileSettings.quick(MODEL), batch=MICROBATCH, seq=SEQ, p2p=False, sharing=False)
    profile = write_profile(profile_device(settings), tmp / "cpu-quick.json")
    link = {"bandwidth_gbps": 10.0, "latency_ms": 0.05}
    half = LAYERS // 2
    return overhead(tmp, chain(), profile, link, [(0, half), (half + 1, LAYERS + 1)], steps, repeats)


def _write(console, out: dict[str, Any], path: Path | None) -> int:
    """Write the results JSON atomically (``path`` None: a quick run, nothing written)."""
    if path is None:
        return 0
    target = path.resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = target.with_suffix(".json.tmp")
    tmp_out.write_text(json.dumps(out, indent=1) + "\n")
    os.replace(tmp_out, target)
    console.print(f"wrote {target}")
    return 0


def _print(console, out: dict[str, Any]) -> None:
    if "vs_torch_pipelining" in out:
        _print_overhead(console, out["vs_torch_pipelining"])
    if "predicted_vs_measured" in out:
        _print_prediction(console, out)
    if "solver_vs_baselines" in out:
        _print_planning(console, out["solver_vs_baselines"])


def _print_overhead(console, vs: dict[str, Any]) -> None:
    from rich.table import Table
    t = Table(title=f"1. runtime overhead (2 ranks, same split, 1F1B; median of {vs['repeats']} interleaved runs)")
    for c in ("", "ours", "torch Schedule1F1B", "ratio", "goal"):
        t.add_column(c, justify="right")
    t.add_row("wall ms/step", f"{vs['ours_ms']:.1f}", f"{vs['torch_1f1b_ms']:.1f}", f"{vs['ratio']:.3f}", "<= 1.05")
    t.add_row("CPU ms/step (all ranks)", f"{vs['ours_cpu_ms']:.1f}", f"{vs['torch_cpu_ms']:.1f}",
              f"{vs['cpu_ratio']:.3f}", "")
    console.print(t)


def _print_prediction(console, out: dict[str, Any]) -> None:
    from rich.table import Table
    pvm = out["predicted_vs_measured"]
    t = Table(title=f"2. simulator vs measured (ranks share {pvm['cores']} cores; median of {out['repeats']} "
                    "repeats, each run priced with profiles just before and after it; quiet: others used <= "
                    f"{out['max_external_load_cores']} cores)")
    for c in ("ranks", "emulated", "predicted ms", "previous model ms", "even sharing ms", "from in-run passes ms",
              "measured ms", "error %", "no executor %", "warm profile %", "previous %", "even %", "in-run %",
              "in-run + probe %", "in-run + own comm+other %",
              "quiet runs: error %", "per repeat %", "others' load (cores)"):
        t.add_column(c, justify="right")
    for r in pvm["rows"]:
        calm = "-" if r["quiet_error_pct"] is None else f"{r['quiet_error_pct']:+.1f} ({r['quiet_runs']})"
        t.add_row(str(r["ranks"]), "yes" if r["emulated_heterogeneity"] else "no", f"{r['predicted_ms']:.1f}",
                  f"{r['previous_model_ms']:.1f}", f"{r['even_sharing_ms']:.1f}", f"{r['inrun_predicted_ms']:.1f}",
                  f"{r['measured_ms']:.1f}", f"{r['error_pct']:+.1f}", f"{r['no_executor_error_pct']:+.1f}",
                  f"{r['warm_profile_error_pct']:+.1f}",
                  f"{r['previous_model_error_pct']:+.1f}", f"{r['even_sharing_error_pct']:+.1f}",
                  f"{r['inrun_error_pct']:+.1f}", _median_pct(r["inrun_messages_error_pcts"]),
                  f"{r['inrun_executor_error_pct']:+.1f}", calm,
                  " ".join(f"{e:+.0f}" for e in r["error_pcts"]),
                  " ".join("?" if x is None else f"{x:.2f}" for x in r["external_load_cores"]))
    console.print(t)


def _median_pct(values: list[float | None]) -> str:
    kept = [v for v in values if v is not None]
    return f"{statistics.median(kept):+.1f}" if kept else "-"


def _print_planning(console, plans: dict[str, Any]) -> None:
    from rich.table import Table
    t = Table(title="3. plans on an emulated heterogeneous cluster (this CPU + one at 1/3 of its efficiency)")
    for c in ("plan", "stages [first, last, devices]", "predicted ms", "measured ms", "runs ms"):
        t.add_column(c, justify="right")
    for r in plans["plans"]:
        t.add_row(r["plan"], str(r["stages"]), f"{r['predicted_ms']:.1f}", f"{r['measured_ms']:.1f}",
                  " ".join(f"{x:.0f}" for x in r["measured_runs_ms"]))
    console.print(t)
    console.print(f"fastest measured: {plans['fastest_measured']}")


if __name__ == "__main__":
    sys.exit(main())
