"""``stagewise replan PLAN --exclude HOST | --readmit HOST``: plan again without lost or banned machines, or with
one excluded by mistake put back; the change is recorded in the plan's history."""
from __future__ import annotations

import argparse
import time

from planner.replan import replan
from planner.commands._common import check_positive, check_seconds
from planner.commands.plan import _report
from planner.outputs import check_writable
from planner.plan_load import OperatorTrust
from planner.runtime.launcher.membership import load_signed_plan
from planner.secret import run_secret


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "replan", help="plan again without lost or banned hosts (or with excluded ones re-admitted); resume on it",
        description="Solve PLAN's model and training again on its cluster less the excluded hosts (or whole "
                    "trust domains) and those excluded before, less the re-admitted ones, with the full time "
                    "limit, warm-started from PLAN, and write the new plan, signed, its history extended. Then "
                    "`stagewise run NEW --resume --checkpoint-dir DIR` continues from the old run's newest "
                    "checkpoint, re-sharded onto the new stages.")
    p.add_argument("plan", help="the plan the run was using (signed by this run's secret)")
    p.add_argument("--exclude", action="append", default=[], metavar="HOST",
                   help="a host to leave out (repeatable): one that died, hung or was banned")
    p.add_argument("--exclude-domain", action="append", default=[], metavar="TRUST",
                   help="a whole trust domain to leave out (repeatable): a banned worker's, when it is not trusted")
    p.add_argument("--readmit", action="append", default=[], metavar="HOST",
                   help="a host excluded earlier to put back (repeatable): one banned by mistake, or repaired")
    p.add_argument("--why", default="by the operator", help="the reason, recorded in the new plan's history")
    p.add_argument("-o", "--output", required=True, help="where to write the new plan")
    p.add_argument("--time-limit", type=float, default=30.0, help="solver time limit in seconds (default 30)")
    p.add_argument("--workers", type=int, default=2, help="CP-SAT worker threads (default 2)")
    p.add_argument("--cold", action="store_true", help="solve from scratch, not warm-started from PLAN")
    p.add_argument("--secret-file", metavar="FILE", help="the run secret (as for `stagewise plan`)")
    p.add_argument("--cluster", metavar="NAME|FILE", help="the operator's cluster, whose trust the plan must match "
                   "(default: the cluster file the plan was made from)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    check_positive(args, "workers")
    check_seconds(args, "time_limit")
    check_writable(args.output, what="plan output")
    key = run_secret(args.secret_file)
    # a plan edited since it was signed, or unlike the operator's cluster, is not planned again and re-signed
    # Hosts' trust is checked here; the policy is the plan's to keep (running the new plan checks it).
    old, _ = load_signed_plan(args.plan, key, operator=OperatorTrust(cluster=args.cluster, verify=False))
    start = time.perf_counter()
    event = "readmit" if args.readmit and not (args.exclude or args.exclude_domain) else "manual"
    new = replan(old, exclude_hosts=args.exclude, exclude_domains=args.exclude_domain, readmit_hosts=args.readmit,
                 reason=args.why, event=event, time_limit_s=args.time_limit, workers=args.workers,
                 warm=not args.cold)
    path = new.save(args.output, secret=key)
    console = Console()
    _report(console, new, path)
    console.print(f"simulated step {new.predicted.step_ms:.3f} ms on {new.num_ranks} ranks, was "
                  f"{old.predicted.step_ms:.3f} ms on {old.num_ranks} ({time.perf_counter() - start:.1f} s)")
    return 0
