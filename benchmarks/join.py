"""Join benchmark (issue 21, item 4): how long a host that asks into a running run waits to be training.

A local run of gpt-tiny (global batch 4, microbatches of 2, fp32, Adam, one thread per rank) on three
one-CPU hosts h0..h2 of a four-host cluster: h3, six times faster than the others, is excluded when the
run starts. ``launch_replanning`` as ``stagewise run --replan-on-failure 1`` runs it (the default re-plan
time limit, 30 s), with a checkpoint every ``--checkpoint-every`` steps. When rank 0 reports step
``--at`` the benchmark writes a join request for h3 as ``stagewise join`` does; the launcher, which looks
at its join folder every 0.1 s, asks the ranks to stop after their next checkpoint, re-plans with h3 and
resumes there.

Each trial's figures come from the run's own record of the join (``result["replans"]``), on this
machine's clock, from the request file's time: request -> the checkpoint the ranks stopped after is
complete (its manifest's time: the wait for the next checkpoint, at most ``--checkpoint-every`` steps);
-> every rank has exited (``shutdown_s``: the run summary gathered, process groups torn down); the
re-plan's wall time; re-plan -> rank 0's first step event on the new plan (``restart_s``: new processes,
rendezvous, checkpoint reload and re-sharding, that first step); and request -> that first step in all.
``redone`` checks that no step was run twice: the resumed run starts right after the checkpoint it
stopped at (steps before + steps after = ``--steps``). For scale, each trial also starts the first plan
afresh, as ``stagewise run`` does, and times launch -> rank 0's first step event (``fresh_start_s``): what
a restart costs under the machine's load at that moment.

Run: ``python benchmarks/join.py [--trials N] [--checkpoint-every C] [--output PATH]``; prints a table
and writes ``benchmarks/results/join.json`` (``--quick``: one trial of 4 steps, the join asked before the
start (``--at -1``), a checkpoint every 2 steps, no fresh start timed, nothing written unless ``--output``).
Wall times are noisy on a shared machine.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "join.json"
KEYS = ("request_to_checkpoint_s", "shutdown_s", "replan_s", "restart_s", "request_to_first_step_s", "fresh_start_s")
FULL = {"trials": 3, "steps": 40, "at": 5, "checkpoint_every": 10}
# --quick: gpt-tiny's steps take milliseconds here, faster than the launcher looks at its join folder: the
# request is written before the run starts (at -1), so that the ranks stop at the first checkpoint
QUICK = {"trials": 1, "steps": 4, "at": -1, "checkpoint_every": 2}


def first_plan():
    """Three stages on h0, h1, h2 of a cluster whose fastest host, h3, the plan leaves out."""
    from cost_models.cluster_file import parse_cluster
    from cost_models.devices import CATALOG
    from planner.api import plan_chain
    from planner.model_io import load_chain
    from planner.solver.policy import VerificationPolicy

    _, chain = load_chain("gpt-tiny", batch=2, seq=16)

    def host(name: str, efficiency: float) -> dict:
        spec = {**CATALOG["CPU"].to_dict(), "efficiency": efficiency, "mem_bytes": int(0.7 * 4 * chain.param_bytes)}
        return {"name": name, "region": "lab", "trust": "operator", "trusted": True,
                "devices": [{"type": "CPU", "count": 1, "spec": spec}]}

    cluster = parse_cluster({"name": "four", "hosts": [host("h0", 0.05), host("h1", 0.05), host("h2", 0.05),
                                                       host("h3", 0.3)],
                             "links": {"default": {"bandwidth_gbps": 10, "latency_ms": 0.1}}})
    plan = plan_chain(chain, cluster.without_hosts({"h3"}), spec="gpt-tiny", seq=16, global_batch=4,
                      microbatch_size=2, policy=VerificationPolicy(enabled=False), time_limit_s=10, dtype="fp32",
                      optimizer="adam", stages=3)
    return dataclasses.replace(plan, cluster=cluster.to_dict(), excluded_hosts=("h3",))


def fresh_start_s(path: Path) -> float:
    """A plain run of the plan: launch -> rank 0's first step event."""
    from planner.runtime.launcher.launch import launch
    from planner.runtime.options import RunOptions

    start, first = time.perf_counter(), []
    launch(RunOptions(plan=str(path), steps=2, timeout_s=60),
           on_event=lambda e: first.append(time.perf_counter() - start) if e.get("event") == "step" else None)
    return round(first[0], 3)


def trial(plan, folder: Path, *, steps: int, at: int, every: int, fresh_start: bool = True) -> dict:
    from planner.runtime.launcher import elastic
    from planner.runtime.recovery import joins
    from planner.runtime.options import RunOptions
    from planner.secret import run_secret

    key = run_secret()
    path = plan.save(folder / "plan.json", secret=key)
    fresh = fresh_start_s(path) if fresh_start else None
    ckpt = folder / "ckpt"
    asked: list[float] = []

    def on_event(event: dict) -> None:  # rank 0 reported step `at`: the host asks in
        if event.get("event") == "step" and event["step"] >= at and not asked:
            asked.append(time.time())
            joins.write_request(ckpt / joins.FOLDER, joins.make_request(plan, host="h3", why="benchmark"), key)

    if at < 0:  # asked before the first step
        asked.append(time.time())
        joins.write_request(ckpt / joins.FOLDER, joins.make_request(plan, host="h3", why="benchmark"), key)
    start = time.perf_counter()
    result = elastic.launch_replanning(RunOptions(plan=str(path), steps=steps, timeout_s=60,
                                                  checkpoint_dir=str(ckpt), checkpoint_every=every),
                                       max_replans=1, on_event=on_event)
    wall = time.perf_counter() - start
    (join,) = result["replans"]
    resumed = join["resumed_after_step"]
    return {"asked_after_step": at, "stopped_after_step": resumed, "ranks_before": plan.num_ranks,
            "ranks_after": join["ranks"], **{k: join[k] for k in KEYS[:-1]}, "fresh_start_s": fresh,
            "redone_steps": resumed + 1 + result["steps"] - steps, "measured_step_ms": result["measured_step_ms"],
            "run_wall_s": round(wall, 2), "load_avg_1m": round(os.getloadavg()[0], 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=None, help=f"default 3 (--quick: {QUICK['trials']})")
    ap.add_argument("--steps", type=int, default=None, help=f"default 40 (--quick: {QUICK['steps']})")
    ap.add_argument("--at", type=int, default=None, help="the step after which the join request is written "
                                                         f"(-1: before the start; default 5, --quick: {QUICK['at']})")
    ap.add_argument("--checkpoint-every", type=int, default=None,
                    help=f"default 10 (--quick: {QUICK['checkpoint_every']})")
    ap.add_argument("--output", default=None, help="default benchmarks/results/join.json (--quick: none)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: one short trial, nothing written")
    args = ap.parse_args(argv)
    given = {"trials": args.trials, "steps": args.steps, "at": args.at, "checkpoint_every": args.checkpoint_every}
    base = QUICK if args.quick else FULL
    args.trials, args.steps, args.at, args.checkpoint_every = (given[k] or base[k] for k in given)
    output = args.output or (None if args.quick else str(RESULTS))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    plan = first_plan()
    rows = []
    for k in range(args.trials):
        with tempfile.TemporaryDirectory(prefix="stagewise-join-") as tmp:
            rows.append(trial(plan, Path(tmp), steps=args.steps, at=args.at, every=args.checkpoint_every,
                              fresh_start=not args.quick))
        print(f"trial {k + 1}: {rows[-1]}", flush=True)
    print(f"\n{'':28}" + "".join(f"{k.removesuffix('_s'):>24}" for k in KEYS))
    for k, r in enumerate(rows, 1):
        print(f"{'trial ' + str(k) + ' (stop after ' + str(r['stopped_after_step']) + ')':28}"
              + "".join(_cell(r[key]) for key in KEYS))
    summary = {key: _median(r[key] for r in rows) for key in KEYS}
    print(f"{'median':28}" + "".join(_cell(summary[key]) for key in KEYS))
    print(f"steps redone: {[r['redone_steps'] for r in rows]}; ranks {rows[0]['ranks_before']} -> "
          f"{[r['ranks_after'] for r in rows]}")
    doc = {"benchmark": "join", "date": time.strftime("%Y-%m-%d"), "machine": platform.machine(),
           "cpus": os.cpu_count(), "load_avg_1m": [r["load_avg_1m"] for r in rows], "steps": args.steps,
           "asked_after_step": args.at, "checkpoint_every": args.checkpoint_every, "trials": rows,
           "median": summary}
    if output is None:
        print("quick run: nothing written")
        return 0
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    Path(output).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"written to {output}")
    return 0


def _median(values) -> float | None:
    """The median of the values measured (None where none was: a quick run times no fresh start)."""
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 3) if present else None


def _cell(value: float | None) -> str:
    return f"{'n/a' if value is None else format(value, '.2f'):>24}"


if __name__ == "__main__":
    sys.exit(main())
