"""The churn benchmark's goals, its churn model's run and its --quick sizes."""
from __future__ import annotations

from pathlib import Path

__all__ = ["CHECKPOINT_EVERY", "CHURN_EVERY", "CHURN_STEPS", "GOALS", "QUICK", "ROOT", "WAIT_S"]

ROOT = Path(__file__).resolve().parents[1]
GOALS = {"replan_176_s": 10.0, "local_recovery_s": 30.0, "churn_vs_restart": 1.5}
WAIT_S = 60.0          # checkpoint-restart: the wait for a replacement device
CHECKPOINT_EVERY = 10  # the runtime's default --checkpoint-every
CHURN_STEPS = 1000
CHURN_EVERY = (20, 50, 100)
# --quick: gpt-tiny for part 1; part 2's run on 3 hosts, killed after its first checkpoint (its steps take
# milliseconds: many are left for the kill to land before the run ends)
QUICK = {"model": "gpt-tiny", "limit": 1.0, "hosts": 3, "steps": 40, "kill_at": 6, "every": 5}
