"""A run that goes on when a host fails: re-plan without it and resume from the newest checkpoint.

``launch`` stops every rank when one dies, hangs or raises, and names the rank whose failure stopped
the run (:class:`planner.runtime.launch.RunFailure`). Here that rank's host is excluded, the solver
plans again on the hosts that are left (``planner.api.replan``: a fresh solve under the same time
limit, the reason recorded, the plan signed), and the run resumes on the new plan from the newest
complete checkpoint, re-sharded by parameter name onto the new stages, so no finished step is lost.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, Callable

from planner.api import replan
from planner.errors import InvalidInputError
from planner.plan_load import load_plan
from planner.runtime import checkpoint
from planner.runtime.launch import RunFailure, launch
from planner.runtime.options import RunOptions
from planner.secret import run_secret


def launch_replanning(opts: RunOptions, *, max_replans: int, time_limit_s: float = 30.0,
                      on_event: Callable[[dict[str, Any]], None] | None = None,
                      log_dir: str | None = None) -> dict[str, Any]:
    """``launch(opts)``; after a failure with a checkpoint to resume from, up to ``max_replans`` times:
    exclude the failed rank's host, re-plan, resume. The result lists the re-plans (``replans``)."""
    if opts.checkpoint_dir is None:
        raise InvalidInputError("--replan-on-failure", expected="--checkpoint-dir DIR (a re-planned run resumes "
                                "from its checkpoints)", found="no checkpoint folder",
                                fix="add --checkpoint-dir DIR [--checkpoint-every N]")
    key = run_secret(opts.secret_file)
    replans: list[dict[str, Any]] = []
    while True:
        try:
            return {**launch(opts, on_event=on_event, log_dir=log_dir), "replans": replans}
        except RunFailure as failure:
            if len(replans) >= max_replans or not checkpoint.complete_steps(opts.checkpoint_dir):
                raise
            plan = load_plan(opts.plan)
            host = plan.ranks[failure.rank].host
            new = replan(plan, exclude_hosts=[host], reason=failure.what, time_limit_s=time_limit_s)
            path = Path(opts.checkpoint_dir) / f"plan-replan-{len(replans) + 1}.json"
            new.save(path, secret=key)
            step = checkpoint.complete_steps(opts.checkpoint_dir)[-1]
            replans.append({"after": failure.what, "excluded": host, "plan": str(path), "ranks": new.num_ranks,
                            "resumed_after_step": step, "simulated_step_ms": round(new.predicted.step_ms, 3)})
            print(f"stagewise run: {failure.what}; re-planned without host {host} ({new.num_ranks} ranks, "
                  f"{path}); resuming after step {step}", file=sys.stderr, flush=True)
            # The new plan runs from the checkpoint; a rehearsed fault belonged to the old one.
            opts = dataclasses.replace(opts, plan=str(path), resume=True, fault=None)
