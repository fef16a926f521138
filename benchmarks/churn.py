"""Churn benchmark (issue 21): how fast a run recovers from a lost worker, and what that buys under churn.

Part 1, re-plan time. For three plans, plan once, drop one host the plan runs on, and time
``planner.replan.replan`` (wall and CPU time of the whole re-plan: solve, compile, simulate, baselines); its
objective and simulated step against a fresh plan of the reduced cluster at the same time limit (the re-plan is
warm-started from the old plan, ``replan(warm=True)``, the runtime's default; the fresh one is
``replan(warm=False)``: every microbatch size, no warm start):

* 8 devices: the packaged ``default`` cluster (2 A100, 2 volunteers' RTX3090, 2 T4, an L4, a CPU verifier
  host) with gpt-medium in fp32, global batch 16 (the README's main job); a volunteer is lost;
* 64 devices: DT-FM's ``worldwide`` case (``benchmarks/clusters/dtfm-worldwide.yaml``, 64 one-V100 hosts)
  with gpt-1.3b, 512 x 2048 tokens, fp16, no verification (as ``benchmarks/peers.py``); the host of a
  middle stage's rank is lost;
* 176 devices: the solver benchmark's 1000-block x 176-device case (``benchmarks/warm_replan.py``'s builders:
  a tiered cluster, a seeded GPT-like chain, global batch 32); the host ``warm_replan`` loses first (a
  volunteer the plan uses, else the data-centre host with most of its ranks: 8 GPUs at once).

Part 2, end-to-end recovery of a local 4-rank run: gpt-tiny on four one-CPU hosts (4 stages, one thread per
rank), ``launch_replanning`` with one re-plan allowed (``--replan-on-failure 1``), the default ``--timeout``
(60 s) and re-plan time limit (30 s), checkpoints every 5 steps. When rank 0 reports step K the benchmark
SIGKILLs the rank of a middle stage. The launcher records no timestamps of its own, so they come from this
process's clock: the kill; the start and end of the ``replan`` call (the benchmark wraps
``planner.runtime.launcher.elastic.replan`` to time it, nothing else changes); rank 0's first step event after the
resume (its events are polled every 50 ms); and the times the surviving ranks wrote their error records (file
times) and exited (polled every 20 ms). Detection = kill -> re-plan starts (the others noticing, exiting,
and the launcher naming the root cause); reload = re-plan ends -> first resumed step reported, less that
step's own period (process start, rendezvous, checkpoint load and re-sharding). The same plan also runs
once without a failure (its step time), and the run with a failure is repeated (``--trials``, 2): each
run's wall time from rank 0's first step event to its last is predicted from the steps and the other
runs' recovery, a check of the model's recovery figure on a real churn run. ``--survivors`` runs only a
variant (added to the results file as ``local_survivors``): the same model and batch on a hand-made plan whose
middle stage has two replicas, losing a replica (the survivors' state is whole: the resume redoes nothing)
or the last stage's only rank (it is not: the checkpoint is used); per run, the steps redone (the newest step
a survivor had completed less the step resumed after) beside the same timings.

Part 3, throughput under churn: a model computed from the measured pieces (``ChurnCase``; tested by
``tests/unit/test_churn_model.py``). A run of T steps loses a worker every N steps; checkpoints every C steps;
a failure strikes uniformly within a checkpoint interval, so C/2 steps are redone on average:

* Stagewise: each failure costs detection + re-plan + reload (measured) and C/2 redone steps, redone at the
  re-planned plan's simulated step, or none where every stage on the lost host keeps a replica elsewhere
  (``lost_stages_kept``: the run resumes from the survivors' state, ``planner.runtime.recovery.survivors``); the run goes on at that step. A replacement device comes W = 60 s after
  the failure; when it pays, it is planned back in at the first checkpoint after that (a re-plan + reload,
  nothing detected or redone) and the rest of the interval runs at the original step; ``no_rejoin``: it
  never is (every step after the first failure at the re-planned step);
* checkpoint-restart (torchrun elastic): each failure costs detection + a W = 60 s wait for a replacement +
  reload and C/2 redone steps, all at the original plan's step;
* no failures: T steps at the original step.
Two more columns bound what recovery could buy: ``no_redo`` (Stagewise resuming from the surviving replicas'
state with nothing redone: ``planner.runtime.recovery.survivors``; it needs every lost stage kept by a replica and
the survivors stopped after the same step) and ``ceiling``
(failures that cost nothing: restart time over the no-failure time, the most any recovery can reach; where
it is under 1.5x, the goal cannot be met against a 60 s wait).
Checkpoint writes cost the same in both and are left out. Throughput = T x global batch / time (samples/s);
ratios are the same in tokens. Detection and reload are the local run's (mean over the trials) for every
plan; the re-plan time and the steps are each plan's own (simulated steps; the local row: measured steps).

Goals: re-plan <= 10 s at 176 devices; end-to-end recovery of the local run <= 30 s; under churn >= 1.5x
the throughput of checkpoint-restart.

Run: ``python benchmarks/churn.py [--quick] [--limit S] [--output PATH]`` (``--remodel``: part 3 again from
the measurements in the results file). Prints tables and writes
``benchmarks/results/churn.json`` (``--quick``, a smoke run: the 8-device cluster with gpt-tiny at 1 s limits,
one local run of 3 ranks whose no-failure step is the run's own, nothing written unless ``--output`` is given).
Wall times are noisy on a shared machine.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._churn_config import CHECKPOINT_EVERY, CHURN_STEPS, GOALS, QUICK, WAIT_S
from benchmarks._churn_local import local_run, print_local
from benchmarks._churn_model import (  # the model's names, as tests/unit/test_churn_model.py imports them
    ChurnCase,
    churn_row,
    churn_table,
    print_churn,
    restart_s,
    stagewise_s,
    steady_s,
)
from benchmarks._churn_replan import print_replan, replan_case
from benchmarks._churn_survivors import print_survivors, survivors_run

__all__ = ["ChurnCase", "churn_row", "main", "restart_s", "stagewise_s", "steady_s"]

RESULTS = ROOT / "benchmarks" / "results" / "churn.json"


def _summary(replans, local, churn) -> dict[str, Any]:
    r176 = next((r for r in replans if r["devices"] == 176), None)
    return {"replan_176_wall_s": r176["replan"]["wall_s"] if r176 else None,
            "local_recovery_mean_s": local["recovery_s"],
            "local_recovery_max_s": max(t["recovery_s"] for t in local["trials"]),
            "stagewise_vs_restart": {f"{r['plan']} N={r['every']}": r["stagewise_vs_restart"] for r in churn},
            "ceiling_vs_restart": {f"{r['plan']} N={r['every']}": r["ceiling_vs_restart"] for r in churn}}


def _write(out: Path, doc: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=lambda v: None if isinstance(v, float) and math.isnan(v) else v)
                   + "\n")
    os.replace(tmp, out)
    print(f"wrote {out}")


def _remodel(path: Path, devices: list[int] | None, limit: float, first_limit: float, workers: int) -> int:
    doc = json.loads(path.read_text())
    for n in devices or ():  # these re-plan cases measured again, the local runs kept
        row = replan_case(n, limit, first_limit, workers)
        print_replan(row)
        doc["replan"] = [row if r["devices"] == n else r for r in doc["replan"]]
    doc["churn"] = churn_table(doc["replan"], doc["local"])
    for row in doc["churn"]:
        print_churn(row)
    doc["summary"] = _summary(doc["replan"], doc["local"], doc["churn"])
    doc["model"] = __doc__.split("Part 3, ")[1].split("Goals:")[0].strip()
    _write(path, doc)
    return 0


def _survivors_only(path: Path) -> int:
    import torch
    torch.set_num_threads(1)
    print("== local runs that lose a replica (rank 2: its twin is rank 1) or a sole stage rank (rank 3)", flush=True)
    result = survivors_run(steps=30, every=CHECKPOINT_EVERY, kills=[(2, 12), (2, 15), (3, 15)])
    print_survivors(result)
    doc = json.loads(path.read_text()) if path.is_file() else {"benchmark": "churn"}
    doc["local_survivors"] = result
    _write(path, doc)
    return 0


def _warm() -> None:
    import torch

    from planner.solver.bound.sequence_dp_kernel import warm as warm_kernels
    from planner.solver.search.seq_partition_kernel import warm as warm_partition
    torch.set_num_threads(1)
    warm_kernels()  # compiled once per machine: not part of any plan's time
    warm_partition()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: the 8-device cluster with gpt-tiny and a "
                    "short local run of 3 ranks; writes nothing unless --output is given")
    ap.add_argument("--limit", type=float, default=None, help="the re-plan's (and the fresh plan's) time limit (s; "
                    f"default 5, --quick: {QUICK['limit']:g})")
    ap.add_argument("--first-limit", type=float, default=30.0, help="the original plans' time limit (s)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--devices", type=int, nargs="+", choices=(8, 64, 176), default=None)
    ap.add_argument("--trials", type=int, default=2, help="local runs that lose a rank (default 2; each checks "
                    "the model's recovery figure with the others')")
    ap.add_argument("--output", type=Path, default=None)
    ap.add_argument("--remodel", action="store_true", help="recompute part 3 from the measurements already in "
                    "the results file and rewrite it (part 2 is not rerun; part 1 only for --devices, if given)")
    ap.add_argument("--survivors", action="store_true", help="only runs of a plan with a replicated stage that "
                    "lose a replica (twice) or a sole stage rank, resuming from the survivors' state when it is "
                    "whole; adds them to the results file as local_survivors (the rest is not rerun)")
    args = ap.parse_args(argv)
    if args.survivors:
        return _survivors_only(args.output or RESULTS)
    _warm()
    if args.remodel:
        return _remodel(args.output or RESULTS, args.devices, args.limit, args.first_limit, args.workers)
    args.limit = args.limit or (QUICK["limit"] if args.quick else 5.0)
    devices = args.devices or ([8] if args.quick else [8, 64, 176])
    first_limit = min(args.first_limit, args.limit) if args.quick else args.first_limit
    print(f"== re-plan after losing one host (re-plan and fresh at {args.limit:g} s, first plan at "
          f"{first_limit:g} s, {args.workers} workers)", flush=True)
    replans = []
    for n in devices:
        replans.append(replan_case(n, args.limit, first_limit, args.workers, quick=args.quick and n == 8))
        print_replan(replans[-1])
    print("== end-to-end recovery of a local run", flush=True)
    if args.quick:
        local = local_run(steps=QUICK["steps"], kill_at=QUICK["kill_at"], every=QUICK["every"], trials=1,
                          hosts=QUICK["hosts"], straight=False)
    else:
        local = local_run(steps=30, kill_at=10, every=5, trials=args.trials)
    print_local(local)
    print(f"== throughput under churn (model; T={CHURN_STEPS} steps, checkpoint every {CHECKPOINT_EVERY}, "
          f"restart waits {WAIT_S:g} s)", flush=True)
    churn = churn_table(replans, local)
    for row in churn:
        print_churn(row)
    summary = _summary(replans, local, churn)
    print("== summary", json.dumps(summary), flush=True)
    out = args.output or (None if args.quick else RESULTS)
    if out is None:
        return 0
    doc = {"benchmark": "churn", "goals": GOALS, "summary": summary, "replan": replans, "local": local,
           "churn": churn, "model": __doc__.split("Part 3, ")[1].split("Goals:")[0].strip(),
           "limit_s": args.limit, "first_limit_s": first_limit, "workers": args.workers, "quick": args.quick,
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                       "load_average_at_end": os.getloadavg()},
           "note": "wall-clock times measured on a shared machine (other jobs running): noisy",
           "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    _write(out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
