"""The churn benchmark's part 2: a local run that loses a rank, its recovery timed from this process."""
from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks._churn_config import (
    GOALS,
)

__all__ = ["churn_trial", "local_run", "print_local"]


def _local_plan(folder: Path, hosts_count: int = 4):
    from cost_models.cluster_file import parse_cluster
    from planner.api import plan_chain
    from planner.model_io import load_chain
    from planner.solver.policy import VerificationPolicy
    hosts = [{"name": f"h{i}", "region": "lab", "trust": "operator", "trusted": True,
              "devices": [{"type": "CPU", "count": 1}]} for i in range(hosts_count)]
    cluster = parse_cluster({"name": "four", "hosts": hosts,
                             "links": {"default": {"bandwidth_gbps": 10, "latency_ms": 0.1}}})
    _, chain = load_chain("gpt-tiny", batch=2, seq=32)
    plan = plan_chain(chain, cluster, spec="gpt-tiny", seq=32, global_batch=8, microbatch_size=2,
                      policy=VerificationPolicy(enabled=False), time_limit_s=5, workers=1, dtype="fp32",
                      optimizer="adam", stages=hosts_count)
    return plan, plan.save(folder / "plan.json")


def _children_ranks() -> dict[int, int]:
    """RANK -> pid of this process's children that are ranks (the launcher starts them from here)."""
    out = {}
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
            if rank is not None:
                out[rank] = int(pid)
    return out


def _watch_exits(pids: dict[int, int], since: float, out: dict[str, float]) -> None:
    """Record when each of ``pids`` (rank -> pid) has exited (a zombie or gone), seconds after ``since``."""
    while len(out) < len(pids) and time.perf_counter() - since < 300:
        for rank, pid in pids.items():
            if f"rank{rank}" in out:
                continue
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                state = "gone"
            if state in ("Z", "X", "gone"):
                out[f"rank{rank}"] = time.perf_counter() - since
        time.sleep(0.02)


def churn_trial(path: Path, folder: Path, steps: int, kill_at: int, every: int, victim: int) -> dict[str, Any]:
    """One run that loses ``victim`` (SIGKILL) when rank 0 reports step ``kill_at`` and re-plans itself."""
    from planner.runtime.launcher import elastic
    from planner.runtime.options import RunOptions

    marks: dict[str, float] = {}
    first_resumed: dict[str, Any] = {}
    noticed: dict[str, float] = {}
    exited: dict[str, float] = {}
    real_replan = elastic.replan

    def timed_replan(*args, **kwargs):
        marks["replan_start"] = time.perf_counter()
        # When each surviving rank recorded the peer it lost (its error record's time), from the kill.
        for record in sorted((folder / "logs").glob("rank*.json")):
            noticed[record.stem] = record.stat().st_mtime - marks["kill_wall"]
        try:
            return real_replan(*args, **kwargs)
        finally:
            marks["replan_end"] = time.perf_counter()

    def on_event(event: dict[str, Any]) -> None:
        if event.get("event") != "step":
            return
        now = time.perf_counter()
        marks.setdefault("first_event", now)
        marks["last_event"] = now
        if "kill" not in marks and event["step"] == kill_at:
            pids = _children_ranks()
            os.kill(pids.pop(victim), signal.SIGKILL)
            marks["kill"], marks["kill_wall"] = time.perf_counter(), time.time()
            threading.Thread(target=_watch_exits, args=(pids, marks["kill"], exited), daemon=True).start()
        elif "replan_end" in marks and not first_resumed:
            marks["first_step"] = now
            first_resumed.update(event)

    opts = RunOptions(plan=str(path), steps=steps, checkpoint_dir=str(folder / "ckpt"), checkpoint_every=every)
    elastic.replan = timed_replan
    try:
        t0 = time.perf_counter()
        result = elastic.launch_replanning(opts, max_replans=1, on_event=on_event, log_dir=str(folder / "logs"))
        wall_s = time.perf_counter() - t0
    finally:
        elastic.replan = real_replan
    (replanned,) = result["replans"]
    first_step_s = first_resumed["step_ms"] / 1000
    kept = replanned.get("survivors_note") or f"discarded: {replanned.get('survivors_discarded')}"
    return {"after": replanned["after"], "excluded": replanned["excluded"], "victim": victim,
            "killed_after_step": kill_at, "survivors": kept, "redone_steps": replanned.get("redone_steps"),
            "resumed_at_step": replanned["resumed_after_step"] + 1, "replanned_ranks": replanned["ranks"],
            "replanned_simulated_step_ms": replanned["simulated_step_ms"], "timeout_s": opts.timeout_s,
            "detect_s": marks["replan_start"] - marks["kill"],
            "replan_s": marks["replan_end"] - marks["replan_start"],
            "reload_s": marks["first_step"] - marks["replan_end"] - first_step_s, "first_step_s": first_step_s,
            "recovery_s": marks["first_step"] - marks["kill"], "error_recorded_after_kill_s": noticed,
            "exited_after_kill_s": exited,
            "wall_s": wall_s, "span_s": marks["last_event"] - marks["first_event"],
            "replanned_step_s": result["measured_step_ms"] / 1000}


def local_run(steps: int, kill_at: int, every: int, trials: int, *, hosts: int = 4, straight: bool = True
              ) -> dict[str, Any]:
    """The plan (``hosts`` stages) without a failure once, then ``trials`` runs that lose a middle-stage rank.
    ``straight`` false (a smoke run): no run without a failure; the step before the kill is the first trial's
    re-planned step."""
    with tempfile.TemporaryDirectory(prefix="churn-") as tmp:
        return _local_run(Path(tmp), steps, kill_at, every, trials, hosts, straight)


def _local_run(folder: Path, steps: int, kill_at: int, every: int, trials: int, hosts: int, straight: bool
               ) -> dict[str, Any]:
    from planner.runtime.launcher.launch import launch
    from planner.runtime.options import RunOptions

    plan, path = _local_plan(folder, hosts)
    victim = next(r.rank for r in plan.ranks if r.stage == plan.num_stages // 2)
    t0 = time.perf_counter()
    if straight:
        done = launch(RunOptions(plan=str(path), steps=steps, checkpoint_dir=str(folder / "c0"),
                                 checkpoint_every=every))
    straight_s = time.perf_counter() - t0
    runs = [churn_trial(path, folder / f"t{i}", steps, kill_at, every, victim) for i in range(trials)]
    step_s = done["measured_step_ms"] / 1000 if straight else runs[0]["replanned_step_s"]
    for i, run in enumerate(runs):
        # The model checked on this run: rank 0's events from the first step to the last, predicted from the
        # steps (the old plan's before the kill, this run's re-planned step after the checkpoint) and the
        # OTHER runs' recovery (with one run there is nothing independent to check against).
        others = [r["recovery_s"] for j, r in enumerate(runs) if j != i]
        if others:
            run["model_span_s"] = (kill_at * step_s + sum(others) / len(others)
                                   + (steps - 1 - run["resumed_at_step"]) * run["replanned_step_s"])
            run["model_vs_measured_span"] = run["model_span_s"] / run["span_s"] - 1
    mean = {k: sum(r[k] for r in runs) / len(runs)
            for k in ("detect_s", "replan_s", "reload_s", "recovery_s", "replanned_step_s")}
    return {"plan": {"model": "gpt-tiny", "hosts": hosts, "ranks": plan.num_ranks, "stages": plan.num_stages,
                     "global_batch": plan.config.global_batch, "seq": plan.model.seq,
                     "simulated_step_ms": plan.predicted.step_ms},
            "steps": steps, "killed_rank": victim, "killed_after_step": kill_at, "checkpoint_every": every,
            "straight_wall_s": straight_s if straight else None, "load_average": os.getloadavg(), "step_s": step_s,
            "samples_per_step": plan.config.global_batch,
            "trials": runs, **mean}


def print_local(r: dict[str, Any]) -> None:
    print(f"local {r['plan']['ranks']}-rank gpt-tiny ({r['steps']} steps; checkpoints every {r['checkpoint_every']}; "
          f"rank {r['killed_rank']} SIGKILLed when rank 0 reports step {r['killed_after_step']}); without a "
          f"failure: step {1000 * r['step_s']:.1f} ms, "
          + ("not run (the trial's step)" if r["straight_wall_s"] is None else f"wall {r['straight_wall_s']:.1f} s"),
          flush=True)
    for t in r["trials"]:
        check = (f"; span model {t['model_span_s']:.1f} s vs {t['span_s']:.1f} s "
                 f"({100 * t['model_vs_measured_span']:+.1f}%)" if "model_span_s" in t else "")
        print(f"  detection {t['detect_s']:5.2f} s  re-plan {t['replan_s']:5.2f} s  reload {t['reload_s']:5.2f} s  "
              f"(+ first step {t['first_step_s']:.3f} s)  failure -> first resumed step {t['recovery_s']:5.2f} s  "
              f"(goal <= {GOALS['local_recovery_s']:g} s); step {1000 * t['replanned_step_s']:.1f} ms on "
              f"{t['replanned_ranks']} ranks{check}", flush=True)
        print(f"    {t['after']}; error records after the kill (s): "
              f"{', '.join(f'{k} {v:.2f}' for k, v in t['error_recorded_after_kill_s'].items())}; exited: "
              f"{', '.join(f'{k} {v:.2f}' for k, v in sorted(t['exited_after_kill_s'].items()))}", flush=True)
    print(f"  mean: detection {r['detect_s']:.2f} s, re-plan {r['replan_s']:.2f} s, reload {r['reload_s']:.2f} s, "
          f"recovery {r['recovery_s']:.2f} s", flush=True)
