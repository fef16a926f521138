"""Plan time: the wall time of the whole ``plan`` command against its time limit (issue 18, item 5).

Each trial is a fresh process doing what ``stagewise plan`` does (``planner/commands/plan.py``): import,
build the block chain (trace the model), ``planner.api.plan_chain`` (solve, the baselines, compile, simulate,
choose by simulation), sign and write the plan. The parent times the process from its start to its exit; the
child reports its phases. Cases:

* ``176``: the solver benchmark's 1000-block x 176-device pool (``benchmarks/warm_replan.py``'s ``_case``:
  trusted data-centre hosts, 132 untrusted volunteers in two regions, a CPU verifier host), global batch 32,
  verification on; its chain is built, not traced;
* ``worldwide``: DT-FM's worldwide case (``benchmarks/clusters/dtfm-worldwide.yaml``: 64 V100s in 8 cities),
  GPT-3 1.3B traced at seq 2048, global batch 512, fp16, no verification (as ``benchmarks/peers.py``).

The limit counts from the process's start (as ``stagewise plan`` counts it since 2026-12-03; before, from
the trace). Reported per trial: the process's wall time, its excess over the limit (goal: at most
``OVERHEAD_GOAL_S``) and what the excess is made of: the budgeted part past the limit (start, imports,
tracing or building the chain and ``plan_chain``: the solver's last indivisible steps, compiling the plans
that can still win), then what follows the plan (writing it, the interpreter's exit); the time start and
imports took; the plan's simulated step and objective; whether the wall-clock ceiling, not the work budget,
ended a solver step (``ceiling``: the plan's notes saying so; issue 36 wants none); the process's CPU time
(``cpu_s``, user + system) and ``plan_chain``'s (``plan_chain_cpu_s``), less noisy than the wall. Wall times are
noisy on a shared machine: each case runs ``--trials`` times.

Run: ``python benchmarks/plan_time.py [--limits 30 60] [--trials 2] [--cases 176,worldwide]``. Prints a table
and writes ``benchmarks/results/plan_time.json``. ``--quick``: a smoke run of both kinds of case, small (``48x40``:
the same pool's generator at 48 blocks x 40 devices; ``worldwide-tiny``: gpt-tiny traced on the worldwide
cluster), one trial at a 1 s limit, nothing written.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "plan_time.json"
CASES = ("176", "worldwide")
QUICK_CASES = ("48x40", "worldwide-tiny")
OVERHEAD_GOAL_S = 5.0
SECRET = "plan-time-benchmark-secret-0123456789"  # the child signs its plan as the CLI does; a throwaway key


def _chain_and_kwargs(case: str):
    """(chain, cluster, plan_chain keyword arguments) of a case; the chain traced or built here."""
    if case in ("176", "48x40"):
        sys.path.insert(0, str(ROOT))
        from benchmarks.warm_replan import QUICK_BLOCKS, QUICK_DEVICES, _case
        from planner.solver.policy import VerificationPolicy
        chain, cluster = _case() if case == "176" else _case(QUICK_BLOCKS, QUICK_DEVICES)
        return chain, cluster, {"spec": "bench:chain", "global_batch": 32, "policy": VerificationPolicy()}
    import cost_models
    from planner.model_io import load_chain
    from planner.solver.policy import VerificationPolicy
    model, seq = ("gpt-1.3b", 2048) if case == "worldwide" else ("gpt-tiny", 32)
    _, chain = load_chain(model, batch=1, seq=seq)  # as the CLI: at 1 sample, the solver rescales
    cluster = cost_models.load_cluster(ROOT / "benchmarks" / "clusters" / "dtfm-worldwide.yaml")
    return chain, cluster, {"spec": model, "seq": seq, "global_batch": 512, "dtype": "float16",
                            "policy": VerificationPolicy(enabled=False)}


def child(case: str, limit: float, out: Path) -> int:
    """One ``plan``: its phases on stdout as JSON (seconds from this function's start)."""
    start = time.perf_counter()
    import torch

    from planner.api import plan_chain
    from planner.commands._common import process_age_s, process_started_s
    from planner.secret import run_secret
    torch.set_num_threads(1)
    imported = time.perf_counter()
    chain, cluster, kwargs = _chain_and_kwargs(case)
    built, cpu = time.perf_counter(), time.process_time()
    # as the CLI: the limit counts from the process's start
    plan = plan_chain(chain, cluster, time_limit_s=limit, started_s=process_started_s(), **kwargs)
    planned, planned_age_s, plan_chain_cpu_s = time.perf_counter(), process_age_s(), time.process_time() - cpu
    plan.save(out, secret=run_secret())
    saved = time.perf_counter()
    r = plan.report
    print(json.dumps({"imports_s": imported - start, "chain_s": built - imported, "plan_chain_s": planned - built, "plan_chain_cpu_s": plan_chain_cpu_s,
                      "save_s": saved - planned, "planned_age_s": planned_age_s, "solve_s": r.solve_s, "simulated_ms": plan.predicted.step_ms,
                      "objective_ms": r.objective_ms, "bound_ms": r.bound_ms, "method": r.method,
                      "stages": plan.num_stages, "microbatches": plan.num_microbatches,
                      "chosen": r.notes[-1] if r.notes else "",
                      "ceiling": [n for n in r.notes if "wall-clock ceiling" in n]}))
    return 0


def trial(case: str, limit: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "STAGEWISE_SECRET": SECRET, "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", case, "--time-limit", str(limit),
               "--out", str(Path(tmp) / "plan.json")]
        start, used = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, cwd=ROOT)
        wall = time.perf_counter() - start
        now = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = now.ru_utime + now.ru_stime - used.ru_utime - used.ru_stime
    if done.returncode != 0:
        raise RuntimeError(f"{case} at {limit} s failed: {done.stderr[-2000:]}")
    inner = json.loads(done.stdout.strip().splitlines()[-1])
    inside = inner["imports_s"] + inner["chain_s"] + inner["plan_chain_s"] + inner["save_s"]
    return {"case": case, "time_limit_s": limit, "wall_s": wall, "over_limit_s": wall - limit, "cpu_s": cpu,
            "start_and_imports_s": wall - inside + inner["imports_s"],
            "budgeted_over_limit_s": inner["planned_age_s"] - limit, "after_plan_s": wall - inner["planned_age_s"],
            **inner}


def _print(row: dict) -> None:
    print(f"{row['case']:>10} limit {row['time_limit_s']:4.0f} s  wall {row['wall_s']:6.1f} s "
          f"({row['over_limit_s']:+5.1f} s: budget {row['budgeted_over_limit_s']:+5.1f}, after it "
          f"{row['after_plan_s']:4.1f}; start+imports {row['start_and_imports_s']:4.1f}, chain {row['chain_s']:4.1f})  "
          f"CPU {row['cpu_s']:5.1f} s (plan_chain {row['plan_chain_cpu_s']:5.1f})  "
          f"solve {row['solve_s']:5.1f} s  simulated {row['simulated_ms']:9.1f} ms  objective "
          f"{row['objective_ms']:9.1f} ms  {row['method']}  load {os.getloadavg()[0]:.1f}"
          f"{'  CEILING HIT' if row['ceiling'] else ''}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limits", type=float, nargs="+", default=None, help="default 30 60 (--quick: 1)")
    ap.add_argument("--trials", type=int, default=None, help="default 2 (--quick: 1)")
    ap.add_argument("--cases", default=None, help=f"default {','.join(CASES)} (--quick: {','.join(QUICK_CASES)})")
    ap.add_argument("--quick", action="store_true", help="a smoke run: the small cases, one trial, nothing written")
    ap.add_argument("--child", choices=CASES + QUICK_CASES, help=argparse.SUPPRESS)
    ap.add_argument("--time-limit", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.time_limit, args.out)
    cases = args.cases or ",".join(QUICK_CASES if args.quick else CASES)
    limits = args.limits or ([1.0] if args.quick else [30.0, 60.0])
    trials = args.trials or (1 if args.quick else 2)
    rows = []
    for case in cases.split(","):
        for limit in limits:
            for _ in range(trials):
                rows.append(trial(case, limit))
                rows[-1]["load_1min"] = os.getloadavg()[0]
                _print(rows[-1])
    worst = max(r["over_limit_s"] for r in rows)
    summary = {"worst_over_limit_s": worst, "goal_over_limit_s": OVERHEAD_GOAL_S, "goal_met": worst <= OVERHEAD_GOAL_S,
               "worst_budgeted_over_limit_s": max(r["budgeted_over_limit_s"] for r in rows),
               "start_and_imports_s": [min(r["start_and_imports_s"] for r in rows),
                                       max(r["start_and_imports_s"] for r in rows)],
               "load_1min": [min(r["load_1min"] for r in rows), max(r["load_1min"] for r in rows)],
               "ceiling_hits": sum(bool(r["ceiling"]) for r in rows)}
    print("== summary", json.dumps(summary))
    if args.quick:
        print("quick run: nothing written")
        return 0
    doc = {"benchmark": "plan_time", "summary": summary, "rows": rows,
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
           "note": "wall-clock times on a shared 2-core machine (other jobs running): noisy",
           "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
