"""Throttled in-flight windows: the objective against the simulated step of the compiled programs (issue 18).

Random placements rarely run out of memory for the microbatches their round trips want in flight, so
this check gives every stage replica a limit of its own, drawn from 1..8 (``StagePlacement.in_flight``,
which the pricing honours as a cap beside memory, ``planner.solver.in_flight``), and compares
``price_program`` with ``planner.simulate`` of the programs compiled with the priced limits. Two
families: ``lab``, deep pipelines (3-14 stages, some replicated, half of them on chains of identical
blocks) on 1-3 hosts of eight GPUs; ``wide``, the one-cost tests' wide-area placements
(``tests.unit.program_fixtures``). Goal: every objective within 5% of its simulated step.

    python benchmarks/throttled_windows.py [--seeds 600] [--out benchmarks/results/throttled_windows.json]
    python benchmarks/throttled_windows.py --quick   # a smoke run: a few seeds per family, nothing written
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cost_models.cluster_file import parse_cluster  # noqa: E402
from cost_models.memory import trace_dtype  # noqa: E402
from cost_models.training import TrainingConfig  # noqa: E402
from planner.compile import compile_plan  # noqa: E402
from planner.plan_values import ModelRef  # noqa: E402
from planner.simulate import predict  # noqa: E402
from planner.solver.objective import Placement, price_program, violations  # noqa: E402
from planner.solver.policy import VerificationPolicy  # noqa: E402
from planner.solver.problem_build import build_problem, scale_chain  # noqa: E402
from planner.solver.solution import Solution, SolveReport  # noqa: E402
from tests.unit.program_fixtures import (  # noqa: E402
    POLICY,
    random_placement,
    stages_of,
    wide_area_cluster,
)
from tests.unit.solver_fixtures import random_chain  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "throttled_windows.json"
QUICK_SEEDS = 6
MAX_WINDOW = 8  # limits drawn from 1..MAX_WINDOW: most replicas of these pipelines want more in flight


def lab_cluster(rng: np.random.Generator, hosts: int):
    """``hosts`` hosts of eight GPUs, mostly of one type; fast or slow links within and between hosts."""
    kind = str(rng.choice(["RTX3090", "T4", "V100-16GB", "A100-40GB", "L4"]))
    spec = [{"name": f"h{i}", "region": "r0", "trust": "op", "trusted": True,
             "devices": [{"type": kind if rng.random() < 0.7 else str(rng.choice(["RTX3090", "T4", "L4"])),
                          "count": 8}]} for i in range(hosts)]
    links = {"intra_host": {"bandwidth_gbps": float(rng.choice([32, 128])), "latency_ms": 0.01},
             "default": {"bandwidth_gbps": float(rng.choice([1, 10])), "latency_ms": float(rng.choice([0.5, 5]))}}
    return parse_cluster({"name": "lab", "hosts": spec, "links": links})


def deep_placement(rng: np.random.Generator, problem, cluster) -> Placement | None:
    """3-14 stages cut at random, a few of them replicated, on the GPUs in order or shuffled."""
    L, M = problem.num_blocks, problem.num_microbatches
    gpus = [d.id for h in cluster.hosts if h.role == "worker" for d in h.devices]
    S = int(rng.integers(3, min(14, L, len(gpus)) + 1))
    cuts = sorted(rng.choice(np.arange(1, L), size=S - 1, replace=False).tolist())
    counts = [1] * S
    for _ in range(int(rng.integers(0, max(0, (len(gpus) - S) // 2) + 1))):
        counts[int(rng.integers(S))] += 1
    order = gpus if rng.random() < 0.5 else list(rng.permutation(gpus))
    stages = stages_of(cuts, counts, order, L, M)
    placement = Placement(stages=tuple(stages), verifiers=(), num_microbatches=M)
    return None if violations(problem, placement) else placement


def case(seed: int, family: str) -> tuple[float, float] | None:
    """(objective, simulated step) of one random placement with random in-flight limits, or None."""
    rng = np.random.default_rng(seed)
    if family == "wide":
        cluster = wide_area_cluster(rng, int(rng.integers(4, 14)))
        chain = random_chain(rng, int(rng.integers(6, 20)), param_scale=float(rng.choice([2e7, 1e8])),
                             act_scale=float(rng.choice([3e8, 1e9, 3e9])), out_scale=float(rng.choice([1e6, 1e7])))
        policy = POLICY
    else:
        cluster = lab_cluster(rng, int(rng.integers(1, 4)))
        chain = random_chain(rng, int(rng.integers(12, 40)), param_scale=float(rng.choice([1e7, 5e7])),
                             uniform=rng.random() < 0.5,
                             act_scale=float(np.exp(rng.uniform(np.log(1e8), np.log(4e9)))),
                             out_scale=float(rng.choice([1e6, 1e7, 5e7])))
        policy = VerificationPolicy(enabled=False)
    config = TrainingConfig(global_batch=int(rng.choice([16, 32, 64])), microbatch_size=1, schedule="1f1b")
    problem = build_problem(scale_chain(chain, 1), cluster, config, policy)
    drawn = (random_placement if family == "wide" else deep_placement)(rng, problem, cluster)
    if drawn is None:
        return None
    windows = np.random.default_rng(seed + 1000)
    capped = tuple(dataclasses.replace(st, in_flight=tuple(
        min(m, int(windows.integers(1, MAX_WINDOW + 1))) for m in st.microbatches)) for st in drawn.stages)
    priced = price_program(problem, dataclasses.replace(drawn, stages=capped))
    stages = tuple(dataclasses.replace(st, in_flight=n) for st, n in zip(drawn.stages, priced.in_flight))
    report = SolveReport(method="random", status="FEASIBLE", objective_ms=priced.step_ms, bound_ms=None, gap=None,
                         solve_s=0.0)
    sol = Solution(stages=stages, verifiers=drawn.verifiers, num_microbatches=drawn.num_microbatches,
                   schedule="1f1b", predicted_step_ms=priced.step_ms, memory_bytes=(), report=report)
    ref = ModelRef(spec="bench:chain", name=chain.model_name, fingerprint=chain.fingerprint, batch=1,
                   dtype=trace_dtype(chain))
    plan = predict(compile_plan(sol, scale_chain(chain, 1), cluster, config, policy, ref))
    return priced.step_ms, plan.predicted.step_ms


def summary(errors: list[float]) -> dict:
    """Within-5% count, mean |error| and the extremes of objective / simulated - 1."""
    e = np.array(errors)
    return {"cases": len(e), "within_5pct": int((np.abs(e) <= 0.05).sum()),
            "mean_abs_err_pct": round(100 * float(np.abs(e).mean()), 3), "mean_err_pct": round(100 * float(e.mean()), 3),
            "worst_under_pct": round(100 * float(e.min()), 1), "worst_over_pct": round(100 * float(e.max()), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=None, help="random placements drawn per family (default 600; "
                                                                  f"--quick: {QUICK_SEEDS})")
    parser.add_argument("--out", default=None, help="the JSON to write (default benchmarks/results/"
                                                    "throttled_windows.json, none with --quick)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: a few seeds per family, nothing written")
    args = parser.parse_args()
    seeds = args.seeds or (QUICK_SEEDS if args.quick else 600)
    out = args.out or (None if args.quick else str(RESULTS))
    doc = {"date": time.strftime("%Y-%m-%d"), "seeds": seeds, "max_window": MAX_WINDOW, "families": {}}
    print(f"{'family':8} {'cases':>5} {'within 5%':>9} {'mean |err| %':>12} {'mean err %':>10} {'worst %':>14}")
    for family in ("lab", "wide"):
        rows = []
        for seed in range(seeds):
            got = case(seed, family)
            if got is not None:
                rows.append({"seed": seed, "objective_ms": round(got[0], 1), "simulated_ms": round(got[1], 1),
                             "err": round(got[0] / got[1] - 1, 5)})
        s = summary([r["err"] for r in rows])
        doc["families"][family] = {"summary": s, "rows": rows}
        print(f"{family:8} {s['cases']:5d} {s['within_5pct']:9d} {s['mean_abs_err_pct']:12.3f} {s['mean_err_pct']:10.3f}"
              f" {s['worst_under_pct']:6.1f} / {s['worst_over_pct']:+.1f}")
    if out is not None:
        Path(out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
