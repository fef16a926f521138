"""The runtime benchmark's three sections: overhead vs torch, simulator vs measured, solver vs baselines."""
from __future__ import annotations

import itertools
import statistics
from pathlib import Path
from typing import Any

from benchmarks._runtime_pricing import (
    SLOW,
    pct,
    price_case,
    priced_step_ms,
    timed_profile,
)
from benchmarks._runtime_runs import run_plan, run_quiet
from benchmarks._runtime_setup import (
    LAYERS,
    Machine,
    cluster,
    compile_solution,
    config,
    hand_solution,
)
from benchmarks._runtime_torch import run_torch_pipelining

__all__ = ["CASES", "bracketed_run", "overhead", "planning", "prediction"]


CASES = ((2, False), (2, True), (4, False), (4, True))  # (ranks, emulated heterogeneity)


def overhead(tmp: Path, ch, profile: Path, link, two, steps: int, repeats: int) -> dict[str, Any]:
    """1. our runtime vs Schedule1F1B on the same split: interleaved repeats, medians."""
    homo2 = cluster(profile, [1.0, 1.0], link)
    two_path = compile_solution(hand_solution(ch, homo2, two), ch, homo2, tmp, "two")
    runs: dict[str, list[dict[str, Any]]] = {"ours": [], "torch": []}
    for i in range(repeats):
        order = ("ours", "torch") if i % 2 == 0 else ("torch", "ours")
        for who in order:
            runs[who].append(run_plan(two_path, steps, emulate=False) if who == "ours"
                             else run_torch_pipelining(steps, LAYERS // 2))
    med = {who: {k: statistics.median(r[k] for r in rs) for k in ("measured_ms", "cpu_ms")} for who, rs in runs.items()}
    return {"ours_ms": med["ours"]["measured_ms"], "torch_1f1b_ms": med["torch"]["measured_ms"],
            "ratio": med["ours"]["measured_ms"] / med["torch"]["measured_ms"], "goal_ratio": 1.05,
            "ours_cpu_ms": med["ours"]["cpu_ms"], "torch_cpu_ms": med["torch"]["cpu_ms"],
            "cpu_ratio": med["ours"]["cpu_ms"] / med["torch"]["cpu_ms"], "repeats": repeats,
            "ours_runs_ms": [r["measured_ms"] for r in runs["ours"]],
            "torch_runs_ms": [r["measured_ms"] for r in runs["torch"]],
            "ours_external_load_cores": [r["external_load_cores"] for r in runs["ours"]]}


def bracketed_run(tmp: Path, ch, link, ranks: int, hetero: bool, stages, steps: int, cores: int,
                   machine: Machine, name: str) -> dict[str, Any]:
    """Profile this CPU, run the case, profile again; price the plan with each profile. The CPU's own
    speed moves on this shared host (by up to ~20% from one few-second window to the next, also with
    nothing else running in this machine), so the prediction is the mean of the two, and their
    spread shows how far it moved."""
    effs = [1.0] * (ranks - 1) + [SLOW if hetero else 1.0]
    path, before = price_case(tmp, ch, link, effs, stages, cores, machine, f"{name}-before", warm_first=True)
    run = run_plan(path, steps, emulate=hetero, messages=machine.messages)
    _, after = price_case(tmp, ch, link, effs, stages, cores, machine, f"{name}-after", warm_first=False)
    predicted = statistics.fmean((before["predicted_ms"], after["predicted_ms"]))
    previous = statistics.fmean((before["previous_model_ms"], after["previous_model_ms"]))
    even = statistics.fmean((before["even_sharing_ms"], after["even_sharing_ms"]))
    warm = statistics.fmean((before["warm_profile_ms"], after["warm_profile_ms"]))
    no_executor = statistics.fmean((before["no_executor_ms"], after["no_executor_ms"]))
    return {**run, "predicted_ms": round(predicted, 2),
            "warm_profile_ms": round(warm, 2), "warm_profile_error_pct": round(pct(run["measured_ms"], warm), 2),
            "inrun_executor_error_pct": round(pct(run["measured_ms"], run["inrun_executor_ms"]), 2),
            "error_pct": round(pct(run["measured_ms"], predicted), 2),
            "previous_model_ms": round(previous, 2),
            "no_executor_ms": round(no_executor, 2),
            "no_executor_error_pct": round(pct(run["measured_ms"], no_executor), 2),
            "previous_model_error_pct": round(pct(run["measured_ms"], previous), 2),
            "even_sharing_ms": round(even, 2), "even_sharing_error_pct": round(pct(run["measured_ms"], even), 2),
            "inrun_error_pct": round(pct(run["measured_ms"], run["inrun_predicted_ms"]), 2),
            "profile_drift_pct": round(pct(after["predicted_ms"], before["predicted_ms"]), 2),
            "profiles": [{"when": "before", **before}, {"when": "after", **after}]}


def prediction(tmp: Path, ch, link, ranges, steps: int, repeats: int, cores: int, machine: Machine,
               quiet: dict[str, float]) -> dict[str, Any]:
    """2. simulated vs measured, every case once per repeat (cases interleaved), each run priced with
    profiles of this CPU taken just before and just after it."""
    runs: dict[tuple[int, bool], list[dict[str, Any]]] = {case: [] for case in CASES}
    for i in range(repeats):
        order = CASES[i % len(CASES):] + CASES[:i % len(CASES)]  # a different case goes first each repeat
        for ranks, hetero in order:
            names = (f"p{ranks}{int(hetero)}-{i}-{n}" for n in itertools.count())
            res = run_quiet(lambda r=ranks, h=hetero, names=names: bracketed_run(
                tmp, ch, link, r, h, ranges[r], steps, cores, machine, next(names)), **quiet)
            runs[(ranks, hetero)].append({"repeat": i, **res})
    rows = []
    for (ranks, hetero), rs in runs.items():
        calm_runs = [r for r in rs if r["external_load_cores"] is not None
                     and r["external_load_cores"] <= quiet["max_load"]]
        calm = [r["error_pct"] for r in calm_runs]
        rows.append({"ranks": ranks, "emulated_heterogeneity": hetero,
                     "quiet_error_pct": statistics.median(calm) if calm else None, "quiet_runs": len(calm),
                     "quiet_inrun_error_pct": (statistics.median(r["inrun_error_pct"] for r in calm_runs)
                                               if calm_runs else None),
                     "predicted_ms": statistics.median(r["predicted_ms"] for r in rs),
                     "measured_ms": statistics.median(r["measured_ms"] for r in rs),
                     "plan_predicted_ms": statistics.median(r["plan_predicted_ms"] for r in rs),
                     "error_pct": statistics.median(r["error_pct"] for r in rs),
                     "error_pcts": [r["error_pct"] for r in rs],
                     "previous_model_ms": statistics.median(r["previous_model_ms"] for r in rs),
                     "previous_model_error_pct": statistics.median(r["previous_model_error_pct"] for r in rs),
                     "previous_model_error_pcts": [r["previous_model_error_pct"] for r in rs],
                     "no_executor_error_pct": statistics.median(r["no_executor_error_pct"] for r in rs),
                     "no_executor_error_pcts": [r["no_executor_error_pct"] for r in rs],
                     "even_sharing_ms": statistics.median(r["even_sharing_ms"] for r in rs),
                     "even_sharing_error_pct": statistics.median(r["even_sharing_error_pct"] for r in rs),
                     "inrun_predicted_ms": statistics.median(r["inrun_predicted_ms"] for r in rs),
                     "inrun_error_pct": statistics.median(r["inrun_error_pct"] for r in rs),
                     "inrun_error_pcts": [r["inrun_error_pct"] for r in rs],
                     "warm_profile_ms": statistics.median(r["warm_profile_ms"] for r in rs),
                     "warm_profile_error_pct": statistics.median(r["warm_profile_error_pct"] for r in rs),
                     "warm_profile_error_pcts": [r["warm_profile_error_pct"] for r in rs],
                     "inrun_executor_error_pct": statistics.median(r["inrun_executor_error_pct"] for r in rs),
                     "inrun_executor_error_pcts": [r["inrun_executor_error_pct"] for r in rs],
                     "inrun_messages_error_pcts": [None if r["inrun_messages_ms"] is None
                                                   else round(pct(r["measured_ms"], r["inrun_messages_ms"]), 2)
                                                   for r in rs],
                     "pass_scale": [r["pass_scale"] for r in rs],
                     "pass_cpu_over_profile": [r["pass_cpu_over_profile"] for r in rs],
                     "profile_drift_pcts": [r["profile_drift_pct"] for r in rs],
                     "external_load_cores": [r["external_load_cores"] for r in rs], "runs": rs})
    return {"goal_abs_error_pct": 10.0, "cores": cores,
            "error_pct": "median over repeats of (measured - predicted) / predicted; each run is priced with the "
                         "mean of two profiles of this CPU, one just before and one just after it",
            "quiet_error_pct": "the same over the runs during which other processes kept at most "
                               f"{quiet['max_load']} cores busy (quiet_runs of them)",
            "previous_model_error_pct": "the same, priced as before the sharing probe held a stage's microbatches "
                                        "in flight and messages cost CPU time",
            "inrun_messages_error_pcts": "as inrun_error_pct, with the messages' CPU time and the executor's own "
                                         "(per message and per pass, measured by the profile's executor probe) "
                                         "priced too",
            "no_executor_error_pct": "as error_pct, priced without the executor probe's costs (messages cost "
                                     "only the P2P probe's CPU time: the model before it)",
            "inrun_executor_error_pct": "as inrun_error_pct, with each rank's measured comm_ms (posting messages) "
                                        "and other_ms (executor time outside passes, waits and the optimizer) "
                                        "added to its passes: the part of the in-run gap the simulator leaves "
                                        "unpriced",
            "warm_profile_error_pct": "as error_pct, priced with profiles whose block passes were timed in a "
                                      "tight loop (warm caches; the profile's method before the eviction sweep), "
                                      "taken in the same brackets",
            "even_sharing_error_pct": "the same, priced as before the core sharing table: passes that overlap "
                                      "split the cores evenly, and an emulated device's padding holds a core",
            "inrun_error_pct": "measured against the plan simulated with the pass and optimizer times measured "
                               "in the same run (a device per rank: the wall times include the sharing): the "
                               "simulator's composition alone, without the profile",
            "pass_scale": "per run and rank: measured compute (+ padding) wall time over the planned, one device each",
            "pass_cpu_over_profile": "per run and rank: the passes' CPU time in the run over the profile's time "
                                     "of the same passes alone (CPU time inflated by company on the cores, or drift)",
            "rows": rows}


def planning(tmp: Path, ch, profile: Path, link, steps: int, repeats: int, cores: int, machine: Machine,
             quiet: dict[str, float]) -> dict[str, Any]:
    """3. the solver's plan vs the uniform and parameter-balanced baselines', emulated, interleaved."""
    from planner.solver.api import solve
    from planner.solver.baseline_plans import baseline
    from planner.solver.policy import VerificationPolicy
    cl = cluster(profile, [1.0, SLOW], link)
    cfg, policy = config(), VerificationPolicy(enabled=False)
    sols = {"solver": solve(ch, cl, cfg, policy, time_limit_s=20, workers=1),
            "uniform": baseline("uniform", ch, cl, cfg, policy),
            "params": baseline("params", ch, cl, cfg, policy)}
    paths = {name: compile_solution(sol, ch, cl, tmp, f"plan-{name}") for name, sol in sols.items()}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in sols}
    names = list(sols)
    for i in range(repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:
            runs[name].append(run_quiet(lambda name=name: run_plan(paths[name], steps, emulate=True), **quiet))
    # The same plans priced again with a profile taken after their runs: the CPU's speed drifts, so the
    # prediction is the mean of the two, as in section 2.
    after, _ = timed_profile(tmp / "cpu-after-planning.json")
    cl_after = cluster(after, [1.0, SLOW], link)
    out = []
    for name, sol in sols.items():
        rs = runs[name]
        again = compile_solution(sol, ch, cl_after, tmp, f"plan-{name}-after")
        priced = [priced_step_ms(p, cores, machine.sharing, emulated=True, messages=machine.messages)
                  for p in (paths[name], again)]
        out.append({"plan": name, "stages": [[s.first_block, s.last_block, list(s.devices)] for s in sol.stages],
                    "predicted_ms": statistics.fmean(priced), "predicted_before_after_ms": priced,
                    "measured_ms": statistics.median(r["measured_ms"] for r in rs),
                    "measured_runs_ms": [r["measured_ms"] for r in rs],
                    "external_load_cores": [r["external_load_cores"] for r in rs]})
    fastest = min(out, key=lambda r: r["measured_ms"])["plan"]
    return {"plans": out, "fastest_measured": fastest, "cluster_efficiency_scales": [1.0, SLOW]}
