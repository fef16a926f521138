"""What keeping the link and residual tests costs, and whether the plans that keep them run as priced.

Random valid placements on random wide-area clusters (the one-cost tests' generator: uneven replica
counts, untrusted hosts, a CPU verifier, verifiers drawn at random); for each whose verifiers leave an
untrusted stage without its link test: the link tests left lost and the step time (relative to the
placement as drawn) after ``keep_link_tests`` at several ``link_test_cost`` shares, and, for the
placement keeping the most tests, its objective against the simulated step of its compiled programs.

    python benchmarks/link_tests.py [--seeds 60] [--out benchmarks/results/link_tests.json]
    python benchmarks/link_tests.py --quick   # a smoke run: the first few seeds, nothing written
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cost_models.memory import trace_dtype  # noqa: E402
from cost_models.training import TrainingConfig  # noqa: E402
from planner.compile import compile_plan  # noqa: E402
from planner.plan_values import ModelRef  # noqa: E402
from planner.simulate import predict  # noqa: E402
from planner.solver.link_tests import keep_link_tests, lost_link_tests  # noqa: E402
from planner.solver.objective import price_program  # noqa: E402
from planner.solver.problem_build import build_problem, scale_chain  # noqa: E402
from planner.solver.solution import Solution, SolveReport  # noqa: E402
from tests.unit.program_fixtures import POLICY, random_placement, wide_area_cluster  # noqa: E402
from tests.unit.solver_fixtures import random_chain  # noqa: E402

SHARES = (0.0, 0.05, 0.2, 10.0)
QUICK_SEEDS = 4


def simulated_ms(problem, placement, chain, cluster, config, policy) -> tuple[float, float]:
    """(objective, simulated step) of ``placement`` compiled."""
    priced = price_program(problem, placement)
    stages = tuple(dataclasses.replace(st, in_flight=n) for st, n in zip(placement.stages, priced.in_flight))
    report = SolveReport(method="random", status="FEASIBLE", objective_ms=priced.step_ms, bound_ms=None, gap=None,
                         solve_s=0.0)
    sol = Solution(stages=stages, verifiers=placement.verifiers, num_microbatches=placement.num_microbatches,
                   schedule=config.schedule, predicted_step_ms=priced.step_ms, memory_bytes=(), report=report)
    ref = ModelRef(spec="bench:chain", name=chain.model_name, fingerprint=chain.fingerprint,
                   batch=chain.microbatch_size, dtype=trace_dtype(chain))
    plan = predict(compile_plan(sol, scale_chain(chain, 1), cluster, config, policy, ref))
    return priced.step_ms, plan.predicted.step_ms


def case(seed: int) -> dict | None:
    rng = np.random.default_rng(seed)
    cluster = wide_area_cluster(rng, int(rng.integers(4, 14)))
    chain = random_chain(rng, int(rng.integers(6, 20)), param_scale=float(rng.choice([2e7, 1e8])), act_scale=5e7,
                         out_scale=float(rng.choice([1e6, 1e7])))
    config = TrainingConfig(global_batch=int(rng.choice([8, 16, 32])), microbatch_size=1)
    drawn = random_placement(rng, build_problem(scale_chain(chain, 1), cluster, config, POLICY), cluster)
    if drawn is None:
        return None
    problem = build_problem(scale_chain(chain, 1), cluster, config, POLICY)
    lost = lost_link_tests(problem, drawn)
    if not lost:
        return None
    base_ms = price_program(problem, drawn).step_ms
    row: dict = {"seed": seed, "lost": len(lost)}
    for share in SHARES:
        policy = dataclasses.replace(POLICY, link_test_cost=share)
        shared = build_problem(scale_chain(chain, 1), cluster, config, policy)
        kept = keep_link_tests(shared, drawn)
        row[f"left_{share:g}"] = len(lost_link_tests(shared, kept))
        row[f"step_ratio_{share:g}"] = round(price_program(shared, kept).step_ms / base_ms, 4)
        if share == SHARES[-1]:
            objective, simulated = simulated_ms(shared, kept, chain, cluster, config, policy)
            row["objective_vs_simulated"] = round((objective - simulated) / simulated, 4)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=None, help="random cases drawn (default 60; --quick: 4)")
    parser.add_argument("--out", default=None, help="the JSON to write (default benchmarks/results/link_tests.json, "
                                                    "none with --quick)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: the first few seeds, nothing written")
    args = parser.parse_args()
    seeds = args.seeds or (QUICK_SEEDS if args.quick else 60)
    out = args.out or (None if args.quick else str(Path(__file__).parent / "results" / "link_tests.json"))
    rows = [r for r in (case(s) for s in range(seeds)) if r is not None]
    print(f"{'seed':>5} {'lost':>5} " + " ".join(f"{'left@' + format(s, 'g'):>9} {'x@' + format(s, 'g'):>7}"
                                            for s in SHARES) + f" {'obj-sim':>8}")
    for r in rows:
        print(f"{r['seed']:>5} {r['lost']:>5} " + " ".join(
            f"{r[f'left_{s:g}']:>9} {r[f'step_ratio_{s:g}']:>7.3f}" for s in SHARES)
            + f" {100 * r['objective_vs_simulated']:>7.1f}%")
    summary = {"cases": len(rows),
               **{f"all_kept_at_{s:g}": sum(r[f"left_{s:g}"] == 0 for r in rows) for s in SHARES},
               "within_5pct": sum(abs(r["objective_vs_simulated"]) <= 0.05 for r in rows),
               "worst_objective_vs_simulated": max((r["objective_vs_simulated"] for r in rows), key=abs, default=None)}
    print(summary)
    if out is not None:
        Path(out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
