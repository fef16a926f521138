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
import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._runtime_pricing import timed_profile
from benchmarks._runtime_report import print_results, write_results
from benchmarks._runtime_sections import overhead, planning, prediction
from benchmarks._runtime_setup import (  # bench_gpt: the model the ranks import (MODEL)
    LAYERS,
    MICROBATCH,
    MODEL,
    NUM_MB,
    SEQ,
    Machine,
    bench_gpt,
    chain,
    local_link,
)
from benchmarks._runtime_torch import torch_worker

__all__ = ["bench_gpt", "main"]

RESULTS = ROOT / "benchmarks" / "results" / "runtime.json"


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
        print_results(console, out)
        return write_results(console, out, args.out)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        console.print("profiling this CPU (single thread), its cores shared, and gloo between two local processes ...")
        first, first_load = timed_profile(tmp / "cpu0.json", p2p=True, sharing=True)
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
    print_results(console, out)
    return write_results(console, out, args.out or RESULTS)


def _quick_overhead(tmp: Path, steps: int, repeats: int) -> dict[str, Any]:
    """Section 1 on a profile of the blocks alone and a nominal local link (no p2p, sharing or executor probe)."""
    from planner.profiling.profile import ProfileSettings, profile_device, write_profile
    settings = replace(ProfileSettings.quick(MODEL), batch=MICROBATCH, seq=SEQ, p2p=False, sharing=False)
    profile = write_profile(profile_device(settings), tmp / "cpu-quick.json")
    link = {"bandwidth_gbps": 10.0, "latency_ms": 0.05}
    half = LAYERS // 2
    return overhead(tmp, chain(), profile, link, [(0, half), (half + 1, LAYERS + 1)], steps, repeats)


if __name__ == "__main__":
    sys.exit(main())
