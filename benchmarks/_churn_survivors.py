"""The churn benchmark's variant: a plan with a replicated stage losing a replica or a sole stage rank."""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._churn_local import churn_trial

__all__ = ["print_survivors", "survivors_run"]


def _replicated_plan(folder: Path):
    """The local run's model and batch on 4 one-CPU hosts with the middle stage on two of them (the hand-made
    plans of the runtime tests), so a lost replica leaves its stage's state with its twin."""
    from tests.dist.plans import make_plan
    plan = make_plan("gpt-tiny", microbatch=2, num_microbatches=4, seq=32, stages=[(0, 1), (2, 3), (4, 5)],
                     replicas={1: (2, 2)}, optimizer="adam")
    return plan, plan.save(folder / "plan.json")


def survivors_run(steps: int, every: int, kills: list[tuple[int, int]]) -> dict[str, Any]:
    """Runs of the replicated plan that each lose a rank (``kills``: (rank, rank 0's reported step)) and
    resume from the survivors' state when it is whole (a lost replica) or from the checkpoint (a lost sole
    stage rank): per run, the steps redone and the recovery times."""
    folder = Path(tempfile.mkdtemp(prefix="churn-survivors-"))
    plan, path = _replicated_plan(folder)
    runs = [churn_trial(path, folder / f"t{i}", steps, kill_at, every, victim)
            for i, (victim, kill_at) in enumerate(kills)]
    return {"plan": {"model": "gpt-tiny", "hosts": 4, "ranks": plan.num_ranks, "stages": plan.num_stages,
                     "stage_of_rank": [r.stage for r in plan.ranks], "global_batch": plan.config.global_batch,
                     "seq": plan.model.seq},
            "steps": steps, "checkpoint_every": every, "load_average": os.getloadavg(), "trials": runs,
            "when": time.strftime("%Y-%m-%d %H:%M:%S")}


def print_survivors(r: dict[str, Any]) -> None:
    print(f"local {r['plan']['ranks']}-rank gpt-tiny, stages of the ranks {r['plan']['stage_of_rank']} ({r['steps']} "
          f"steps; checkpoints every {r['checkpoint_every']})", flush=True)
    for t in r["trials"]:
        print(f"  rank {t['victim']} SIGKILLed at rank 0's step {t['killed_after_step']}: resumed at step "
              f"{t['resumed_at_step']}, redone {t['redone_steps']} steps; detection {t['detect_s']:5.2f} s  re-plan "
              f"{t['replan_s']:5.2f} s  reload {t['reload_s']:5.2f} s  failure -> first resumed step "
              f"{t['recovery_s']:5.2f} s; survivors: {t['survivors']}", flush=True)
