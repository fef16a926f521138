"""A run that goes on when a host fails or a rank is banned: re-plan without it and resume.

``launch`` stops every rank when one dies, hangs or raises, and names the rank whose failure stopped
the run (:class:`planner.runtime.launch.RunFailure`). Here that rank's host is excluded, the solver
plans again on the hosts that are left (``planner.api.replan``: a fresh solve under the same time
limit, the reason recorded, the plan signed), and the run resumes on the new plan from the newest
complete checkpoint, re-sharded by parameter name onto the new stages, so no finished step is lost.

A ban (:class:`planner.runtime.launch.RunBanned`) is handled the same way, except that the run
resumes from the last clean checkpoint: the newest one taken before the banned sender's first
flagged step (rank 0 set the later ones aside when it stopped), or from the start if there is none.
The verification policy has no setting that names a banned worker's trust domain for exclusion, so
only its host is excluded (``stagewise replan --exclude-domain`` does the rest by hand).
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Callable

from planner.api import replan
from planner.errors import InvalidInputError
from planner.outputs import write_atomic
from planner.plan_load import load_plan
from planner.runtime import checkpoint
from planner.runtime.bans import describe
from planner.runtime.launch import RunBanned, RunFailure, launch
from planner.runtime.options import RunOptions
from planner.secret import run_secret


def launch_replanning(opts: RunOptions, *, max_replans: int, time_limit_s: float = 30.0,
                      on_event: Callable[[dict[str, Any]], None] | None = None,
                      log_dir: str | None = None) -> dict[str, Any]:
    """``launch(opts)``; after a failure with a checkpoint to resume from, or a ban, up to ``max_replans``
    times: exclude the failed or banned rank's host, re-plan, resume. The result lists the re-plans
    (``replans``) and says what happened (``recovered``)."""
    if opts.checkpoint_dir is None:
        raise InvalidInputError("--replan-on-failure", expected="--checkpoint-dir DIR (a re-planned run resumes "
                                "from its checkpoints)", found="no checkpoint folder",
                                fix="add --checkpoint-dir DIR [--checkpoint-every N]")
    key = run_secret(opts.secret_file)
    replans: list[dict[str, Any]] = []
    while True:
        try:
            result = {**launch(opts, on_event=on_event, log_dir=log_dir), "replans": replans}
        except RunBanned as banned:
            if len(replans) >= max_replans:
                raise
            opts = _replan(opts, key, replans, _ban_event(opts, banned), time_limit_s)
        except RunFailure as failure:
            if len(replans) >= max_replans or not checkpoint.complete_steps(opts.checkpoint_dir):
                raise
            host = load_plan(opts.plan).ranks[failure.rank].host
            opts = _replan(opts, key, replans, {"after": failure.what, "excluded": host, "event": "failure"},
                           time_limit_s)
        else:
            if replans:
                result["recovered"] = "; ".join(f"{r['after']} -> re-planned without {r['excluded']}, resumed "
                                                f"after step {r['resumed_after_step']}" for r in replans)
                if opts.report:  # rank 0 wrote the last leg's report: add how the run got there
                    write_atomic(opts.report, json.dumps(result, indent=1, default=str) + "\n")
            return result


def _ban_event(opts: RunOptions, banned: RunBanned) -> dict[str, Any]:
    """What a ban means for the re-plan: the banned hosts, the reason, where the clean state is."""
    plan = load_plan(opts.plan)
    hosts = sorted({plan.ranks[n.rank].host for n in banned.notices})
    first = min(n.first_flagged_step for n in banned.notices)
    checkpoint.set_aside(opts.checkpoint_dir, from_step=first)  # rank 0 did it when it stopped; once more is a no-op
    reason = "; ".join(describe(n, plan.ranks[n.rank].host) for n in banned.notices)
    # The policy may hold a whole trust domain (one operator's machines) answerable for its host's attack.
    domains = sorted({h.trust for h in plan.effective_cluster().hosts if h.name in hosts}
                     if plan.policy.ban_excludes_domain else ())
    excluded = ", ".join(hosts + [f"trust domain {d}" for d in domains])
    return {"after": reason, "excluded": excluded, "hosts": hosts, "domains": domains, "event": "ban",
            "banned": [n.to_dict() for n in banned.notices]}


def _replan(opts: RunOptions, key: bytes, replans: list[dict[str, Any]], event: dict[str, Any],
            time_limit_s: float) -> RunOptions:
    """Re-plan without the event's hosts, record it in ``replans``, and return the options that resume."""
    plan = load_plan(opts.plan)
    hosts = event.pop("hosts", [event["excluded"]])
    new = replan(plan, exclude_hosts=hosts, exclude_domains=event.pop("domains", ()), reason=event["after"],
                 event=event["event"], time_limit_s=time_limit_s)
    path = Path(opts.checkpoint_dir) / f"plan-replan-{len(replans) + 1}.json"
    new.save(path, secret=key)
    steps = checkpoint.complete_steps(opts.checkpoint_dir)
    step = steps[-1] if steps else None  # no clean checkpoint: the new plan starts from the first step
    replans.append({**event, "plan": str(path), "ranks": new.num_ranks, "resumed_after_step": step,
                    "simulated_step_ms": round(new.predicted.step_ms, 3)})
    where = f"resuming after step {step}" if steps else "starting again from step 0 (no clean checkpoint)"
    print(f"stagewise run: {event['after']}; re-planned without host {event['excluded']} ({new.num_ranks} ranks, "
          f"{path}); {where}", file=sys.stderr, flush=True)
    # The new plan runs from the checkpoint; a rehearsed fault or attack named a rank of the old one.
    return dataclasses.replace(opts, plan=str(path), resume=bool(steps), fault=None, attacks=())

