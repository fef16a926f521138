"""``stagewise simulate PLAN``: run the plan's programs against the cost model and print the result."""
from __future__ import annotations

import argparse

from planner.commands._common import add_plan_argument, load_and_simulate, over_memory_ranks, rank_table


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate", help="simulate one training step of a plan with the cost model",
        description="Interpret every rank's program with the cost model (compute, transfers, verification, "
                    "all-reduce, optimizer) and print the step time, bubble, per-rank busy/idle time and "
                    "peak memory.")
    add_plan_argument(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    plan, costs, result = load_and_simulate(args.plan)
    console = Console()
    console.print(f"[bold]{plan.model.name}[/] ({plan.model.spec}): {plan.schedule}, {plan.num_stages} stages, "
                  f"{plan.num_microbatches} microbatches, {plan.num_ranks} ranks on {plan.cluster.get('name')}")
    console.print(f"step {result.step_ms:.3f} ms (pipeline {result.pipeline_ms:.3f} ms + optimizer), "
                  f"bubble {100 * result.bubble_fraction:.1f}%, "
                  f"solver objective {plan.report.objective_ms:.3f} ms ({plan.report.method})")
    console.print(rank_table(plan, result, costs, "per rank"))
    over = over_memory_ranks(plan, result, costs)
    if over:
        console.print(f"[bold red]warning:[/] rank(s) {', '.join(map(str, over))} exceed their device memory")
    return 0
