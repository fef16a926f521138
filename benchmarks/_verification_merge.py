"""The detection benchmark's partial reruns (``verification.py --only``): one section timed again and merged into
the report's JSON, its other sections kept."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from benchmarks._verification_cost import contribution_cost
from benchmarks._verification_distributed import OVERHEAD_MODELS, distributed_overhead
from benchmarks._verification_metrics import wide_clean
from benchmarks._verification_report import (
    GOALS,
    distributed_goals,
    wide_key,
    wide_line,
    write_json,
)

__all__ = ["only_clean_wide", "only_contributions", "only_overhead"]


def only_contributions(out: Path | None, *, widths: tuple[int, ...]) -> int:
    """Time the replicas' contribution checks alone (:func:`contribution_cost`) and merge them into the report
    at ``out`` as ``overhead.contributions`` (goal: <= 5% of a replica's step at d >= 384)."""
    rows = contribution_cost(widths)
    for r in rows:
        print(f"  contributions d={r['d_model']}: replica step {r['replica_step_compute_ms']} ms, sketch "
              f"{r['sketch_ms']} ms ({r['overhead']:+.1%}), judge {r['judge_ms']} ms, robust sum "
              f"{r['robust_sum_ms']} ms ({r['overhead_robust']:+.1%} with it)", flush=True)
    if out is None:
        return 0
    report = json.loads(out.read_text()) if out.exists() else {"overhead": {}, "goals": {}}
    report["overhead"]["contributions"] = rows
    report.setdefault("goals", {})["overhead_contributions"] = all(
        r["overhead"] <= GOALS["overhead"] for r in rows if r["d_model"] >= 384)
    write_json(report, out)
    return 0


def only_overhead(out: Path | None, *, reps: int, models: list[str], wait_first: bool, slowdown: float = 1.0,
                  steps: int | None = None) -> int:
    """Rerun the distributed overhead alone and merge it into the report at ``out`` (the
    detection results there are kept; None: nothing written); records how long it took and the machine's load.
    With a ``slowdown`` the rows go to ``distributed_emulated`` (see :func:`distributed_overhead`).
    ``steps``: steps per run instead of each model's own (a smoke run)."""
    load_before, t0 = os.getloadavg(), time.perf_counter()
    chosen = {m: OVERHEAD_MODELS[m][:2] + (steps or OVERHEAD_MODELS[m][2],) for m in models}
    rows = distributed_overhead(chosen, reps=reps, wait_first=wait_first, slowdown=slowdown)
    duration_s = time.perf_counter() - t0
    report = json.loads(out.read_text()) if out is not None and out.exists() else {"overhead": {}, "goals": {}}
    section = "distributed" if slowdown == 1.0 else "distributed_emulated"
    # Rows of the models not rerun stay; the rerun ones replace theirs (in OVERHEAD_MODELS' order).
    kept = [r for r in report["overhead"].get(section, []) if r["model"] not in models]
    order = list(OVERHEAD_MODELS)
    merged = sorted(kept + rows, key=lambda r: (order.index(r["model"]) if r["model"] in order else len(order),
                                                 r["verifier"] != "stage rank 0"))
    report["overhead"][section] = merged
    runs = report["overhead"].get(f"{section}_runs", {})
    runs = runs if isinstance(runs, dict) else {}
    for model in models:
        runs[model] = {"models_in_run": models, "duration_s": round(duration_s, 1), "reps": reps,
                       "wait_first": wait_first, "slowdown": slowdown,
                       "load_avg_before": [round(x, 2) for x in load_before],
                       "load_avg_after": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count()}
    report["overhead"][f"{section}_runs"] = runs
    report["overhead"]["distributed_note"] = (
        "`stagewise run`, 4 stage ranks (+ a verifier host) on 2 shared cores: the checks' CPU time cannot hide "
        "behind compute here, so wall and CPU overhead are reported separately; cpu_ms is summed over ranks. "
        "distributed_emulated: every stage's compute emulated `slowdown` times slower than this CPU (its core "
        "idles meanwhile, as a GPU's host CPU does), the checks free to overlap it")
    report.setdefault("goals", {})[f"overhead_{section}"] = distributed_goals(merged)
    for row in rows:
        print(f"stagewise run, {row['model']}, verifier on {row['verifier']}: step {row['step_ms_verify_on']:.1f} vs "
              f"{row['step_ms_verify_off']:.1f} ms ({100 * row['overhead']:+.1f}% wall), CPU "
              f"{row['cpu_ms_verify_on']:.0f} vs {row['cpu_ms_verify_off']:.0f} ms ({100 * row['cpu_overhead']:+.1f}%)"
              + (f"; waiting first {row['step_ms_wait_first']:.1f} ms ({100 * row['overhead_wait_first']:+.1f}% "
                 f"wall, {100 * row['cpu_overhead_wait_first']:+.1f}% CPU)" if "step_ms_wait_first" in row else ""))
    print(f"took {duration_s:.0f} s; load average before {load_before}, after {os.getloadavg()}")
    if out is not None:
        write_json(report, out)
    return 0


def only_clean_wide(out: Path | None, *, wide: dict[str, Any]) -> int:
    """Rerun the wide clean runs alone and merge them into the report at ``out`` (its other
    sections are kept; None: nothing written)."""
    rows = wide_clean(**wide)
    report = json.loads(out.read_text()) if out is not None and out.exists() else {}
    report["clean_wide"] = rows
    report.setdefault("goals", {})["fpr_wide"] = {wide_key(r): r["fpr"] <= GOALS["fpr"]
                                                  for r in rows}
    for row in rows:
        print(wide_line(row))
    if out is not None:
        write_json(report, out)
    return 0
