"""The runtime benchmark's runs of a plan: step times, each rank's breakdown, the load others put on the machine."""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._runtime_setup import MODEL

__all__ = ["LoadProbe", "MeasuredPasses", "busy_s", "in_run_prediction", "rank_breakdown", "run_plan", "run_quiet"]


def busy_s() -> float:
    """Seconds all of this machine's cores have been busy (anyone's processes)."""
    import psutil
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


class LoadProbe:
    """Machine busy time over the steps of a run: rank 0 reports step s when step s + 1 ends, so the
    window from the first step report to the end covers steps 2.. (and the run's short wind-down)."""

    def __init__(self) -> None:
        self.start: tuple[float, float] | None = None
        self.end: tuple[float, float] | None = None

    def __call__(self, event: dict[str, Any]) -> None:
        if event.get("event") == "step" and self.start is None:
            self.start = (time.perf_counter(), busy_s())
        elif event.get("event") == "done":
            self.end = (time.perf_counter(), busy_s())

    def external_cores(self, own_cpu_ms: float) -> float | None:
        """Cores the rest of the machine kept busy on average (our ranks' CPU time taken out)."""
        if self.start is None or self.end is None or self.end[0] <= self.start[0]:
            return None
        wall = self.end[0] - self.start[0]
        return max(0.0, (self.end[1] - self.start[1] - own_cpu_ms / 1e3) / wall)


def rank_breakdown(rows, warmup: int) -> list[dict[str, float]]:
    """Per rank, the median over the steps after ``warmup`` of where its step went (ms); ``own_cpu_ms``:
    the executor thread's CPU time outside passes, waits and the optimizer (what the executor probe prices;
    beside ``comm_ms`` + ``other_ms``, wall time, it shows how much of that the rank was descheduled)."""
    out = []
    for rank in sorted({r.rank for r in rows}):
        mine = [r for r in rows if r.rank == rank and r.step >= warmup] or [r for r in rows if r.rank == rank]
        med = {k: statistics.median(getattr(r, k) for r in mine)
               for k in ("step_ms", "cpu_ms", "compute_ms", "compute_cpu_ms", "pad_ms", "wait_ms", "comm_ms",
                         "optim_ms", "thread_cpu_ms", "comm_cpu_ms", "own_cpu_ms")}
        other = [r.step_ms - r.compute_ms - r.pad_ms - r.wait_ms - r.comm_ms - r.optim_ms - r.verify_ms for r in mine]
        out.append({"rank": rank, **{k: round(v, 2) for k, v in med.items()},
                    "other_ms": round(statistics.median(other), 2)})
    return out


def in_run_prediction(plan_path: Path, ranks: list[dict[str, float]], messages=None) -> dict[str, Any]:
    """The plan simulated with the pass and optimizer times its own run measured (a device per rank,
    since the measured wall times already include any sharing of the cores): what is left between
    this and the measured step is the simulator's composition (bubbles, transfers, what it does not
    price), not the profile. Also each rank's measured passes over the profile's (its simulated passes,
    sharing included, and their CPU time over the profile's alone time)."""
    from planner.instruction_costs import CostModel
    from planner.plan_load import load_plan
    from planner.simulate import simulate
    plan = load_plan(plan_path)
    costs = CostModel.for_plan(plan)
    passes = {r: sum(1 for ins in plan.programs[r] if ins.op in ("F", "B")) // 2 for r in range(plan.num_ranks)}
    scale, cpu_ratio, unpriced = {}, {}, {}
    for row in ranks:
        r = row["rank"]
        planned = passes[r] * (costs.compute_ms(r, "F") + costs.compute_ms(r, "B"))
        local = passes[r] * (costs.local_ms(r, "F") + costs.local_ms(r, "B"))
        scale[r] = (row["compute_ms"] + row["pad_ms"]) / planned if planned else 1.0
        cpu_ratio[r] = row["compute_cpu_ms"] / local if local else 1.0
        # Wall time the rank spent posting messages and in the executor outside passes, waits and the
        # optimizer, per pass: the simulator prices neither (messages= only the probe's CPU per message).
        unpriced[r] = (row["comm_ms"] + row["other_ms"]) / (2 * passes[r]) if passes[r] else 0.0
    optim = {row["rank"]: row["optim_ms"] for row in ranks}
    measured = MeasuredPasses(costs, scale, optim)
    executor = MeasuredPasses(costs, scale, optim, extra_ms=unpriced)
    return {"inrun_predicted_ms": simulate(plan, measured).step_ms,
            "inrun_executor_ms": simulate(plan, executor).step_ms,
            "inrun_messages_ms": None if messages is None else simulate(plan, measured, messages=messages).step_ms,
            "pass_scale": [round(scale[r], 3) for r in sorted(scale)],
            "pass_cpu_over_profile": [round(cpu_ratio[r], 3) for r in sorted(cpu_ratio)]}


class MeasuredPasses:
    """A plan's cost model whose passes and optimizer steps take what a run measured: each rank's
    forward and backward scaled by one factor (the run's compute wall time over the planned), the
    optimizer step as measured; everything else (transfers, all-reduce) as planned. ``extra_ms``: per
    rank, ms added to each of its passes (its measured unpriced executor time, spread over them)."""

    def __init__(self, base, scale: dict[int, float], optim_ms: dict[int, float],
                 extra_ms: dict[int, float] | None = None) -> None:
        self.base, self.scale, self.optim, self.extra = base, scale, optim_ms, extra_ms or {}

    def compute_ms(self, rank: int, op: str) -> float:
        return self.base.compute_ms(rank, op) * self.scale.get(rank, 1.0) + self.extra.get(rank, 0.0)

    def local_ms(self, rank: int, op: str) -> float:
        return self.base.local_ms(rank, op) * self.scale.get(rank, 1.0) + self.extra.get(rank, 0.0)

    def optim_ms(self, rank: int) -> float:
        return self.optim.get(rank, self.base.optim_ms(rank))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)


def run_plan(plan_path: Path, steps: int, *, emulate: bool, messages=None) -> dict[str, Any]:
    """One local run: median step period after the first step, per-rank breakdown, external load."""
    from planner.runtime.launcher.launch import launch
    from planner.runtime.options import RunOptions
    from planner.runtime.rank.metrics import read_metrics
    probe = LoadProbe()
    metrics = plan_path.with_suffix(".metrics.jsonl")
    result = launch(RunOptions(plan=str(plan_path), steps=steps, timeout_s=120, emulate=emulate,
                               metrics=str(metrics), model=MODEL), on_event=probe)
    rows = read_metrics(metrics)
    own = sum(r.cpu_ms for r in rows if r.step >= 2)
    load = probe.external_cores(own)
    ranks = rank_breakdown(rows, warmup=1)
    return {"measured_ms": result["measured_step_ms"], "plan_predicted_ms": result["predicted_step_ms"],
            "step_ms": result["step_ms"], "cpu_ms": statistics.median(result["cpu_ms"][1:] or result["cpu_ms"]),
            "external_load_cores": None if load is None else round(load, 3),
            "ranks": ranks, **in_run_prediction(plan_path, ranks, messages)}


def run_quiet(attempt: Callable[[], dict[str, Any]], *, max_load: float, retries: int) -> dict[str, Any]:
    """``attempt()`` (a run's result with ``measured_ms`` and ``external_load_cores``), repeated while other
    processes kept more than ``max_load`` cores busy; the least disturbed attempt counts, and every
    attempt is listed."""
    attempts = []
    for _ in range(1 + retries):
        attempts.append(attempt())
        load = attempts[-1]["external_load_cores"]
        if load is not None and load <= max_load:
            break
    best = min(attempts, key=lambda a: math.inf if a["external_load_cores"] is None else a["external_load_cores"])
    return {**best, "attempts": [{"measured_ms": round(a["measured_ms"], 2),
                                  "external_load_cores": a["external_load_cores"]} for a in attempts]}
