"""``stagewise simulate PLAN``: run the plan's programs against the cost model and print the result."""
from __future__ import annotations

import argparse
import math

from cost_models.measured import load_message_cost, load_sharing
from planner.commands._common import (
    add_plan_argument,
    check_positive,
    over_memory_ranks,
    rank_table,
)
from planner.errors import InvalidInputError
from planner.instruction_costs import CostModel
from planner.plan_load import load_plan
from planner.profiling.rehearsal_times import predict_here
from planner.simulate import simulate


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate", help="simulate one training step of a plan with the cost model",
        description="Interpret every rank's program with the cost model (compute, transfers, verification, "
                    "all-reduce, optimizer) and print the step time, bubble, per-rank busy/idle time and "
                    "peak memory.")
    add_plan_argument(p)
    p.add_argument("--cores", type=int, default=None,
                   help="all ranks share this many processors (a rehearsal on one machine): passes that overlap "
                        "split them (default: a device per rank)")
    p.add_argument("--sharing", metavar="PROFILE", default=None,
                   help="a profile JSON with a core sharing table (stagewise profile --sharing): how fast passes "
                        "that overlap progress on that machine (default: even sharing; --cores defaults to "
                        "the table's)")
    p.add_argument("--messages", metavar="PROFILE", default=None,
                   help="a profile JSON with per-message CPU costs (stagewise profile, with P2P): each send and "
                        "receive then occupies its rank (and, with --cores, a core) for its end of the message "
                        "(default: messages cost the ranks no processor time)")
    p.add_argument("--emulated", action="store_true",
                   help="slower devices are rehearsed by padding passes with sleeps (stagewise run --emulate-speed): "
                        "the padding holds no core")
    p.add_argument("--rehearse", metavar="PROFILE", default=None,
                   help="price `stagewise run --emulate-speed` of the plan on the machine PROFILE describes "
                        "(stagewise profile): every rank there at its speed, padded to the planned speed ratios, "
                        "over its measured link, with its core sharing and message costs if measured "
                        "(--cores defaults to its sharing table's, else this machine's)")
    p.add_argument("--emulate-slowdown", type=float, default=1.0, metavar="K",
                   help="with --rehearse: the fastest planned device K times slower than that machine "
                        "(stagewise run --emulate-slowdown)")
    p.set_defaults(handler=run)


def _from_profile(flag: str, path: str | None, load, what: str, fix: str):
    """What ``load`` reads from the profile at ``path`` (None without the flag), or an error naming ``flag``."""
    if path is None:
        return None
    try:
        got = load(path)
    except (OSError, ValueError) as exc:
        raise InvalidInputError(f"{flag} {path}", expected="a readable profile JSON",
                                found=type(exc).__name__) from None
    if got is None:
        raise InvalidInputError(f"{flag} {path}", expected=f"a profile with {what}", found="none measured", fix=fix)
    return got


def _sharing(args: argparse.Namespace):

    return _from_profile("--sharing", args.sharing, load_sharing, "a core sharing table",
                         "profile with `stagewise profile --sharing`")


def _messages(args: argparse.Namespace):

    return _from_profile("--messages", args.messages, load_message_cost, "per-message CPU costs",
                         "profile with P2P (stagewise profile, without --no-p2p)")


def _rehearse(args: argparse.Namespace, plan) -> int:
    """``--rehearse PROFILE``: the plan's run on the profiled machine (``planner.rehearsal``)."""
    from rich.console import Console


    for flag, value in (("--sharing", args.sharing), ("--messages", args.messages)):
        if value is not None:
            raise InvalidInputError(f"{flag} with --rehearse", expected="one profile",
                                    found="two", fix=f"drop {flag}: --rehearse takes it from its profile")
    here = predict_here(plan, args.rehearse, emulate=True, slowdown=args.emulate_slowdown, cores=args.cores)
    result = here.result
    console = Console()
    console.print(f"[bold]{plan.model.name}[/]: `stagewise run --emulate-speed` here ({here.device}, {here.cores} "
                  f"core(s), {'measured' if here.measured_sharing else 'even'} core sharing"
                  f"{', measured message costs' if here.measured_messages else ''}"
                  f"{', its stages and checks timed here' if here.timed else ''}"
                  f"{f', slowdown {args.emulate_slowdown:g}' if args.emulate_slowdown != 1.0 else ''})")
    console.print(f"step {result.step_ms:.3f} ms (pipeline {result.pipeline_ms:.3f} ms + optimizer), "
                  f"bubble {100 * result.bubble_fraction:.1f}%; on the planned devices "
                  f"{plan.predicted.step_ms:.3f} ms")
    return 0


def run(args: argparse.Namespace) -> int:
    from rich.console import Console


    check_positive(args, "cores")
    if not (math.isfinite(args.emulate_slowdown) and args.emulate_slowdown >= 1.0):
        raise InvalidInputError("--emulate-slowdown", expected="a finite factor >= 1", found=str(args.emulate_slowdown))
    if args.rehearse is not None:
        return _rehearse(args, load_plan(args.plan))
    if args.emulate_slowdown != 1.0:
        raise InvalidInputError("--emulate-slowdown", expected="--rehearse PROFILE as well",
                                found="a slowdown without a rehearsal", fix="add --rehearse PROFILE")
    sharing = _sharing(args)
    messages = _messages(args)
    cores = args.cores if args.cores is not None or sharing is None else sharing.cores
    plan = load_plan(args.plan)
    costs = CostModel.for_plan(plan)
    result = simulate(plan, costs, cores=cores, sharing=sharing, emulated=args.emulated, messages=messages)
    console = Console()
    console.print(f"[bold]{plan.model.name}[/] ({plan.model.spec}): {plan.schedule}, {plan.num_stages} stages, "
                  f"{plan.num_microbatches} microbatches, {plan.num_ranks} ranks on {plan.cluster.get('name')}")
    if cores is not None:
        how = "at the measured sharing speeds" if sharing is not None else "split evenly"
        console.print(f"ranks share {cores} core(s), {how}" + (", slower devices emulated" if args.emulated else ""))
    if messages is not None:
        console.print(f"messages cost their sender {messages.send_ms:.3f} ms + {messages.send_ms_per_mib:.3f} ms/MiB "
                      f"and their receiver {messages.recv_ms:.3f} ms + {messages.recv_ms_per_mib:.3f} ms/MiB of CPU")
    console.print(f"step {result.step_ms:.3f} ms (pipeline {result.pipeline_ms:.3f} ms + optimizer), "
                  f"bubble {100 * result.bubble_fraction:.1f}%, "
                  f"solver objective {plan.report.objective_ms:.3f} ms ({plan.report.method})")
    console.print(rank_table(plan, result, costs, "per rank"))
    over = over_memory_ranks(plan, result, costs)
    if over:
        console.print(f"[bold red]warning:[/] rank(s) {', '.join(map(str, over))} exceed their device memory")
    return 0
