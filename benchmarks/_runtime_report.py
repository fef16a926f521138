"""The runtime benchmark's tables and its results file."""
from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

__all__ = ["print_results", "write_results"]


def write_results(console, out: dict[str, Any], path: Path | None) -> int:
    """Write the results JSON atomically (``path`` None: a quick run, nothing written)."""
    if path is None:
        return 0
    target = path.resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = target.with_suffix(".json.tmp")
    tmp_out.write_text(json.dumps(out, indent=1) + "\n")
    os.replace(tmp_out, target)
    console.print(f"wrote {target}")
    return 0


def print_results(console, out: dict[str, Any]) -> None:
    if "vs_torch_pipelining" in out:
        _print_overhead(console, out["vs_torch_pipelining"])
    if "predicted_vs_measured" in out:
        _print_prediction(console, out)
    if "solver_vs_baselines" in out:
        _print_planning(console, out["solver_vs_baselines"])


def _print_overhead(console, vs: dict[str, Any]) -> None:
    from rich.table import Table
    t = Table(title=f"1. runtime overhead (2 ranks, same split, 1F1B; median of {vs['repeats']} interleaved runs)")
    for c in ("", "ours", "torch Schedule1F1B", "ratio", "goal"):
        t.add_column(c, justify="right")
    t.add_row("wall ms/step", f"{vs['ours_ms']:.1f}", f"{vs['torch_1f1b_ms']:.1f}", f"{vs['ratio']:.3f}", "<= 1.05")
    t.add_row("CPU ms/step (all ranks)", f"{vs['ours_cpu_ms']:.1f}", f"{vs['torch_cpu_ms']:.1f}",
              f"{vs['cpu_ratio']:.3f}", "")
    console.print(t)


def _print_prediction(console, out: dict[str, Any]) -> None:
    from rich.table import Table
    pvm = out["predicted_vs_measured"]
    t = Table(title=f"2. simulator vs measured (ranks share {pvm['cores']} cores; median of {out['repeats']} "
                    "repeats, each run priced with profiles just before and after it; quiet: others used <= "
                    f"{out['max_external_load_cores']} cores)")
    for c in ("ranks", "emulated", "predicted ms", "previous model ms", "even sharing ms", "from in-run passes ms",
              "measured ms", "error %", "no executor %", "warm profile %", "previous %", "even %", "in-run %",
              "in-run + probe %", "in-run + own comm+other %",
              "quiet runs: error %", "per repeat %", "others' load (cores)"):
        t.add_column(c, justify="right")
    for r in pvm["rows"]:
        calm = "-" if r["quiet_error_pct"] is None else f"{r['quiet_error_pct']:+.1f} ({r['quiet_runs']})"
        t.add_row(str(r["ranks"]), "yes" if r["emulated_heterogeneity"] else "no", f"{r['predicted_ms']:.1f}",
                  f"{r['previous_model_ms']:.1f}", f"{r['even_sharing_ms']:.1f}", f"{r['inrun_predicted_ms']:.1f}",
                  f"{r['measured_ms']:.1f}", f"{r['error_pct']:+.1f}", f"{r['no_executor_error_pct']:+.1f}",
                  f"{r['warm_profile_error_pct']:+.1f}",
                  f"{r['previous_model_error_pct']:+.1f}", f"{r['even_sharing_error_pct']:+.1f}",
                  f"{r['inrun_error_pct']:+.1f}", _median_pct(r["inrun_messages_error_pcts"]),
                  f"{r['inrun_executor_error_pct']:+.1f}", calm,
                  " ".join(f"{e:+.0f}" for e in r["error_pcts"]),
                  " ".join("?" if x is None else f"{x:.2f}" for x in r["external_load_cores"]))
    console.print(t)


def _median_pct(values: list[float | None]) -> str:
    kept = [v for v in values if v is not None]
    return f"{statistics.median(kept):+.1f}" if kept else "-"


def _print_planning(console, plans: dict[str, Any]) -> None:
    from rich.table import Table
    t = Table(title="3. plans on an emulated heterogeneous cluster (this CPU + one at 1/3 of its efficiency)")
    for c in ("plan", "stages [first, last, devices]", "predicted ms", "measured ms", "runs ms"):
        t.add_column(c, justify="right")
    for r in plans["plans"]:
        t.add_row(r["plan"], str(r["stages"]), f"{r['predicted_ms']:.1f}", f"{r['measured_ms']:.1f}",
                  " ".join(f"{x:.0f}" for x in r["measured_runs_ms"]))
    console.print(t)
    console.print(f"fastest measured: {plans['fastest_measured']}")
