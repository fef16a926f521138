"""Runtime benchmark: our executor vs torch.distributed.pipelining, predicted vs measured, solver vs baselines.

Three measurements on this machine (gloo, one thread per rank), on an 8-layer
byte-level GPT (d=128, T=64, microbatch 4, 4 microbatches):

1. **Overhead**: step time of our runtime vs ``torch.distributed.pipelining``'s
   ``Schedule1F1B`` on the same 2-stage split and microbatches (goal: ratio <= 1.05).
2. **Prediction**: the simulator's step time (plan.predicted, priced with a
   profile of this CPU) vs the measured one, for 2- and 4-rank plans, with and
   without emulated heterogeneity (one device at a third of the profiled
   efficiency, padded by ``--emulate-speed``) (goal: within 10%).
3. **Planning**: measured step time of the solver's plan vs the uniform and
   parameter-balanced baselines' plans on an emulated heterogeneous 2-device
   cluster (fast + slow).

    python benchmarks/runtime.py            # writes benchmarks/results/runtime.json
    python benchmarks/runtime.py --quick    # fewer steps (a smoke run)

Run from the repository root: the ranks import this file's model factory.
Timings on a shared machine are noisy; 4 ranks on 2 cores oversubscribe the
CPU, which the simulator (one device per rank) does not model.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

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


def profile_cpu(path: Path) -> Path:
    """A quick single-thread profile of this CPU, calibrated on the benchmark model's own blocks."""
    from cost_models.profile import ProfileSettings, profile_device, write_profile
    torch.set_num_threads(1)
    settings = ProfileSettings(model=MODEL, batch=MICROBATCH, seq=SEQ, matmul_size=512, copy_bytes=32 << 20,
                               repeats=3, p2p=False)
    return write_profile(profile_device(settings), path)


def cluster(profile: Path, efficiencies: list[float]):
    """One host per device, all this CPU's profile; a device's efficiency scale makes it slower."""
    from cost_models.cluster import ClusterSpec
    base = json.loads(profile.read_text())["device"]["efficiency"]
    hosts = [{"name": f"cpu{i}", "region": "local", "trust": "operator", "trusted": True,
              "devices": [{"type": str(profile), "count": 1, "efficiency": min(1.0, base * e)}]}
             for i, e in enumerate(efficiencies)]
    # local gloo between processes: ~0.05 ms latency, a few GB/s
    return ClusterSpec.from_dict({"name": "bench", "hosts": hosts,
                                  "links": {"intra_host": {"bandwidth_gbps": 20, "latency_ms": 0.05},
                                            "default": {"bandwidth_gbps": 20, "latency_ms": 0.05}}})


def config(schedule: str = "1f1b"):
    from cost_models.training import TrainingConfig
    return TrainingConfig(global_batch=MICROBATCH * NUM_MB, microbatch_size=MICROBATCH, schedule=schedule,
                          optimizer="adam")


def compile_solution(solution, ch, cl, folder: Path, name: str) -> Path:
    from planner.compile import compile_plan
    from planner.plan import ModelRef
    from planner.solver.policy import VerificationPolicy
    ref = ModelRef(spec=MODEL, name="bench-gpt", fingerprint=ch.fingerprint, batch=MICROBATCH, seq=SEQ)
    plan = compile_plan(solution, ch, cl, config(solution.schedule), VerificationPolicy(enabled=False), ref)
    return plan.save(folder / f"{name}.json")


def hand_solution(ch, cl, ranges: list[tuple[int, int]]):
    from planner.solver.solution import SolveReport, Solution, StagePlacement
    ids = [d.id for d in cl.devices]
    stages = tuple(StagePlacement(index=k, first_block=lo, last_block=hi, devices=(ids[k],),
                                  microbatches=(NUM_MB,)) for k, (lo, hi) in enumerate(ranges))
    report = SolveReport(method="hand", status="FEASIBLE", objective_ms=0.0, bound_ms=None, gap=None, solve_s=0.0)
    return Solution(stages=stages, verifiers=(), num_microbatches=NUM_MB, schedule="1f1b", predicted_step_ms=0.0,
                    memory_bytes=(), report=report)


# --------------------------------------------------------------------------- runs
def run_ours(plan_path: Path, steps: int, *, emulate: bool) -> dict[str, Any]:
    from planner.runtime.launch import RunOptions, launch
    result = launch(RunOptions(plan=str(plan_path), steps=steps, timeout_s=120, emulate=emulate))
    return {"measured_ms": result["measured_step_ms"], "predicted_ms": result["predicted_step_ms"],
            "step_ms": result["step_ms"], "cpu_ms": statistics.median(result["cpu_ms"][1:] or result["cpu_ms"])}


def run_torch_pipelining(steps: int, split_layer: int) -> dict[str, Any]:
    """The same split with torch.distributed.pipelining's Schedule1F1B, two processes."""
    from planner.runtime.launch import free_port
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
def _pct(measured: float, predicted: float) -> float:
    return 100.0 * (measured - predicted) / predicted if predicted else float("nan")


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    from planner.solver.api import baseline, solve
    from planner.solver.policy import VerificationPolicy

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--torch-worker", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repeats of the overhead comparison")
    ap.add_argument("--split", type=int, default=LAYERS // 2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.torch_worker:
        torch_worker(args.torch_worker, args.steps, args.split)
        return 0
    steps = args.steps or (4 if args.quick else 8)
    args.repeats = args.repeats or (1 if args.quick else 3)
    os.chdir(ROOT)
    console = Console()
    out: dict[str, Any] = {"model": MODEL, "microbatch": MICROBATCH, "num_microbatches": NUM_MB, "seq": SEQ,
                           "steps": steps, "threads_per_rank": 1, "cpu_count": os.cpu_count(),
                           "load_avg_at_start": list(os.getloadavg())}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        console.print("profiling this CPU (single thread) ...")
        profile = profile_cpu(tmp / "cpu.json")
        ch = chain()
        half = LAYERS // 2  # blocks: embed, layers.0..7, head
        two = [(0, half), (half + 1, LAYERS + 1)]
        four = [(0, 2), (3, 4), (5, 6), (7, LAYERS + 1)]

        # 1. overhead vs torch.distributed.pipelining on the same split: interleaved repeats, medians
        homo2 = cluster(profile, [1.0, 1.0])
        two_path = compile_solution(hand_solution(ch, homo2, two), ch, homo2, tmp, "two")
        runs: dict[str, list[dict[str, Any]]] = {"ours": [], "torch": []}
        for i in range(args.repeats):
            order = ("ours", "torch") if i % 2 == 0 else ("torch", "ours")
            for who in order:
                runs[who].append(run_ours(two_path, steps, emulate=False) if who == "ours"
                                 else run_torch_pipelining(steps, half))
        ours = runs["ours"][0]
        med = {who: {k: statistics.median(r[k] for r in rs) for k in ("measured_ms", "cpu_ms")}
               for who, rs in runs.items()}
        out["vs_torch_pipelining"] = {
            "ours_ms": med["ours"]["measured_ms"], "torch_1f1b_ms": med["torch"]["measured_ms"],
            "ratio": med["ours"]["measured_ms"] / med["torch"]["measured_ms"], "goal_ratio": 1.05,
            "ours_cpu_ms": med["ours"]["cpu_ms"], "torch_cpu_ms": med["torch"]["cpu_ms"],
            "cpu_ratio": med["ours"]["cpu_ms"] / med["torch"]["cpu_ms"], "repeats": args.repeats,
            "ours_runs_ms": [r["measured_ms"] for r in runs["ours"]],
            "torch_runs_ms": [r["measured_ms"] for r in runs["torch"]]}

        # 2. predicted vs measured
        rows = []
        for ranks, ranges in ((2, two), (4, four)):
            for hetero in (False, True):
                effs = [1.0] * ranks
                if hetero:
                    effs[-1] = 1.0 / 3.0
                cl = cluster(profile, effs)
                path = compile_solution(hand_solution(ch, cl, ranges), ch, cl, tmp, f"p{ranks}{int(hetero)}")
                res = ours if (ranks, hetero) == (2, False) else run_ours(path, steps, emulate=hetero)
                if (ranks, hetero) == (2, False):
                    res = {**res, "predicted_ms": json.loads(path.read_text())["predicted"]["step_ms"]}
                rows.append({"ranks": ranks, "emulated_heterogeneity": hetero, "predicted_ms": res["predicted_ms"],
                             "measured_ms": res["measured_ms"], "error_pct": _pct(res["measured_ms"],
                                                                                  res["predicted_ms"])})
        out["predicted_vs_measured"] = {"goal_abs_error_pct": 10.0, "rows": rows}

        # 3. solver vs baselines on an emulated heterogeneous cluster (fast + slow at 1/3 efficiency)
        cl = cluster(profile, [1.0, 1.0 / 3.0])
        cfg, policy = config(), VerificationPolicy(enabled=False)
        plans = {"solver": solve(ch, cl, cfg, policy, time_limit_s=20, workers=1),
                 "uniform": baseline("uniform", ch, cl, cfg, policy),
                 "params": baseline("params", ch, cl, cfg, policy)}
        planning = []
        for name, sol in plans.items():
            path = compile_solution(sol, ch, cl, tmp, f"plan-{name}")
            res = run_ours(path, steps, emulate=True)
            planning.append({"plan": name, "stages": [[s.first_block, s.last_block, list(s.devices)]
                                                      for s in sol.stages],
                             "predicted_ms": res["predicted_ms"], "measured_ms": res["measured_ms"]})
        out["solver_vs_baselines"] = planning
    out["load_avg_at_end"] = list(os.getloadavg())
    _print(console, out)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = RESULTS.with_suffix(".json.tmp")
    tmp_out.write_text(json.dumps(out, indent=1) + "\n")
    os.replace(tmp_out, RESULTS)
    console.print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0


def _print(console, out: dict[str, Any]) -> None:
    from rich.table import Table
    vs = out["vs_torch_pipelining"]
    t = Table(title=f"1. runtime overhead (2 ranks, same split, 1F1B; median of {vs['repeats']} interleaved runs)")
    for c in ("", "ours", "torch Schedule1F1B", "ratio", "goal"):
        t.add_column(c, justify="right")
    t.add_row("wall ms/step", f"{vs['ours_ms']:.1f}", f"{vs['torch_1f1b_ms']:.1f}", f"{vs['ratio']:.3f}", "<= 1.05")
    t.add_row("CPU ms/step (all ranks)", f"{vs['ours_cpu_ms']:.1f}", f"{vs['torch_cpu_ms']:.1f}",
              f"{vs['cpu_ratio']:.3f}", "")
    console.print(t)
    t = Table(title="2. simulator vs measured")
    for c in ("ranks", "emulated heterogeneity", "predicted ms", "measured ms", "error %"):
        t.add_column(c, justify="right")
    for r in out["predicted_vs_measured"]["rows"]:
        t.add_row(str(r["ranks"]), "yes" if r["emulated_heterogeneity"] else "no", f"{r['predicted_ms']:.1f}",
                  f"{r['measured_ms']:.1f}", f"{r['error_pct']:+.1f}")
    console.print(t)
    t = Table(title="3. plans on an emulated heterogeneous cluster (fast + 1/3-speed device)")
    for c in ("plan", "stages [first, last, devices]", "predicted ms", "measured ms"):
        t.add_column(c, justify="right")
    for r in out["solver_vs_baselines"]:
        t.add_row(r["plan"], str(r["stages"]), f"{r['predicted_ms']:.1f}", f"{r['measured_ms']:.1f}")
    console.print(t)


if __name__ == "__main__":
    sys.exit(main())
