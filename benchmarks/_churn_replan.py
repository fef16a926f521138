"""The churn benchmark's part 1: plan, lose a host, and time the re-plan against a fresh plan."""
from __future__ import annotations

import os
import time
from typing import Any

from benchmarks._churn_config import (
    QUICK,
    ROOT,
)

__all__ = ["print_replan", "replan_case"]


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
    kwargs = {"spec": model, "global_batch": 16, "dtype": "fp32"}

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
    kwargs = {"spec": "gpt-1.3b", "seq": 2048, "global_batch": 512, "dtype": "float16",
              "policy": VerificationPolicy(enabled=False)}
    return "DT-FM worldwide (64 V100), gpt-1.3b fp16, 512 x 2048", chain, cluster, kwargs, _middle_host


def _case_176(limit: float):
    from benchmarks.warm_replan import _case, _lost_hosts
    from planner.solver.policy import VerificationPolicy
    chain, cluster = _case()
    kwargs = {"spec": "bench:chain", "global_batch": 32, "policy": VerificationPolicy()}
    return ("solver benchmark 1000x176 (tiered, seeded chain), batch 32", chain, cluster, kwargs,
            lambda plan: _lost_hosts(plan)[0][1])


def replan_case(devices: int, limit: float, first_limit: float, workers: int, quick: bool = False
                ) -> dict[str, Any]:
    """One re-plan case (``quick``: the 8-device cluster with a tiny model)."""
    from planner.api import plan_chain
    from planner.replan import replan

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


def print_replan(row: dict[str, Any]) -> None:
    for name in ("first", "replan", "fresh"):
        p = row[name]
        limit = row["first_limit_s"] if name == "first" else row["limit_s"]
        print(f"{row['devices']:>4} {name:>7} {limit:4.0f} s  wall {p['wall_s']:7.1f} s  cpu {p['cpu_s']:7.1f} s  "
              f"obj {p['objective_ms']:11.1f} ms  sim {p['simulated_ms']:11.1f} ms  S={p['stages']:<3} "
              f"ranks={p['ranks']:<4}{'  lost ' + row['lost_host'] if name == 'replan' else ''}", flush=True)
    print(f"{row['devices']:>4} re-plan vs fresh: objective {100 * row['replan_vs_fresh_objective']:+.2f}%, "
          f"simulated {100 * row['replan_vs_fresh_simulated']:+.2f}%", flush=True)
