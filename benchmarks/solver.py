"""Solver benchmark: time, objective, proven bound and gap at scale; baselines vs solver on example clusters.

Part 1, synthetic (seeded): heterogeneous "tiered" clusters (trusted multi-GPU
data-centre hosts, untrusted one-GPU volunteers in two regions, a CPU verifier
host; 2 to 4 GPU types) with GPT-like random chains at blocks x devices =
48x8, 200x16, 200x64, 1000x64, 1000x176; and a homogeneous 1000x16 chain on
one 16-GPU host, without replication (the exact DP covers the space) and
with replication (CP-SAT). Global batch 32, microbatch 1 (M = 32), 1F1B.

Part 2, examples: every packaged cluster (``cost_models/clusters/*.yaml``) with the gpt-1.3b and
llama-7b presets (traced at batch 1, seq 1024 with ``planner.model_io``):
the solver's iteration time against each baseline's (uniform, params,
greedy, dp) under the same cost model; "n/a" where the baseline's plan does
not fit in memory or breaks the policy.

Every scale case runs the whole planning path (``planner.api.plan_chain``:
solve, compile, simulate, compare with the baselines by simulation) and
reports its wall time against the time limit, the plan's objective (the cost
of its compiled programs), its simulated step, their difference, the bound
(on what any plan's programs cost) and the gap of the simulated step to it.
Every plan the solver returns is re-checked by ``planner.check`` (memory
and verification coverage). Goals: gap <= 1% within 30 s up to 1000x64;
homogeneous 1000 blocks optimal in < 1 s; >= 1.5x better than the uniform
and parameter-balanced baselines on the heterogeneous example clusters.

Run: ``python benchmarks/solver.py [--quick] [--time-limit S] [--workers N]``.
Prints tables and writes ``benchmarks/results/solver.json`` (``--quick``: a smoke run
of both parts on the smallest cases, gpt-tiny for the presets, 2 s limits, nothing
written). Times are wall-clock and noisy on a shared machine.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

from cost_models.cluster import PACKAGED_CLUSTERS_DIR
from cost_models.cluster_file import load_cluster
from planner.simulate import predict

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "solver.json"
SCALE_CASES = ((48, 8), (200, 16), (200, 64), (1000, 64), (1000, 176))
PRESETS = ("gpt-1.3b", "llama-7b")
HOMOGENEOUS_BLOCKS = 1000
# --quick: the smallest scale case, a short homogeneous chain, a tiny preset, short limits
PRESET_SEQ = 1024
QUICK = {"scale_cases": SCALE_CASES[:1], "homogeneous_blocks": 48, "presets": ("gpt-tiny",), "seq": 32,
         "time_limit": 2.0}
GOALS = {"max_gap_up_to_1000x64": 0.01, "homogeneous_1000_optimal_s": 1.0, "min_speedup_vs_uniform_params": 1.5}


def _config(batch: int = 32, microbatch: int = 1):
    from cost_models.training import TrainingConfig
    return TrainingConfig(global_batch=batch, microbatch_size=microbatch)


def _checked(sol, chain, cluster, config, policy) -> bool:
    from planner.check import check_solution
    from planner.solver.problem_build import scale_chain
    mb = config.global_batch // sol.num_microbatches
    cfg = dataclasses.replace(config, microbatch_size=mb)
    report = check_solution(sol, scale_chain(chain, mb), cluster, cfg, policy)
    if not report.ok:
        print(f"  CHECK FAILED: {report.problems[:3]}", file=sys.stderr)
    return report.ok


def _row(name: str, sol, wall_s: float, ok: bool, simulated_ms: float | None = None, **extra) -> dict:
    r = sol.report
    sim = simulated_ms
    return {"case": name, "status": r.status, "objective_ms": r.objective_ms, "bound_ms": r.bound_ms,
            "gap": r.gap, "solve_s": wall_s, "stages": len(sol.stages),
            "simulated_ms": sim, "objective_vs_simulated": None if sim is None else (r.objective_ms - sim) / sim,
            "gap_vs_simulated": None if sim is None or r.bound_ms is None else (sim - r.bound_ms) / sim,
            "replicated_stages": sum(len(s.devices) > 1 for s in sol.stages), "verifiers": len(sol.verifiers),
            "devices_used": sum(len(s.devices) for s in sol.stages), "check_ok": ok, "notes": list(r.notes),
            **extra}


def _plan_and_simulate(chain, cluster, config, policy, time_limit: float, workers: int,
                       max_replicas: int | None = None):
    """The whole planning path: solve, compile, simulate, choose by simulation (or, with ``max_replicas``,
    the solver's plan compiled and simulated: the planning API has no replica cap)."""
    from planner.api import plan_chain
    from planner.compile import compile_plan
    from planner.plan_values import ModelRef
    from planner.solver import api
    from planner.solver.problem_build import scale_chain
    from planner.solver.solution import Solution, StagePlacement, VerifierPlacement
    if max_replicas is None:
        plan = plan_chain(chain, cluster, spec="bench:chain", global_batch=config.global_batch,
                          microbatch_size=config.microbatch_size, policy=policy, time_limit_s=time_limit,
                          workers=workers)
    else:
        sol = api.solve(chain, cluster, config, policy, time_limit_s=time_limit, workers=workers,
                        max_replicas=max_replicas)
        ref = ModelRef(spec="bench:chain", name=chain.model_name, fingerprint=chain.fingerprint,
                       batch=chain.microbatch_size, dtype="float32")
        plan = predict(compile_plan(sol, scale_chain(chain, config.microbatch_size), cluster, config, policy, ref))
    stages = tuple(StagePlacement(index=s.index, first_block=s.first_block, last_block=s.last_block,
                                  devices=tuple(plan.ranks[r].device for r in plan.stage_ranks(s.index)),
                                  microbatches=tuple(len(plan.ranks[r].microbatches)
                                                     for r in plan.stage_ranks(s.index)))
                   for s in plan.stages)
    verifiers = tuple(VerifierPlacement(boundary=v.boundary, device=v.device, directions=v.directions)
                      for v in plan.verifiers)
    sol = Solution(stages=stages, verifiers=verifiers, num_microbatches=plan.num_microbatches, schedule=plan.schedule,
                   predicted_step_ms=plan.report.objective_ms, memory_bytes=(), report=plan.report)
    return sol, plan.predicted.step_ms


def scale_part(time_limit: float, workers: int, quick: bool) -> list[dict]:
    import numpy as np

    from planner.solver.policy import VerificationPolicy
    from tests.unit.solver_fixtures import (
        homogeneous_cluster,
        random_chain,
        tiered_cluster,
    )

    rows = []
    cases = QUICK["scale_cases"] if quick else SCALE_CASES
    policy, config = VerificationPolicy(), _config()
    for blocks, devices in cases:
        rng = np.random.default_rng(blocks * 1000 + devices)
        cluster = tiered_cluster(devices)
        mem = max(d.spec.mem_bytes for d in cluster.stage_devices)
        chain = random_chain(rng, blocks, param_scale=1.5 * mem / 16 / blocks, act_scale=2e8 * 48 / blocks,
                             flop_scale=5e11 * 48 / blocks, out_scale=2e7)
        types = len({d.spec.name for d in cluster.stage_devices})
        start = time.perf_counter()
        sol, sim = _plan_and_simulate(chain, cluster, config, policy, time_limit, workers)
        wall = time.perf_counter() - start
        rows.append(_row(f"{blocks}x{devices}", sol, wall, True, sim, gpu_types=types,
                         untrusted=sum(not d.trusted for d in cluster.stage_devices)))
        _print_scale(rows[-1])
    # The plan path re-checks every plan (planner.check.assert_valid) before compiling it.
    rng = np.random.default_rng(7)
    cluster = homogeneous_cluster(16, host_size=16)
    blocks = QUICK["homogeneous_blocks"] if quick else HOMOGENEOUS_BLOCKS
    chain = random_chain(rng, blocks, param_scale=2.0 * 80e9 / 16 / blocks, act_scale=2e7, flop_scale=2.4e10,
                         out_scale=2e7, uniform=True)
    for label, replicas in ((f"homogeneous {blocks}x16, no replicas", 1),
                            (f"homogeneous {blocks}x16, replicas", None)):
        start = time.perf_counter()
        sol, sim = _plan_and_simulate(chain, cluster, config, policy, time_limit, workers, max_replicas=replicas)
        wall = time.perf_counter() - start
        rows.append(_row(label, sol, wall, True, sim, gpu_types=1, untrusted=0))
        _print_scale(rows[-1])
    return rows


def _print_scale(row: dict) -> None:
    gap = "n/a" if row["gap_vs_simulated"] is None else f"{100 * row['gap_vs_simulated']:.2f}%"
    print(f"{row['case']:>34}  {row['status']:>8}  obj {row['objective_ms']:12.2f} ms  sim {row['simulated_ms']:12.2f} ms"
          f" ({100 * row['objective_vs_simulated']:+.1f}%)  bound {row['bound_ms']:12.2f} ms  gap(sim) {gap:>8}  "
          f"plan {row['solve_s']:6.1f} s  "
          f"S={row['stages']:<3} repl={row['replicated_stages']:<2} ver={row['verifiers']:<3} "
          f"check={'ok' if row['check_ok'] else 'FAIL'}", flush=True)


def example_part(time_limit: float, workers: int, quick: bool) -> list[dict]:
    
    from planner.errors import InfeasiblePlanError
    from planner.model_io import load_chain
    from planner.solver import api, baseline_plans
    from planner.solver.policy import VerificationPolicy
    from planner.solver.search.baselines import BASELINES

    rows = []
    clusters = sorted(PACKAGED_CLUSTERS_DIR.glob("*.yaml"))
    presets = QUICK["presets"] if quick else PRESETS
    policy, config = VerificationPolicy(), _config()
    for preset in presets:
        _, chain = load_chain(preset, batch=1, seq=QUICK["seq"] if quick else PRESET_SEQ)
        for path in clusters:
            cluster = load_cluster(path)
            row = {"cluster": path.stem, "model": preset, "blocks": len(chain.blocks),
                   "devices": len(cluster.stage_devices),
                   "heterogeneous": len({d.spec.name for d in cluster.stage_devices}) > 1
                   or any(not d.trusted for d in cluster.stage_devices)}
            start = time.perf_counter()
            pol = policy
            try:
                sol = api.solve(chain, cluster, config, pol, time_limit_s=time_limit, workers=workers)
            except InfeasiblePlanError as exc:
                # e.g. swarm-t4 has one trusted device: trusted first *and* last stages are impossible.
                print(f"{preset:>9} on {path.stem:<14} infeasible ({exc}); retrying with trusted_endpoints=False",
                      flush=True)
                row["default_policy_error"] = str(exc)
                pol = dataclasses.replace(policy, trusted_endpoints=False)
                start = time.perf_counter()
                try:
                    sol = api.solve(chain, cluster, config, pol, time_limit_s=time_limit, workers=workers)
                except InfeasiblePlanError as exc2:
                    row.update(solver_ms=None, error=str(exc2))
                    rows.append(row)
                    continue
            row["policy"] = pol.to_dict()
            row.update(solver_ms=sol.predicted_step_ms, status=sol.report.status, gap=sol.report.gap,
                       solve_s=time.perf_counter() - start, stages=len(sol.stages),
                       check_ok=_checked(sol, chain, cluster, config, pol))
            for name in BASELINES:
                try:
                    b = baseline_plans.baseline(name, chain, cluster, config, pol)
                    row[f"{name}_ms"] = b.predicted_step_ms
                    row[f"{name}_x"] = b.predicted_step_ms / sol.predicted_step_ms
                except InfeasiblePlanError as exc:
                    row[f"{name}_ms"], row[f"{name}_x"] = None, None
                    row[f"{name}_why"] = str(exc)[:160]
            rows.append(row)
            _print_example(row)
    return rows


def _print_example(row: dict) -> None:
    def x(name: str) -> str:
        v = row.get(f"{name}_x")
        return "    n/a" if v is None else f"{v:6.2f}x"
    gap = "n/a" if row.get("gap") is None else f"{100 * row['gap']:.1f}%"
    print(f"{row['model']:>9} on {row['cluster']:<14} solver {row['solver_ms']:11.1f} ms ({row['status']}, gap {gap}, "
          f"{row['solve_s']:.1f} s, S={row['stages']})  uniform {x('uniform')}  params {x('params')}  "
          f"greedy {x('greedy')}  dp {x('dp')}  check={'ok' if row['check_ok'] else 'FAIL'}", flush=True)


def _summary(scale: list[dict], examples: list[dict]) -> dict:
    upto = [r for r in scale if r["case"] in ("48x8", "200x16", "200x64", "1000x64")]
    homog = [r for r in scale if r["case"].startswith("homogeneous") and "no replicas" in r["case"]]
    hetero = [r for r in examples if r.get("heterogeneous") and r.get("solver_ms")]
    speedups = [r[k] for r in hetero for k in ("uniform_x", "params_x") if r.get(k) is not None]
    return {
        "max_gap_up_to_1000x64": max((r["gap"] for r in upto), default=None),
        "homogeneous_1000_no_replicas_s": homog[0]["solve_s"] if homog else None,
        "homogeneous_1000_no_replicas_status": homog[0]["status"] if homog else None,
        "min_speedup_vs_uniform_params_heterogeneous": min(speedups, default=None),
        "all_plans_checked_ok": all(r.get("check_ok", True) for r in scale + examples),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: the smallest scale case, a short homogeneous "
                    "chain, gpt-tiny on the example clusters, 2 s limits; nothing written")
    ap.add_argument("--time-limit", type=float, default=None, help="default 30 s (--quick: 2 s)")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    time_limit = args.time_limit or (QUICK["time_limit"] if args.quick else 30.0)
    print(f"== scale (time limit {time_limit:.0f} s, {args.workers} workers)")
    scale = scale_part(time_limit, args.workers, args.quick)
    print("== baselines / solver on the example clusters (iteration time ratio: > 1 means the solver is faster)")
    examples = example_part(time_limit, args.workers, args.quick)
    summary = _summary(scale, examples)
    print("== summary", json.dumps(summary, indent=1))
    if args.quick:
        print("quick run: nothing written")
        return 0
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": "solver", "goals": GOALS, "summary": summary, "scale": scale, "examples": examples,
           "time_limit_s": time_limit, "workers": args.workers, "quick": args.quick,
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
           "note": "wall-clock times measured on a shared machine (other jobs running): noisy",
           "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    tmp = RESULTS.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=lambda v: None if isinstance(v, float) and math.isnan(v) else v))
    os.replace(tmp, RESULTS)
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
