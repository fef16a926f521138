"""``stagewise show PLAN [--out DIR]``: tables per stage and per rank, and a Gantt chart of one step.

The chart is written as ``<plan name>-gantt.png`` and ``.svg`` into ``--out``
(default: the plan's folder).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from planner.commands._common import (
    add_plan_argument,
    load_and_simulate,
    rank_table,
    seq_text,
)
from planner.errors import InvalidInputError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "show", help="print a plan's stages and ranks and draw a Gantt chart of one step",
        description="Print a table per stage (blocks, parameters, devices, time per microbatch) and per rank "
                    "(memory used of available, busy time), and write a Gantt chart of one simulated step "
                    "as PNG and SVG.")
    add_plan_argument(p)
    p.add_argument("--out", default=None, help="folder for the Gantt chart (default: the plan's folder)")
    p.set_defaults(handler=run)


def stage_table(plan, costs):
    """Per stage: blocks, parameters, devices, forward+backward time per microbatch, sends on the wire (and
    their codec), the all-reduce's codec, verifier."""
    from rich.table import Table

    table = Table(title="stages")
    for col in ("stage", "blocks", "params M", "devices", "F+B ms/mb", "sends MiB", "codec", "all-reduce",
                "verifier"):
        table.add_column(col, justify="left" if col in ("blocks", "devices", "codec", "all-reduce", "verifier")
                         else "right")
    for st in plan.stages:
        ranks = plan.stage_ranks(st.index)
        names = st.block_names
        blocks = names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
        devices = ",".join(plan.ranks[r].device_type for r in ranks)
        times = "/".join(f"{costs.compute_ms(r, 'F') + costs.compute_ms(r, 'B'):.1f}" for r in ranks)
        last = st.index == plan.num_stages - 1
        out_mib = 0.0 if last else costs.wire_bytes[st.index] / 2**20
        checker = "; ".join(f"r{v.rank} {v.label()}" for v in plan.verifiers if v.boundary == st.index) or "-"
        reduce = st.allreduce_codec if len(ranks) > 1 else "-"
        table.add_row(str(st.index), blocks, f"{st.param_count / 1e6:.1f}", devices, times, f"{out_mib:.2f}",
                      "-" if last else st.out_codec, reduce, checker)
    return table


def history_lines(plan) -> list[str]:
    """The hosts the plan leaves out, ``history (N):`` and one line per entry, oldest first."""
    excluded = [f"excluded hosts: {', '.join(plan.excluded_hosts)}"] if plan.excluded_hosts else []
    if not plan.history:
        return excluded
    return [*excluded, f"history ({len(plan.history)}):",
            *(f"  {i}. {e.summary()}" for i, e in enumerate(plan.history, 1))]


def run(args: argparse.Namespace) -> int:
    from rich.console import Console


    plan, costs, result = load_and_simulate(args.plan)
    console = Console()
    console.print(f"[bold]{plan.model.name}[/] ({plan.model.spec}), {plan.schedule}, {plan.num_microbatches} "
                  f"microbatches of {plan.config.microbatch_size}{seq_text(plan.model.seq)}; solver: {plan.report.method} "
                  f"{plan.report.status}, objective {plan.report.objective_ms:.3f} ms")
    console.print(stage_table(plan, costs))
    for line in history_lines(plan):  # soft wrap: one terminal line per entry, whatever its width
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    console.print(rank_table(plan, result, costs, f"ranks: step {result.step_ms:.3f} ms, "
                                                  f"bubble {100 * result.bubble_fraction:.1f}%"))
    out = Path(args.out) if args.out is not None else Path(args.plan).resolve().parent
    if out.exists() and not out.is_dir():
        raise InvalidInputError(f"--out {out}", expected="a folder", found="a file",
                                fix="pass a folder to --out, or omit it to write beside the plan")
    try:
        # matplotlib takes ~0.6 s to import: only when drawing.
        from planner.gantt import write_gantt

        written = write_gantt(plan, result, out / f"{Path(args.plan).stem}-gantt")
    except OSError as exc:
        raise InvalidInputError(f"cannot write the Gantt chart into {out}", expected="a writable folder",
                                found=str(exc), fix="pick another --out folder") from None
    console.print("Gantt chart: " + ", ".join(str(p) for p in written))
    return 0
