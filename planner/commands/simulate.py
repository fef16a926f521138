"""``stagewise simulate PLAN``: run the plan's programs against the cost model and print the result."""
from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate", help="simulate one training step of a plan with the cost model",
        description="Interpret every rank's program with the cost model (compute, transfers, verification, "
                    "all-reduce, optimizer) and print the step time, bubble, per-rank busy/idle time and "
                    "peak memory.")
    p.add_argument("plan", help="plan JSON written by `stagewise plan`")
    p.set_defaults(handler=run)


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f}"


def rank_table(plan, result, title: str):
    """The per-rank table shared by ``simulate`` and ``show``."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("rank", "device", "role", "mbs", "busy ms", "idle ms", "in flight", "memory GiB"):
        table.add_column(col, justify="left" if col in ("device", "role") else "right")
    for info in plan.ranks:
        r = info.rank
        role = f"stage {info.stage}" if info.stage is not None else "verifier"
        if info.stage is not None and len(plan.stage_ranks(info.stage)) > 1:
            role += f".{info.replica}"
        if info.verifies:
            role += f" +v{','.join(map(str, info.verifies))}"
        mem_total = _device_mem(plan, info.device)
        peak = result.peak_mem_bytes[r]
        table.add_row(str(r), info.device_type, role, str(len(info.microbatches)),
                      f"{result.busy_ms[r]:.1f}", f"{result.idle_ms[r]:.1f}",
                      f"{result.peak_in_flight[r]}/{info.max_in_flight}" if info.stage is not None else "-",
                      f"{_gib(peak)}/{mem_total / 2**30:.0f}", style="bold red" if peak > mem_total else None)
    return table


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from planner.plan import load_plan
    from planner.simulate import simulate

    plan = load_plan(args.plan)
    result = simulate(plan)
    console = Console()
    console.print(f"[bold]{plan.model.name}[/] ({plan.model.spec}): {plan.schedule}, {plan.num_stages} stages, "
                  f"{plan.num_microbatches} microbatches, {plan.num_ranks} ranks on {plan.cluster.get('name')}")
    console.print(f"step {result.step_ms:.3f} ms (pipeline {result.pipeline_ms:.3f} ms + optimizer), "
                  f"bubble {100 * result.bubble_fraction:.1f}%, "
                  f"solver objective {plan.report.objective_ms:.3f} ms ({plan.report.method})")
    console.print(rank_table(plan, result, "per rank"))
    over = [info.rank for info in plan.ranks
            if result.peak_mem_bytes[info.rank] > _device_mem(plan, info.device)]
    if over:
        console.print(f"[bold red]warning:[/] rank(s) {', '.join(map(str, over))} exceed their device memory")
    return 0


def _device_mem(plan, device_id: str) -> int:
    from cost_models.cluster import ClusterSpec
    return ClusterSpec.from_dict(plan.cluster).device(device_id).spec.mem_bytes
