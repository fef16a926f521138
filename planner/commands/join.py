"""``stagewise join PLAN --host NAME | --describe HOST.yaml --checkpoint-dir DIR``: ask a host into a running
run. The request is checked against the run's plan, signed with the run secret and written atomically into
the run's join folder; the run (``stagewise run --replan-on-failure N`` or ``--join-dir``) plans the host in
at its next checkpoint (``planner.runtime.recovery.joins``, ``planner.runtime.launcher.elastic``)."""
from __future__ import annotations

import argparse
from pathlib import Path

from planner.errors import InvalidInputError
from planner.runtime.launcher.membership import load_signed_plan
from planner.runtime.recovery import joins
from planner.secret import run_secret


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "join", help="ask a host into a running run: it is planned in at the run's next checkpoint",
        description="Write a join request for a running `stagewise run --checkpoint-dir DIR --replan-on-failure "
                    "N` (or --join-dir): a host the plan excludes, named (--host), or a new host, described "
                    "(--describe). The request is checked against PLAN, signed with the run secret and written "
                    "into DIR/joins (or --join-dir); at its next checkpoint the run re-plans with the host and "
                    "resumes there on the new plan.")
    p.add_argument("plan", help="the plan the run is on now: the last DIR/plan-replan-N.json it printed, else the "
                                "one it started with")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--host", metavar="NAME", help="a host of the plan's cluster that the plan excludes (lost, "
                       "banned or left out): re-admit it")
    which.add_argument("--describe", metavar="HOST.yaml", help="a new host: a YAML or JSON file holding one host "
                       "entry of a cluster file (name, region, trust, trusted, devices, ...; or a cluster file with "
                       "that one host under hosts:); it takes the cluster's links for its region")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--checkpoint-dir", metavar="DIR", help="the run's checkpoint folder (requests go to "
                       "DIR/joins)")
    where.add_argument("--join-dir", metavar="DIR", help="the folder the run watches (its --join-dir)")
    p.add_argument("--why", default="by the operator", help="the reason, recorded in the new plan's history")
    p.add_argument("--secret-file", metavar="FILE", help="the run secret (as for `stagewise run`)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    key = run_secret(args.secret_file)
    plan, _ = load_signed_plan(args.plan, key)  # the run's own plan: signed with the same secret
    if not args.why.strip():
        raise InvalidInputError("--why", expected="a reason", found="an empty one")
    request = joins.make_request(plan, host=args.host, description=args.describe, why=args.why)
    folder = Path(args.join_dir) if args.join_dir else Path(args.checkpoint_dir) / joins.FOLDER
    if not folder.is_dir():  # a mistyped folder would take the request and no run would ever read it
        raise InvalidInputError(f"join folder {folder}", expected="the folder of a run that watches for joins",
                                found="no such folder", fix="check the path; a run started with --checkpoint-dir "
                                "DIR and --replan-on-failure N (or --join-dir) makes it when it starts")
    path = joins.write_request(folder, request, key)
    print(f"join request written: {path} ({request.describe()}); the run watching {folder} plans "
          f"{request.host} in at its next checkpoint")
    return 0
