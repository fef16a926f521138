"""Churn benchmark (issue 21): how fast a run recovers from a lost worker, and what that buys under churn.

Part 1, re-plan time. For three plans, plan once, drop one host the plan runs on, and time
``planner.api.replan`` (wall and CPU time of the whole re-plan: solve, compile, simulate, baselines); its
objective and simulated step against a fresh plan of the reduced cluster at the same time limit (the re-plan is
warm-started from the old plan, ``replan(warm=True)``, the runtime's default; the fresh one is
``replan(warm=False)``: every microbatch size, no warm start):

* 8 devices: the packaged ``default`` cluster (2 A100, 2 volunteers' RTX3090, 2 T4, an L4, a CPU verifier
  host) with gpt-medium in fp32, global batch 16 (the README's main job); a volunteer is lost;
* 64 devices: DT-FM's ``worldwide`` case (``benchmarks/clusters/dtfm-worldwide.yaml``, 64 one-V100 hosts)
  with gpt-1.3b, 512 x 2048 tokens, fp16, no verification (as ``benchmarks/peers.py``); the host of a
  middle stage's rank is lost;
* 176 devices: the solver benchmark's 1000-block x 176-device case (``benchmarks/warm_replan.py``'s builders:
  a tiered cluster, a seeded GPT-like chain, global batch 32); the host ``warm_replan`` loses first (a
  volunteer the plan uses, else the data-centre host with most of its ranks: 8 GPUs at once).

Part 2, end-to-end recovery of a local 4-rank run: gpt-tiny on four one-CPU hosts (4 stages, one thread per
rank), ``launch_replanning`` with one re-plan allowed (``--replan-on-failure 1``), the default ``--timeout``
(60 s) and re-plan time limit (30 s), checkpoints every 5 steps. When rank 0 reports step K the benchmark
SIGKILLs the rank of a middle stage. The launcher records no timestamps of its own, so they come from this
process's clock: the kill; the start and end of the ``replan`` call (the benchmark wraps
``planner.runtime.launcher.elastic.replan`` to time it, nothing else changes); rank 0's first step event after the
resume (its events are polled every 50 ms); and the times the surviving ranks wrote their error records (file
times) and exited (polled every 20 ms). Detection = kill -> re-plan starts (the others noticing, exiting,
and the launcher naming the root cause); reload = re-plan ends -> first resumed step reported, less that
step's own period (process start, rendezvous, checkpoint load and re-sharding). The same plan also runs
once without a failure (its step time), and the run with a failure is repeated (``--trials``, 2): each
run's wall time from rank 0's first step event to its last is predicted from the steps and the other
runs' recovery, a check of the model's recovery figure on a real churn run. ``--survivors`` runs only a
variant (added to the results file as ``local_survivors``): the same model and batch on a hand-made plan whose
middle stage has two replicas, losing a replica (the survivors' state is whole: the resume redoes nothing)
or the last stage's only rank (it is not: the checkpoint is used); per run, the steps redone (the newest step
a survivor had completed less the step resumed after) beside the same timings.

Part 3, throughput under churn: a model computed from the measured pieces (``ChurnCase``; tested by
``tests/unit/test_churn_model.py``). A run of T steps loses a worker every N steps; checkpoints every C steps;
a failure strikes uniformly within a checkpoint interval, so C/2 steps are redone on average:

* Stagewise: each failure costs detection + re-plan + reload (measured) and C/2 redone steps, redone at the
  re-planned plan's simulated step, or none where every stage on the lost host keeps a replica elsewhere
  (``lost_stages_kept``: the run resumes from the survivors' state, ``planner.runtime.recovery.survivors``); the run goes on at that step. A replacement device comes W = 60 s after
  the failure; when it pays, it is planned back in at the first checkpoint after that (a re-plan + reload,
  nothing detected or redone) and the rest of the interval runs at the original step; ``no_rejoin``: it
  never is (every step after the first failure at the re-planned step);
* checkpoint-restart (torchrun elastic): each failure costs detection + a W = 60 s wait for a replacement +
  reload and C/2 redone steps, all at the original plan's step;
* no failures: T steps at the original step.
Two more columns bound what recovery could buy: ``no_redo`` (Stagewise resuming from the surviving replicas'
state with nothing redone: ``planner.runtime.recovery.survivors``; it needs every lost stage kept by a replica and
the survivors stopped after the same step) and ``ceiling``
(failures that cost nothing: restart time over the no-failure time, the most any recovery can reach; where
it is under 1.5x, the goal cannot be met against a 60 s wait).
Checkpoint writes cost the same in both and are left out. Throughput = T x global batch / time (samples/s);
ratios are the same in tokens. Detection and reload are the local run's (mean over the trials) for every
plan; the re-plan time and the steps are each plan's own (simulated steps; the local row: measured steps).

Goals: re-plan <= 10 s at 176 devices; end-to-end recovery of the local run <= 30 s; under churn >= 1.5x
the throughput of checkpoint-restart.

Run: ``python benchmarks/churn.py [--quick] [--limit S] [--output PATH]`` (``--remodel``: part 3 again from
the measurements in the results file). Prints tables and writes
``benchmarks/results/churn.json`` (``--quick``, a smoke run: the 8-device cluster with gpt-tiny at 1 s limits,
one local run of 3 ranks whose no-failure step is the run's own, nothing written unless ``--output`` is given).
Wall times are noisy on a shared machine.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "churn.json"
GOALS = {"replan_176_s": 10.0, "local_recovery_s": 30.0, "churn_vs_restart": 1.5}
WAIT_S = 60.0          # checkpoint-restart: the wait for a replacement device
CHECKPOINT_EVERY = 10  # the runtime's default --checkpoint-every
CHURN_STEPS = 1000
CHURN_EVERY = (20, 50, 100)
# --quick: gpt-tiny for part 1; part 2's run on 3 hosts, killed after its first checkpoint (its steps take
# milliseconds: many are left for the kill to land before the run ends)
QUICK = {"model": "gpt-tiny", "limit": 1.0, "hosts": 3, "steps": 40, "kill_at": 6, "every": 5}


# --------------------------------------------------------------------------- the churn model
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


# --------------------------------------------------------------------------- part 1: re-plan time
def _timed(fn, *args, **kwargs):
    clock = time.perf_counter(), time.process_time()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - clock[0], time.process_time() - clock[1]


def _used_hosts(plan) -> dict[str, int]:
    """Stage ranks per host."""
    out: dict[str, int] = {}
    for r in plan.ranks:
        if r.stage is not None:
            out[r.host] = out.get(r.host, 0) + 1
    return out


def _middle_host(plan) -> str:
    """The host of the first rank of the middle stage (a worker neither end of the pipeline needs)."""
    stage = plan.num_stages // 2
    return next(r.host for r in plan.ranks if r.stage == stage)


def _case_8(limit: float, model: str = "gpt-medium"):
    from planner.model_io import load_chain
    _, chain = load_chain(model, batch=None, seq=None)
    kwargs = dict(spec=model, global_batch=16, dtype="fp32")

    def lose(plan):  # a volunteer when the plan uses one: those are the devices that come and go
        hosts = _used_hosts(plan)
        return next((h for h in sorted(hosts) if h.startswith("volunteer")), _middle_host(plan))
    return f"default cluster, {model} fp32, batch 16", chain, "default", kwargs, lose


def _case_64(limit: float):
    import cost_models
    from planner.model_io import load_chain
    from planner.solver.policy import VerificationPolicy
    _, chain = load_chain("gpt-1.3b", batch=1, seq=2048)
    cluster = cost_models.load_cluster(ROOT / "benchmarks" / "clusters" / "dtfm-worldwide.yaml")
    kwargs = dict(spec="gpt-1.3b", seq=2048, global_batch=512, dtype="float16",
                  policy=VerificationPolicy(enabled=False))
    return "DT-FM worldwide (64 V100), gpt-1.3b fp16, 512 x 2048", chain, cluster, kwargs, _middle_host


def _case_176(limit: float):
    from benchmarks.warm_replan import _case, _lost_hosts
    from planner.solver.policy import VerificationPolicy
    chain, cluster = _case()
    kwargs = dict(spec="bench:chain", global_batch=32, policy=VerificationPolicy())
    return ("solver benchmark 1000x176 (tiered, seeded chain), batch 32", chain, cluster, kwargs,
            lambda plan: _lost_hosts(plan)[0][1])


def replan_case(devices: int, limit: float, first_limit: float, workers: int, quick: bool = False
                ) -> dict[str, Any]:
    """One re-plan case (``quick``: the 8-device cluster with a tiny model)."""
    from planner.api import plan_chain, replan

    build = {8: _case_8, 64: _case_64, 176: _case_176}[devices]
    label, chain, cluster, kwargs, lose = _case_8(limit, QUICK["model"]) if quick else build(limit)
    first, first_wall, first_cpu = _timed(plan_chain, chain, cluster, time_limit_s=first_limit, workers=workers,
                                          **kwargs)
    host = lose(first)
    # warm: the old plan's stages repaired as the first incumbents; cold: a fresh solve of the reduced cluster.
    new, wall, cpu = _timed(replan, first, exclude_hosts=[host], reason=f"benchmark: {host} lost",
                            time_limit_s=limit, workers=workers, warm=True)
    fresh, fresh_wall, fresh_cpu = _timed(replan, first, exclude_hosts=[host], reason=f"benchmark: {host} lost",
                                          time_limit_s=limit, workers=workers, warm=False)
    row = {"devices": devices, "case": label, "load_average": os.getloadavg(), "lost_host": host,
           "limit_s": limit, "first_limit_s": first_limit,
           "first": _plan_row(first, first_wall, first_cpu), "replan": _plan_row(new, wall, cpu),
           "fresh": _plan_row(fresh, fresh_wall, fresh_cpu),
           "global_batch": first.config.global_batch}
    row["lost_stages_kept"] = all(any(first.ranks[r].host != host for r in first.stage_ranks(k))
                                  for k in range(first.num_stages)
                                  if any(first.ranks[r].host == host for r in first.stage_ranks(k)))
    row["replan_vs_fresh_objective"] = new.report.objective_ms / fresh.report.objective_ms - 1
    row["replan_vs_fresh_simulated"] = new.predicted.step_ms / fresh.predicted.step_ms - 1
    return row


def _plan_row(plan, wall_s: float, cpu_s: float) -> dict[str, Any]:
    r = plan.report
    return {"wall_s": wall_s, "cpu_s": cpu_s, "solve_s": r.solve_s, "objective_ms": r.objective_ms,
            "simulated_ms": plan.predicted.step_ms, "ranks": plan.num_ranks, "stages": plan.num_stages,
            "method": r.method}


def _print_replan(row: dict[str, Any]) -> None:
    for name in ("first", "replan", "fresh"):
        p = row[name]
        limit = row["first_limit_s"] if name == "first" else row["limit_s"]
        print(f"{row['devices']:>4} {name:>7} {limit:4.0f} s  wall {p['wall_s']:7.1f} s  cpu {p['cpu_s']:7.1f} s  "
              f"obj {p['objective_ms']:11.1f} ms  sim {p['simulated_ms']:11.1f} ms  S={p['stages']:<3} "
              f"ranks={p['ranks']:<4}{'  lost ' + row['lost_host'] if name == 'replan' else ''}", flush=True)
    print(f"{row['devices']:>4} re-plan vs fresh: objective {100 * row['replan_vs_fresh_objective']:+.2f}%, "
          f"simulated {100 * row['replan_vs_fresh_simulated']:+.2f}%", flush=True)


# --------------------------------------------------------------------------- part 2: a local run
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


def _churn_trial(path: Path, folder: Path, steps: int, kill_at: int, every: int, victim: int) -> dict[str, Any]:
    """One run that loses ``victim`` (SIGKILL) when rank 0 reports step ``kill_at`` and re-plans itself."""
    import planner.runtime.launcher.elastic as elastic
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
    runs = [_churn_trial(path, folder / f"t{i}", steps, kill_at, every, victim) for i in range(trials)]
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


def _print_local(r: dict[str, Any]) -> None:
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
    runs = [_churn_trial(path, folder / f"t{i}", steps, kill_at, every, victim)
            for i, (victim, kill_at) in enumerate(kills)]
    return {"plan": {"model": "gpt-tiny", "hosts": 4, "ranks": plan.num_ranks, "stages": plan.num_stages,
                     "stage_of_rank": [r.stage for r in plan.ranks], "global_batch": plan.config.global_batch,
                     "seq": plan.model.seq},
            "steps": steps, "checkpoint_every": every, "load_average": os.getloadavg(), "trials": runs,
            "when": time.strftime("%Y-%m-%d %H:%M:%S")}


def _print_survivors(r: dict[str, Any]) -> None:
    print(f"local {r['plan']['ranks']}-rank gpt-tiny, stages of the ranks {r['plan']['stage_of_rank']} ({r['steps']} "
          f"steps; checkpoints every {r['checkpoint_every']})", flush=True)
    for t in r["trials"]:
        print(f"  rank {t['victim']} SIGKILLed at rank 0's step {t['killed_after_step']}: resumed at step "
              f"{t['resumed_at_step']}, redone {t['redone_steps']} steps; detection {t['detect_s']:5.2f} s  re-plan "
              f"{t['replan_s']:5.2f} s  reload {t['reload_s']:5.2f} s  failure -> first resumed step "
              f"{t['recovery_s']:5.2f} s; survivors: {t['survivors']}", flush=True)


# --------------------------------------------------------------------------- part 3: the model's table
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


def _print_churn(row: dict[str, Any]) -> None:
    print(f"{row['plan']:>34} N={row['every']:<4} step {row['step_s']:7.3f} -> {row['replanned_step_s']:7.3f} s  "
          f"samples/s: stagewise {row['stagewise_samples_per_s']:9.2f}  restart {row['restart_samples_per_s']:9.2f}"
          f"  none {row['no_failure_samples_per_s']:9.2f}  (no rejoin {row['stagewise_no_rejoin_samples_per_s']:9.2f})"
          f"  stagewise/restart {row['stagewise_vs_restart']:5.2f}x  "
          f"stagewise/none {row['stagewise_vs_no_failure']:5.2f}  (no redo {row['no_redo_vs_restart']:5.2f}x, "
          f"ceiling {row['ceiling_vs_restart']:5.2f}x)", flush=True)


def _summary(replans, local, churn) -> dict[str, Any]:
    r176 = next((r for r in replans if r["devices"] == 176), None)
    return {"replan_176_wall_s": r176["replan"]["wall_s"] if r176 else None,
            "local_recovery_mean_s": local["recovery_s"],
            "local_recovery_max_s": max(t["recovery_s"] for t in local["trials"]),
            "stagewise_vs_restart": {f"{r['plan']} N={r['every']}": r["stagewise_vs_restart"] for r in churn},
            "ceiling_vs_restart": {f"{r['plan']} N={r['every']}": r["ceiling_vs_restart"] for r in churn}}


def _write(out: Path, doc: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=lambda v: None if isinstance(v, float) and math.isnan(v) else v)
                   + "\n")
    os.replace(tmp, out)
    print(f"wrote {out}")


def _remodel(path: Path, devices: list[int] | None, limit: float, first_limit: float, workers: int) -> int:
    doc = json.loads(path.read_text())
    for n in devices or ():  # these re-plan cases measured again, the local runs kept
        row = replan_case(n, limit, first_limit, workers)
        _print_replan(row)
        doc["replan"] = [row if r["devices"] == n else r for r in doc["replan"]]
    doc["churn"] = churn_table(doc["replan"], doc["local"])
    for row in doc["churn"]:
        _print_churn(row)
    doc["summary"] = _summary(doc["replan"], doc["local"], doc["churn"])
    doc["model"] = __doc__.split("Part 3, ")[1].split("Goals:")[0].strip()
    _write(path, doc)
    return 0


def _survivors_only(path: Path) -> int:
    import torch
    torch.set_num_threads(1)
    print("== local runs that lose a replica (rank 2: its twin is rank 1) or a sole stage rank (rank 3)", flush=True)
    result = survivors_run(steps=30, every=CHECKPOINT_EVERY, kills=[(2, 12), (2, 15), (3, 15)])
    _print_survivors(result)
    doc = json.loads(path.read_text()) if path.is_file() else {"benchmark": "churn"}
    doc["local_survivors"] = result
    _write(path, doc)
    return 0


def _warm() -> None:
    import torch

    from planner.solver.bound.sequence_dp_kernel import warm as warm_kernels
    from planner.solver.search.seq_partition_kernel import warm as warm_partition
    torch.set_num_threads(1)
    warm_kernels()  # compiled once per machine: not part of any plan's time
    warm_partition()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: the 8-device cluster with gpt-tiny and a "
                    "short local run of 3 ranks; writes nothing unless --output is given")
    ap.add_argument("--limit", type=float, default=None, help="the re-plan's (and the fresh plan's) time limit (s; "
                    f"default 5, --quick: {QUICK['limit']:g})")
    ap.add_argument("--first-limit", type=float, default=30.0, help="the original plans' time limit (s)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--devices", type=int, nargs="+", choices=(8, 64, 176), default=None)
    ap.add_argument("--trials", type=int, default=2, help="local runs that lose a rank (default 2; each checks "
                    "the model's recovery figure with the others')")
    ap.add_argument("--output", type=Path, default=None)
    ap.add_argument("--remodel", action="store_true", help="recompute part 3 from the measurements already in "
                    "the results file and rewrite it (part 2 is not rerun; part 1 only for --devices, if given)")
    ap.add_argument("--survivors", action="store_true", help="only runs of a plan with a replicated stage that "
                    "lose a replica (twice) or a sole stage rank, resuming from the survivors' state when it is "
                    "whole; adds them to the results file as local_survivors (the rest is not rerun)")
    args = ap.parse_args(argv)
    if args.survivors:
        return _survivors_only(args.output or RESULTS)
    _warm()
    if args.remodel:
        return _remodel(args.output or RESULTS, args.devices, args.limit, args.first_limit, args.workers)
    args.limit = args.limit or (QUICK["limit"] if args.quick else 5.0)
    devices = args.devices or ([8] if args.quick else [8, 64, 176])
    first_limit = min(args.first_limit, args.limit) if args.quick else args.first_limit
    print(f"== re-plan after losing one host (re-plan and fresh at {args.limit:g} s, first plan at "
          f"{first_limit:g} s, {args.workers} workers)", flush=True)
    replans = []
    for n in devices:
        replans.append(replan_case(n, args.limit, first_limit, args.workers, quick=args.quick and n == 8))
        _print_replan(replans[-1])
    print("== end-to-end recovery of a local run", flush=True)
    if args.quick:
        local = local_run(steps=QUICK["steps"], kill_at=QUICK["kill_at"], every=QUICK["every"], trials=1,
                          hosts=QUICK["hosts"], straight=False)
    else:
        local = local_run(steps=30, kill_at=10, every=5, trials=args.trials)
    _print_local(local)
    print(f"== throughput under churn (model; T={CHURN_STEPS} steps, checkpoint every {CHECKPOINT_EVERY}, "
          f"restart waits {WAIT_S:g} s)", flush=True)
    churn = churn_table(replans, local)
    for row in churn:
        _print_churn(row)
    summary = _summary(replans, local, churn)
    print("== summary", json.dumps(summary), flush=True)
    out = args.output or (None if args.quick else RESULTS)
    if out is None:
        return 0
    doc = {"benchmark": "churn", "goals": GOALS, "summary": summary, "replan": replans, "local": local,
           "churn": churn, "model": __doc__.split("Part 3, ")[1].split("Goals:")[0].strip(),
           "limit_s": args.limit, "first_limit_s": first_limit, "workers": args.workers, "quick": args.quick,
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                       "load_average_at_end": os.getloadavg()},
           "note": "wall-clock times measured on a shared machine (other jobs running): noisy",
           "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    _write(out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
