"""``stagewise run PLAN``: run a plan's programs locally, one process per rank, and compare with the prediction.

Every rank becomes a local process (gloo on CPU, NCCL with CUDA). With
``--emulate-speed`` each rank's compute is padded to its planned device's
speed (the fastest planned device runs at this machine's speed), so a plan for
a heterogeneous cluster can be rehearsed here. The run ends with the
simulator's predicted step time beside the measured one.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import psutil

from planner.errors import InvalidInputError
from planner.outputs import check_writable, write_atomic
from planner.plan_load import load_plan
from planner.profiling.rehearsal_times import predict_here
from planner.rehearsal import local_device_type, rehearsal_note
from planner.runtime.data import check_data_file
from planner.runtime.launcher.elastic import launch_replanning, resumed_from
from planner.runtime.launcher.launch import launch
from planner.runtime.launcher.weights_out import launch_saving_weights
from planner.runtime.outputs.drops import (
    DROP_LIMIT,
    DROPS_EXIT_CODE,
    drops_line,
    too_many_drops,
)
from planner.runtime.outputs.tensorboard import summary_writer_class
from planner.runtime.run_args import add_run_arguments, options_from_args


def register(subparsers: argparse._SubParsersAction) -> None:

    p = subparsers.add_parser(
        "run", help="run a plan locally (one process per rank) and compare measured with predicted step time",
        description="Start one process per rank of PLAN on this machine, run --steps optimizer steps with "
                    "live progress, and print predicted vs measured step time. Ranks that die or hang "
                    "make the run stop within --timeout with an error naming the rank.")
    add_run_arguments(p)
    p.add_argument("--log-dir", help="keep each rank's log (and error record) in this folder")
    p.add_argument("--profile", metavar="PROFILE", dest="rehearsal_profile",
                   help="this machine's profile (stagewise profile): also print the simulator's step for this "
                        "run here (every rank on this machine, padded like --emulate-speed pads it)")
    p.add_argument("--save-weights", metavar="PATH", help="after the last step, write the trained weights as "
                   "one safetensors state dict in the model's own layout (names of the unsplit model, a tied "
                   "weight once; load with safetensors.torch.load_model); for an hf: model, a save_pretrained "
                   "folder (from_pretrained loads it)")
    p.add_argument("--replan-on-failure", type=int, default=0, metavar="N",
                   help="when a rank dies, hangs or fails, re-plan without its host and resume from the newest "
                        "checkpoint; when the verifiers ban a rank, the same from the last checkpoint before its "
                        "first flagged step; up to N times (needs --checkpoint-dir; default 0: the run stops). "
                        "The run also plans in hosts that join (see --join-dir)")
    p.add_argument("--join-dir", metavar="DIR", help="watch DIR for join requests (`stagewise join`): a host "
                   "re-admitted or new is planned in at the next checkpoint, and the run resumes there on the new "
                   "plan (default with --replan-on-failure: CHECKPOINT_DIR/joins; joins do not count against N)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )


    opts = options_from_args(args)
    elastic = bool(args.replan_on_failure or args.join_dir)
    if elastic and args.save_weights:
        flag = "--replan-on-failure" if args.replan_on_failure else "--join-dir"
        raise InvalidInputError(f"{flag} with --save-weights", expected="one of them", found="both",
                                fix="save the weights from the checkpoints afterwards")
    if args.replan_on_failure < 0:
        raise InvalidInputError("--replan-on-failure", expected="a count >= 0", found=str(args.replan_on_failure))
    outputs = (("--report", opts.report), ("--metrics", opts.metrics), ("--save-weights", args.save_weights))
    for flag, path in outputs:
        if path is not None:
            check_writable(path, what=flag)  # before any rank starts
    check_data_file(opts.data)  # a bad --data spec or file fails before the model is even built
    if opts.eval_data is not None:
        check_data_file(opts.eval_data)
    if opts.tensorboard is not None:
        summary_writer_class()  # the optional package is there, before any rank starts
    here = _rehearsal(opts, args.rehearsal_profile)  # a bad profile fails before any process starts
    console = Console(stderr=False)
    note = rehearsal_note(load_plan(opts.plan), opts.rehearse_dtype, local_device_type(opts.backend))
    if note:
        console.print(note, highlight=False)
    columns = (TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.description}"),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("starting ranks...", total=opts.steps)

        def on_event(event: dict[str, Any]) -> None:
            if event.get("event") != "step":
                return
            loss = event.get("loss")
            text = f"loss {loss:.4f}" if loss is not None else "loss n/a"
            if "eval_loss" in event:
                shown = event["eval_loss"]
                text += f"  eval loss {shown:.4f}" if shown is not None else "  eval loss n/a"
            dropped = f"  dropped {event['dropped']}" if event.get("dropped") else ""
            progress.update(task, completed=event["step"] + 1,
                            description=f"{text}  {event['step_ms']:.1f} ms/step{dropped}")

        if elastic:
            result = launch_replanning(opts, max_replans=args.replan_on_failure, on_event=on_event,
                                       log_dir=args.log_dir, join_dir=args.join_dir)
        elif args.save_weights is None:
            result = launch(opts, on_event=on_event, log_dir=args.log_dir)
        else:
            result = launch_saving_weights(opts, args.save_weights, on_event=on_event, log_dir=args.log_dir)
    console.print(summary_table(result, here))
    for r in result.get("replans", ()):
        start = "from the start" if r["resumed_after_step"] is None else f"after step {r['resumed_after_step']}"
        if r["event"] == "join":
            console.print(f"joined: {r['after']} -> re-planned with {', '.join(r['joined'])} at the checkpoint -> "
                          f"{r['plan']} ({r['ranks']} ranks, resumed {start})")
        else:
            console.print(f"recovered: re-planned without host {r['excluded']} after: {r['after']} -> {r['plan']} "
                          f"({r['ranks']} ranks, resumed {start}{resumed_from(r)})")
    for r in result.get("joins_rejected", ()):
        console.print(f"join request rejected: {r['file']}: {r['error']}")
    for path in result.get("joins_waiting", ()):
        console.print(f"join request not acted on (the run ended before its next checkpoint): {path}")
    if opts.report:
        if here is not None:
            _report_prediction(opts.report, here, plan=str(opts.plan))
        console.print(f"report written to {opts.report}")
    if result.get("weights"):
        console.print(f"trained weights written to {result['weights']}")
    untrained = result.get("untrained_steps") or []
    if untrained:  # every microbatch of these steps was dropped: the model is short of them
        console.print(f"[bold red]steps {untrained} trained nothing[/] (every microbatch was dropped by "
                      "verification): the run is not complete")
        return 1
    line = drops_line(result)
    if line:
        console.print(line, highlight=False)
    if too_many_drops(result):
        console.print(f"[bold red]more than {DROP_LIMIT:.0%} of the microbatches were dropped[/]: the model trained "
                      f"on less data than asked (exit {DROPS_EXIT_CODE})")
        return DROPS_EXIT_CODE
    return 0


def _rehearsal(opts, profile: str | None):
    """The simulated run of the plan on the machine ``profile`` describes (None without one)."""
    if profile is None:
        return None

    busy = psutil.cpu_percent(interval=0.5) / 100  # others' work now makes the prediction here unreliable
    return predict_here(load_plan(opts.plan), profile, emulate=opts.emulate, slowdown=opts.emulate_slowdown,
                        busy_now=busy, dtype=opts.rehearse_dtype, backend=opts.backend, data=opts.data,
                        clip=opts.clip_grad is not None, accumulate=opts.accumulate, verify=opts.verify)


def _report_prediction(path: str, here, *, plan: str) -> None:
    """The report keeps what the table shows of the prediction here, with the times measured here that priced
    it (``Rehearsal.to_json``): a later reader can reprice it. ``plan``: the plan it predicts (the run's first;
    after a re-plan the report's own ``plan`` is the last leg's)."""
    report = Path(path)
    doc = json.loads(report.read_text(encoding="utf-8")) if report.exists() else {}
    doc["predicted_here"] = {"plan": plan, **here.to_json()}
    write_atomic(report, json.dumps(doc, indent=1, default=str) + "\n")


def summary_table(result: dict[str, Any], here=None):
    """Predicted vs measured step time (``here``: the simulated run on this machine, from
    ``planner.rehearsal``), the loss, and verification counts."""
    from rich.table import Table

    pred, meas = result["predicted_step_ms"], result["measured_step_ms"]
    legs = result.get("legs") or []
    steps = f"{result['steps']} steps" if len(legs) < 2 else \
        f"{result['steps_run']} steps in {len(legs)} legs (the last: {result['steps']})"
    table = Table(title=f"{result['model']}: {result['num_ranks']} ranks, {result['schedule']}, {steps}"
                        + (", emulated speeds" if result.get("emulated") else ""))
    table.add_column("")
    table.add_column("value", justify="right")
    # The plan's own prediction is for its planned devices: shown, never divided into a local run.
    table.add_row("predicted step on the planned devices (simulator)", f"{pred:.2f} ms")
    table.add_row("measured step here (median after step 1)", f"{meas:.2f} ms")
    if here is not None:
        step = here.result.step_ms
        table.add_row(f"predicted step here (simulator, profile {here.device}, {here.cores} cores)", f"{step:.2f} ms")
        if here.warnings:
            table.add_row("measured / predicted here", "not comparable: " + "; ".join(here.warnings))
        else:
            table.add_row("measured / predicted here", f"{meas / step:.2f}x" if step > 0 else "n/a")
    loss = result.get("final_loss")
    table.add_row("final loss", "n/a" if loss is None or (isinstance(loss, float) and math.isnan(loss))
                  else f"{loss:.4f}")
    evals = result.get("eval_losses") or []
    if evals:
        last = evals[-1]
        table.add_row(f"validation loss (after step {last['step'] + 1})",
                      "n/a" if last["loss"] is None else f"{last['loss']:.4f}")
    checked = result.get("verified_boundaries") or []
    if checked:
        table.add_row("boundaries verified", ", ".join(map(str, checked)))
    if checked or result.get("attacks") or result.get("flags"):
        table.add_row("verifier flags", str(result.get("flags", 0)))
        if result.get("alerts"):
            table.add_row("  of which alerts (a shift no test can pin on its sender: no evidence)",
                          str(result["alerts"]))
        table.add_row("microbatches dropped", str(sum(result.get("dropped", []))))
        table.add_row("banned ranks", ", ".join(map(str, result.get("banned", []))) or "none")
        audited = audit_counts(result)
        if audited["run"]:
            table.add_row("replica audits run / failed (--audit-every)", f"{sum(audited['run'].values())} / "
                          f"{sum(audited['failed'].values())}: " + ", ".join(
                              f"rank {r} {n}/{audited['failed'].get(r, 0)}" for r, n in sorted(audited["run"].items())))
        if audited["suspended"]:
            table.add_row("audits stopped (see the verifier's events)", ", ".join(
                f"stage {k} from step {s}" for k, s in sorted(audited["suspended"].items())))
        signed = (result.get("audits") or {}).get("signed") or {}
        if signed.get("forged") or signed.get("voided"):
            table.add_row("signed inputs forged / audits voided by a replica's complaint",
                          f"{signed.get('forged', 0)} / {signed.get('voided', 0)}")
    replans = result.get("replans") or []
    recovered = sum(1 for r in replans if r["event"] != "join")
    if recovered:
        table.add_row("re-plans (recovered)", str(recovered))
    if len(replans) > recovered:
        table.add_row("re-plans (hosts joined)", str(len(replans) - recovered))
    if len(legs) > 1:
        for leg in legs:
            table.add_row(*leg_row(leg))
        table.add_row("steps run, all legs (redone ones included)", str(result["steps_run"]))
        table.add_row("steps redone", str(result["steps_redone"]))
    if result.get("untrained_steps"):
        table.add_row("steps that trained nothing", ", ".join(map(str, result["untrained_steps"])))
    return table


def audit_counts(result: dict[str, Any]) -> dict[str, dict[int, int]]:
    """The replicas' audits run and failed, per audited rank, and the stages whose audits stopped (from which
    step), as the verifier ranks reported them (``run_report.audit_counts``: the result's ``audits``)."""
    got = result.get("audits") or {}
    return {key: {int(r): int(n) for r, n in (got.get(key) or {}).items()} for key in ("run", "failed", "suspended")}


def leg_row(leg: dict[str, Any]) -> tuple[str, str]:
    """One leg of a recovered run (``planner.runtime.launcher.elastic``): its plan and how it went, for the table."""
    span = f"steps {leg['first_step']}-{leg['last_step']}" if leg["steps"] else "no step"
    redone = f", {leg['redone_steps']} redone" if leg["redone_steps"] else ""
    return (f"leg {leg['leg']}: {leg['ranks']} ranks ({leg['plan']})",
            f"{span} ({leg['steps']}), ended: {leg['ended']}{redone}")
