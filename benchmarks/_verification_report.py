"""The detection benchmark's goals, its printed table and lines, and how it writes its JSON (``verification.py``)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["GOALS", "distributed_goals", "print_table", "wide_key", "wide_line", "write_json"]

GOALS = {"f1": 0.95, "fpr": 0.005, "overhead": 0.05}


def print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Verification: detection per attack (pairs = (step, sender))")
    for col in ("attack", "precision", "recall", "F1", "detect (steps)", "ban (steps)", "val loss verified",
                "val loss unverified", "damage unverified"):
        table.add_column(col, justify="right" if col != "attack" else "left")
    for name, row in report["attacks"].items():
        table.add_row(name, f"{row['precision']:.3f}", f"{row['recall']:.3f}", f"{row['f1']:.3f}",
                      lat_cell(row["detect_latency_steps"]), lat_cell(row["ban_latency_steps"]),
                      f"{row['val_loss_attacked_verified']:.3f}", f"{row['val_loss_attacked_unverified']:.3f}",
                      f"{row['damage_unverified']:+.3f}")
    console = Console()
    console.print(table)
    clean, over = report["clean"], report["overhead"]
    console.print(f"clean runs: FPR {clean['fpr']:.4f} ({clean['blamed_pairs']}/{clean['pairs']} (step, sender) "
                  f"pairs), bans {clean['banned']}, val loss {clean['val_loss']:.3f}")
    for row in report.get("clean_wide", []):
        console.print(wide_line(row))
    console.print(f"emulated step (CPU): {over['step_ms_verify_on']:.1f} ms verified vs "
                  f"{over['step_ms_verify_off']:.1f} ms unverified (+{100 * over['overhead']:.1f}%, "
                  f"{over['us_per_check']:.0f} us per check; serial, gpt-tiny)")
    for row in over["at_width"]:
        console.print(f"  d_model {row['d_model']:4d}, {row['layers_per_stage']} layers/stage, "
                      f"{row['microbatch']}x{row['seq']} tokens: stage fwd+bwd {row['stage_fwd_bwd_ms']:.1f} ms, "
                      f"its two checks {row['checks_ms']:.2f} ms ({100 * row['overhead']:.1f}%)")
    for row in over["distributed"] + over.get("distributed_emulated", []):
        slowed = f" (compute emulated {row['slowdown']:g}x slower)" if row.get("slowdown", 1.0) != 1.0 else ""
        console.print(f"  stagewise run{slowed}, {row['model']}, verifier on {row['verifier']}: step "
                      f"{row['step_ms_verify_on']:.1f} vs {row['step_ms_verify_off']:.1f} ms "
                      f"({100 * row['overhead']:+.1f}% wall), CPU {row['cpu_ms_verify_on']:.0f} vs "
                      f"{row['cpu_ms_verify_off']:.0f} ms ({100 * row['cpu_overhead']:+.1f}%), {row['runs']} run(s) each")
    goals = report["goals"]
    console.print(f"goals: F1 >= {GOALS['f1']} on every attack: {goals['f1_all']}; FPR <= {GOALS['fpr']}: "
                  f"{goals['fpr']}; overhead <= {GOALS['overhead']}: widest emulated stage {goals['overhead']}, "
                  f"distributed {goals['overhead_distributed']}; FPR at width {goals.get('fpr_wide', {})}")


def lat_cell(values: list[int | None]) -> str:
    return ",".join("-" if v is None else str(v) for v in values)


def distributed_goals(rows: list[dict[str, Any]]) -> dict[str, bool]:
    return {f"{r['model']} / {r['verifier']}": r["overhead"] <= GOALS["overhead"] for r in rows}


def wide_line(row: dict[str, Any]) -> str:
    return (f"clean runs, {row['model']}, lr {row['lr']:g} (warm-up {row.get('lr_warmup', 0)}), {row['steps']} "
            f"steps, seeds {row.get('seeds', [row.get('seed', 0)])}: FPR {row['fpr']:.4f} "
            f"({row['blamed_pairs']}/{row['pairs']}; per seed {row.get('fpr_per_seed', [row['fpr']])}), "
            f"bans {row['banned']}, "
            f"flags {row['flags_by_test']}")


def wide_key(row: dict[str, Any]) -> str:
    return f"d={row['d_model']} lr={row['lr']:g} lr warm-up {row.get('lr_warmup', 0)}"


def write_json(report: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, out)
