"""``stagewise profile``: measure this machine's device and write a profile JSON.

A cluster file can then name the JSON as a device type:
``devices: [{type: ./my-box.json, count: 1}]``.
"""
from __future__ import annotations

import argparse

from models.registry import PRESETS
from planner.commands._common import add_shape_arguments, check_positive
from planner.errors import InvalidInputError
from planner.outputs import check_writable
from planner.profiling.clocks import STATISTICS
from planner.profiling.profile import ProfileSettings, profile_device, write_profile


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "profile", help="measure this machine's device (matmul, memory, blocks, P2P) into a profile JSON",
        description="Measure matmul throughput per dtype, memory bandwidth, per-block forward/backward time "
                    "of a model preset and local P2P bandwidth/latency; fit the cost model's efficiency.")
    p.add_argument("-o", "--output", default="profile.json", help="profile JSON to write (default: profile.json)")
    p.add_argument("--model", default=None, help="preset whose blocks are timed (default: gpt-small; "
                                                 "gpt-tiny with --quick)")
    add_shape_arguments(p, batch_help="batch for the timed blocks")
    p.add_argument("--quick", action="store_true", help="small sizes and few repeats: seconds, not minutes")
    p.add_argument("--no-p2p", action="store_true", help="skip the two-process P2P measurement")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall time (default), or process CPU time: steadier on a shared machine; "
                        "needs --threads 1 and a CPU device")
    p.add_argument("--statistic", default="min",
                   help="summary of the repeated block timings: min (default; what the device does undisturbed) "
                        "or median (what a long run of passes averages on a shared machine)")
    p.add_argument("--sharing", action="store_true",
                   help="also measure how fast 1..2 x cores single-thread processes computing at once progress "
                        "here (for `stagewise simulate --cores N --sharing PROFILE`)")
    p.set_defaults(handler=run)


def _settings(args: argparse.Namespace):
    import dataclasses


    check_positive(args, "batch", "seq", "threads")
    base = ProfileSettings.quick(args.model) if args.quick else ProfileSettings(model=args.model or "gpt-small")
    if args.statistic not in STATISTICS:
        raise InvalidInputError("--statistic", expected=" or ".join(STATISTICS), found=repr(args.statistic),
                                fix="pass --statistic min or --statistic median")
    changes: dict = {"p2p": not args.no_p2p, "clock": args.clock, "statistic": args.statistic,
                     "sharing": args.sharing}
    if args.batch is not None:
        changes["batch"] = args.batch
    if args.seq is not None:
        changes["seq"] = args.seq
    if args.seq is None and not _is_language_model(base.model):
        changes["seq"] = None  # the short default sequence is for LMs; others keep the preset's shape
    return dataclasses.replace(base, **changes)


def _is_language_model(spec: str) -> bool:
    preset = PRESETS.get(spec)
    return preset is not None and preset.family == "lm"


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )
    from rich.table import Table


    settings = _settings(args)
    import torch
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    out = check_writable(args.output, what="-o")  # before the minute of measuring
    err = Console(stderr=True)
    total = 6 + (2 if settings.p2p else 0) + (1 if settings.sharing else 0) + (1 if torch.cuda.is_available() else 0)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                  console=err, transient=True) as progress:
        task = progress.add_task("profiling", total=total)

        def step(msg: str) -> None:
            progress.update(task, description=f"measuring {msg}", advance=1)
        doc = profile_device(settings, step=step)
    write_profile(doc, out)

    dev, cal = doc["device"], doc["calibration"]
    table = Table(title=f"profile of {dev['name']} -> {out}")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for dtype, flops in dev["peak_flops"].items():
        table.add_row(f"matmul {dtype}", f"{flops / 1e9:,.1f} GFLOP/s")
    table.add_row("memory bandwidth", f"{dev['mem_bw_bytes_per_s'] / 1e9:,.1f} GB/s")
    table.add_row("efficiency (fitted)", f"{cal['efficiency']:.3f}")
    table.add_row("op overhead (fitted)", f"{cal['op_overhead_ms'] * 1e3:.1f} us")
    if dev.get("optim_op_ms") is not None:
        table.add_row("optimizer kernel (Adam)", f"{dev['optim_op_ms'] * 1e3:.1f} us")
    table.add_row("block fit median |err|", f"{cal['median_abs_rel_err']:.1%} over {cal['n_samples']} timings")
    if doc["p2p"]:
        table.add_row(f"p2p {doc['p2p']['backend']} bandwidth", f"{doc['p2p']['bandwidth_gbps']:.2f} Gb/s")
        table.add_row(f"p2p {doc['p2p']['backend']} latency", f"{doc['p2p']['latency_ms']:.3f} ms")
        msg = doc["p2p"].get("messages")
        if msg:
            table.add_row("CPU per message (send / receive)",
                          f"{msg['send_ms']:.3f} + {msg['send_ms_per_mib']:.3f}/MiB / "
                          f"{msg['recv_ms']:.3f} + {msg['recv_ms_per_mib']:.3f}/MiB ms")
            if doc["p2p"].get("executor"):
                table.add_row("executor CPU (per message / per pass)",
                              f"{msg.get('executor_ms', 0.0):.3f} / {msg.get('executor_pass_ms', 0.0):.3f} ms")
    if doc.get("sharing"):
        speeds = doc["sharing"]["speed"]
        table.add_row("speed of k processes at once", ", ".join(f"{k}: {v:.2f}" for k, v in enumerate(speeds, 1)))
    Console().print(table)
    return 0
