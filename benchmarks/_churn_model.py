"""The churn benchmark's throughput model (part 3): a run that loses a worker every N steps, three ways."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks._churn_config import (
    CHECKPOINT_EVERY,
    CHURN_EVERY,
    CHURN_STEPS,
    WAIT_S,
)

__all__ = ["ChurnCase", "churn_row", "churn_table", "print_churn", "restart_s", "stagewise_s", "steady_s"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ChurnCase:
    """A run of ``steps`` steps that loses a worker every ``every`` steps, and the measured pieces."""

    steps: int
    every: int
    checkpoint_every: int
    step_s: float            # the original plan's step
    replanned_step_s: float  # the re-planned plan's step (one host fewer)
    detect_s: float          # failure -> the launcher has stopped the run and named the rank
    replan_s: float          # the re-plan's wall time
    reload_s: float          # new processes, rendezvous, checkpoint load (to the first resumed step)
    wait_s: float = WAIT_S   # a replacement device comes this long after a failure
    samples_per_step: int = 1
    # Of a checkpoint interval, redone per failure by Stagewise (0: every stage on the lost host kept a replica
    # elsewhere, so the run resumes from the survivors' state); checkpoint-restart always redoes half.
    redone_share: float = 0.5

    @property
    def failures(self) -> int:
        """Failures strike after every ``every`` completed steps, before the last step."""
        return (self.steps - 1) // self.every

    @property
    def redone_steps(self) -> float:
        """Steps Stagewise redoes per failure: half a checkpoint interval on average, or none."""
        return self.checkpoint_every * self.redone_share


def _after_failure_s(c: ChurnCase, steps: int, rejoin: bool) -> float:
    """One failure and the ``steps`` steps up to the next: recovery, the redone steps, then the steps on the
    re-planned plan; with ``rejoin``, when it pays, the replacement (there ``wait_s`` after the failure) is
    planned back in at the first checkpoint after it came (a planned re-plan and reload: nothing detected,
    nothing redone) and the rest run at the original step."""
    recovery = c.detect_s + c.replan_s + c.reload_s + c.redone_steps * c.replanned_step_s
    stay = recovery + steps * c.replanned_step_s
    waited = max(c.wait_s - recovery, 0.0)
    degraded = c.checkpoint_every * math.ceil(waited / (c.replanned_step_s * c.checkpoint_every))
    if not rejoin or degraded >= steps:
        return stay
    back = recovery + degraded * c.replanned_step_s + c.replan_s + c.reload_s + (steps - degraded) * c.step_s
    return min(stay, back)


def stagewise_s(c: ChurnCase, *, rejoin: bool = True) -> float:
    """Re-plan on the remaining devices and resume from the newest checkpoint (and, with ``rejoin``, plan the
    replacement back in when that pays)."""
    total = min(c.steps, c.every) * c.step_s
    for k in range(1, c.failures + 1):
        total += _after_failure_s(c, min(c.every, c.steps - k * c.every), rejoin)
    return total


def restart_s(c: ChurnCase) -> float:
    """Wait for a replacement and restart the original plan from its last checkpoint."""
    per_failure = c.detect_s + c.wait_s + c.reload_s + c.checkpoint_every / 2 * c.step_s
    return c.steps * c.step_s + c.failures * per_failure


def steady_s(c: ChurnCase) -> float:
    return c.steps * c.step_s


def churn_row(c: ChurnCase) -> dict[str, Any]:
    """Times, throughputs (samples/s) and the ratios the goal reads."""
    times = {"stagewise_s": stagewise_s(c), "stagewise_no_rejoin_s": stagewise_s(c, rejoin=False),
             "restart_s": restart_s(c), "no_failure_s": steady_s(c)}
    rate = {k.removesuffix("_s") + "_samples_per_s": c.steps * c.samples_per_step / v for k, v in times.items()}
    restart = times["restart_s"]
    return {**asdict(c), "failures_count": c.failures, **times, **rate,
            "stagewise_vs_restart": restart / times["stagewise_s"],
            "stagewise_vs_no_failure": times["no_failure_s"] / times["stagewise_s"],
            # Stagewise resuming without redoing steps (every lost stage kept by a surviving replica).
            "no_redo_vs_restart": restart / stagewise_s(dataclasses.replace(c, redone_share=0.0)),
            # What any recovery could reach: failures that cost nothing at all.
            "ceiling_vs_restart": restart / times["no_failure_s"]}


def churn_table(replans: list[dict[str, Any]], local: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    sources = [(f"{r['devices']} devices", r["first"]["simulated_ms"] / 1000, r["replan"]["simulated_ms"] / 1000,
                r["replan"]["wall_s"], r["global_batch"], r.get("lost_stages_kept", False)) for r in replans]
    # the local run's lost rank is a sole stage rank
    sources.append((f"local {local['plan']['hosts']}-rank run (measured steps)", local["step_s"],
                    local["replanned_step_s"], local["replan_s"], local["samples_per_step"], False))
    for label, step_s, new_step_s, replan_s, batch, kept in sources:
        for every in CHURN_EVERY:
            case = ChurnCase(steps=CHURN_STEPS, every=every, checkpoint_every=CHECKPOINT_EVERY, step_s=step_s,
                             replanned_step_s=new_step_s, detect_s=local["detect_s"], replan_s=replan_s,
                             reload_s=local["reload_s"], samples_per_step=batch, redone_share=0.0 if kept else 0.5)
            rows.append({"plan": label, **churn_row(case)})
    return rows


def print_churn(row: dict[str, Any]) -> None:
    print(f"{row['plan']:>34} N={row['every']:<4} step {row['step_s']:7.3f} -> {row['replanned_step_s']:7.3f} s  "
          f"samples/s: stagewise {row['stagewise_samples_per_s']:9.2f}  restart {row['restart_samples_per_s']:9.2f}"
          f"  none {row['no_failure_samples_per_s']:9.2f}  (no rejoin {row['stagewise_no_rejoin_samples_per_s']:9.2f})"
          f"  stagewise/restart {row['stagewise_vs_restart']:5.2f}x  "
          f"stagewise/none {row['stagewise_vs_no_failure']:5.2f}  (no redo {row['no_redo_vs_restart']:5.2f}x, "
          f"ceiling {row['ceiling_vs_restart']:5.2f}x)", flush=True)
