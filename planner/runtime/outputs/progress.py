"""Rank 0's view of a run as it goes: every rank's per-step metrics, collected without a barrier, and
the per-step output (JSON events for the local launcher, or text lines under torchrun)."""
from __future__ import annotations

import json
import math
from typing import Any

import torch

from planner.runtime.options import EVENT_PREFIX
from planner.runtime.outputs.drops import drops_line
from planner.runtime.rank.metrics import StepMetrics, StepSummary
from planner.runtime.wire import comm
from planner.runtime.wire.comm import Kind


class Progress:
    """Rank 0's per-step output: JSON events for the local launcher, or text lines under torchrun."""

    def __init__(self, *, events: bool, steps: int) -> None:
        self.events = events
        self.steps = steps

    def emit(self, kind: str, payload: dict[str, Any]) -> None:
        if self.events:
            print(EVENT_PREFIX + json.dumps({"event": kind, **payload}, allow_nan=False), flush=True)

    def step(self, s: StepSummary) -> None:
        loss = s.loss if math.isfinite(s.loss) else None
        payload = {"step": s.step, "loss": loss, "step_ms": s.step_ms, "dropped": s.dropped}
        if s.eval_loss is not None:
            payload["eval_loss"] = s.eval_loss if math.isfinite(s.eval_loss) else None
        self.emit("step", payload)
        if not self.events:
            text = "n/a" if loss is None else f"{loss:.4f}"
            shown = "" if s.eval_loss is None else f"  eval loss {s.eval_loss:.4f}"
            print(f"step {s.step + 1}/{self.steps}  loss {text}{shown}  step {s.step_ms:.1f} ms", flush=True)

    def done(self, result: dict[str, Any]) -> None:
        self.emit("done", result)
        if not self.events:
            print(format_comparison(result), flush=True)
            line = drops_line(result)
            if line:
                print(line, flush=True)
            if result.get("untrained_steps"):
                print(f"steps {result['untrained_steps']} trained nothing (every microbatch was dropped by "
                      "verification): the run is not complete", flush=True)


def format_comparison(result: dict[str, Any]) -> str:
    pred, meas = result["predicted_step_ms"], result["measured_step_ms"]
    ratio = meas / pred if pred > 0 else math.inf
    slowdown = result.get("emulate_slowdown", 1.0)
    how = ""
    if result.get("emulated"):
        how = ", compute emulated to planned speeds" + (f" / {slowdown:g}" if slowdown != 1.0 else "")
    return (f"predicted {pred:.1f} ms/step (simulator, planned devices), measured {meas:.1f} ms/step here "
            f"(x{ratio:.2f}{how})")


class MetricsCollector:
    """Rank 0 receives every other rank's per-step metrics by point-to-point messages (no barrier).

    Rank 0 posts the receives for step s when it ends step s and waits for them
    when it ends step s + 1 (the other ranks are done with step s by then), so
    collecting never holds the pipeline back.
    """

    def __init__(self, rank: int, world: int, device: torch.device) -> None:
        self.rank, self.world, self.device = rank, world, device
        self.pending: list[tuple[StepMetrics, list[comm.Pending]]] = []
        self.sends: list[comm.Pending] = []

    def submit(self, m: StepMetrics) -> list[list[StepMetrics]]:
        """Hand in this rank's metrics; on rank 0, returns the steps now complete (all ranks' rows)."""
        tag_mb = m.step % comm.MAX_MICROBATCHES
        if self.rank != 0:
            self.sends.append(comm.send([m.to_tensor().to(self.device)], peer=0, kind=Kind.METRICS, boundary=0,
                                        mb=tag_mb, doing="sending metrics to rank 0"))
            return []
        done = self._drain()
        posted = [comm.recv([((StepMetrics.numel(),), torch.float64)], peer=r, kind=Kind.METRICS, boundary=0,
                            mb=tag_mb, device=self.device, doing=f"collecting step {m.step} metrics")
                  for r in range(1, self.world)]
        self.pending.append((m, posted))
        return done

    def _drain(self) -> list[list[StepMetrics]]:
        done = []
        for own, posted in self.pending:
            done.append([own] + [StepMetrics.from_tensor(p.wait()[0].cpu()) for p in posted])
        self.pending = []
        return done

    def finish(self) -> list[list[StepMetrics]]:
        for p in self.sends:
            p.wait()
        self.sends = []
        return self._drain() if self.rank == 0 else []
