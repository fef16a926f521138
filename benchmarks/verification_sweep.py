"""Strength sweep of the integrity monitors: where each attack turns from "caught" to "harmless".

Each attack family of the detection benchmark (``benchmarks/verification.py``) run at a
range of strengths: scale by a factor (activations, and gradients with ``dir=grad``),
noise of a relative std, a bias of a relative size, a stale worker's delay at several
probabilities per microbatch. Every run is that benchmark's single-process emulation
(``verification.run``: gpt-tiny, 4 stages, the attacker rank 1, the runtime's own
``Attacker.apply`` / ``Verifier.check`` / ``flag_events`` + ``end_step`` calls, one
verifier over every boundary both ways), so the verifier code measured is the
distributed runtime's.

Per strength, pooled over seeds:

- detection delay: steps from the attack's first corrupted tensor to the first step the
  attacker is blamed (its tensor flagged, as the most upstream sender) and to its ban
  (the attacker keeps attacking after it, as in ``stagewise run``); a delay of ``d``
  steps starts at step ``max(start, d)``, when a ``d``-step-old tensor first exists;
- precision, recall and F1 over (step, sender) pairs, and honest ranks banned;
- damage when undetected: validation loss after the same run with verification off
  minus a clean run's of the same length and seed (the mean over seeds).

    python benchmarks/verification_sweep.py            # writes benchmarks/results/verification_sweep.{json,png}
    python benchmarks/verification_sweep.py --quick    # a smoke run of a few points (JSON and PNG to a temporary
                                                       # folder unless --out)
    python benchmarks/verification_sweep.py --replot benchmarks/results/verification_sweep.json   # the PNG only
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.verification import (  # noqa: E402
    ATTACKER,
    RunConfig,
    RunResult,
    _write,
    detection,
    run,
)

# family -> (spec template, strengths from weakest to strongest, the strength's name)
FAMILIES: dict[str, tuple[str, tuple[float, ...], str]] = {
    "scale act": ("kind=scale,factor={}", (0.9, 0.7, 0.5, 0.2, 0.0, -0.5, -1.0), "factor"),
    "scale grad": ("kind=scale,factor={},dir=grad", (0.9, 0.7, 0.5, 0.2, 0.0, -0.5, -1.0), "factor"),
    "noise": ("kind=noise,std={}", (0.05, 0.1, 0.2, 0.5, 1.0), "std"),
    "bias": ("kind=bias,rel={}", (0.05, 0.1, 0.3, 1.0), "rel"),
    "delay p=0.1": ("kind=delay,steps={:d},p=0.1", (1, 2, 5, 20, 50), "steps"),
    "delay p=0.5": ("kind=delay,steps={:d},p=0.5", (1, 2, 5, 20, 50), "steps"),
    "delay p=1": ("kind=delay,steps={:d},p=1", (1, 2, 5, 20, 50), "steps"),
}
QUICK: dict[str, tuple[float, ...]] = {"scale act": (0.9, -1.0), "noise": (0.05, 1.0), "delay p=1": (2,)}
HARMLESS_NATS = 0.05   # the plot's line: below it an undetected attack is called harmless (see the report)


@dataclass(frozen=True, slots=True, kw_only=True)
class SweepConfig:
    """The runs of every point: the attack from ``start`` (a delay's later) for ``attack_steps``."""

    seeds: tuple[int, ...] = (0, 1)
    start: int = 20
    attack_steps: int = 40


def spec_for(family: str, strength: float) -> str:
    template, _, _ = FAMILIES[family]
    return template.format(int(strength) if "{:d}" in template else strength)


def attack_start(family: str, strength: float, start: int) -> int:
    """A delay of ``d`` steps has nothing to replay before step ``d``: it starts there."""
    return max(start, int(strength)) if FAMILIES[family][0].startswith("kind=delay") else start


def run_config(cfg: SweepConfig, family: str, strength: float, seed: int) -> RunConfig:
    start = attack_start(family, strength, cfg.start)
    return RunConfig(steps=start + cfg.attack_steps, start=start, seed=seed, attack=spec_for(family, strength))


def latencies(result: RunResult) -> tuple[int | None, int | None, int | None]:
    """(first corrupted step, steps from it to the attacker's first blame, to its ban)."""
    if not result.attacked_steps:
        return None, None, None
    first = result.attacked_steps[0]
    row = detection([result], first)
    return first, row["detect_latency_steps"][0], row["ban_latency_steps"][0]


def measure(cfg: SweepConfig, family: str, strength: float, clean_val: dict[tuple[int, int], float]) -> dict[str, Any]:
    """One point of the sweep: verified runs (the attacker never stops) and unverified ones."""
    on, damage = [], []
    for seed in cfg.seeds:
        rc = run_config(cfg, family, strength, seed)
        on.append(run(rc))
        off = run(dataclasses.replace(rc, verify=False))
        damage.append(off.val_loss - clean_val_of(clean_val, rc))
    pooled = detection(on, 0)
    first, detect, ban = zip(*(latencies(r) for r in on))
    honest_banned = sorted({rank for r in on for rank in r.banned if rank != ATTACKER})
    return {"family": family, "strength": strength, "spec": spec_for(family, strength),
            "start": run_config(cfg, family, strength, cfg.seeds[0]).start,
            **{k: pooled[k] for k in ("tp", "fp", "fn", "precision", "recall", "f1")},
            "first_attacked_step": list(first), "detect_delay_steps": list(detect), "ban_delay_steps": list(ban),
            "attacker_banned": [ATTACKER in r.banned for r in on], "honest_banned": honest_banned,
            "damage_unverified": round(statistics.fmean(damage), 4),
            "damage_unverified_per_seed": [round(d, 4) for d in damage]}


def clean_val_of(clean_val: dict[tuple[int, int], float], rc: RunConfig) -> float:
    """The clean validation loss of ``rc``'s length and seed, computed once."""
    key = (rc.steps, rc.seed)
    if key not in clean_val:
        clean_val[key] = run(dataclasses.replace(rc, attack=None, verify=False)).val_loss
    return clean_val[key]


def sweep(cfg: SweepConfig, points: dict[str, tuple[float, ...]]) -> dict[str, Any]:
    """Every (family, strength) of ``points``; the report the JSON holds."""
    load_before, t0 = os.getloadavg(), time.perf_counter()
    clean_val: dict[tuple[int, int], float] = {}
    rows = []
    for family, strengths in points.items():
        for strength in strengths:
            rows.append(measure(cfg, family, strength, clean_val))
            print(f"  {family} {FAMILIES[family][2]}={strength:g}: F1 {rows[-1]['f1']:.3f}, ban delay "
                  f"{_lat(rows[-1]['ban_delay_steps'])}, damage {rows[-1]['damage_unverified']:+.3f}",
                  file=sys.stderr, flush=True)
    base = RunConfig()
    return {"setup": {"model": "gpt-tiny", "stages": base.stages, "microbatches": base.microbatches,
                      "microbatch_size": base.microbatch_size, "seq": base.seq, "lr": base.lr, "optimizer": "adam",
                      "seeds": list(cfg.seeds), "attack_start": cfg.start, "attack_steps": cfg.attack_steps,
                      "attacker_rank": ATTACKER, "verifier_config": base.verifier_config,
                      "pipeline": "single-process emulation of benchmarks/verification.py; one verifier checks "
                                  "every boundary both ways",
                      "delays": "from the first corrupted step; a delay of d steps starts at max(start, d)",
                      "damage": "validation loss, verification off and the attack on, minus clean (same length, "
                                "seed), mean over seeds",
                      "harmless_nats": HARMLESS_NATS},
            "clean_val_loss": {f"{steps} steps, seed {seed}": round(v, 4) for (steps, seed), v in clean_val.items()},
            "points": rows,
            "run": {"duration_s": round(time.perf_counter() - t0, 1), "cpus": os.cpu_count(),
                    "torch": torch.__version__, "load_avg_before": [round(x, 2) for x in load_before],
                    "load_avg_after": [round(x, 2) for x in os.getloadavg()]}}


def verdict(row: dict[str, Any]) -> str:
    """banned (every seed), flagged (blamed but not always banned), or missed, with its damage."""
    if all(row["attacker_banned"]):
        return "banned"
    if row["tp"]:
        return "flagged"
    return "missed, harmless" if row["damage_unverified"] < HARMLESS_NATS else "missed, HARMFUL"


def print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Verification strength sweep (delays in steps from the first corrupted tensor, per seed)")
    for col in ("attack", "strength", "F1", "precision", "recall", "first blame", "ban", "honest banned",
                "damage unverified", "verdict"):
        table.add_column(col, justify="left" if col in ("attack", "verdict") else "right")
    for row in report["points"]:
        table.add_row(row["family"], f"{FAMILIES[row['family']][2]}={row['strength']:g}", f"{row['f1']:.3f}",
                      f"{row['precision']:.3f}", f"{row['recall']:.3f}", _lat(row["detect_delay_steps"]),
                      _lat(row["ban_delay_steps"]), str(row["honest_banned"] or "-"),
                      f"{row['damage_unverified']:+.3f}", verdict(row))
    console = Console(width=160)
    console.print(table)
    console.print(f"took {report['run']['duration_s']:.0f} s; load average before {report['run']['load_avg_before']}, "
                  f"after {report['run']['load_avg_after']}")


def _lat(values: list[int | None]) -> str:
    return ",".join("-" if v is None else str(v) for v in values)


def plot(report: dict[str, Any], out: Path) -> None:
    """Per family: strength on x (weak to strong), detection delays of the worst seed (left axis;
    one never caught sits on the 'never' line) and damage when undetected (right axis)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = list(dict.fromkeys(row["family"] for row in report["points"]))
    never = report["setup"]["attack_steps"]
    cols = min(4, len(families))
    rows_n = -(-len(families) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.4 * rows_n), squeeze=False)
    for ax, family in zip(axes.flat, families):
        rows = [r for r in report["points"] if r["family"] == family]
        x = range(len(rows))
        for key, label, marker in (("detect_delay_steps", "first blame", "o"), ("ban_delay_steps", "ban", "s")):
            ax.plot(x, [_worst(r[key], never) for r in rows], marker=marker, label=label)
        ax.axhline(never, color="grey", lw=0.8, ls=":")
        ax.set_ylim(-1, never * 1.1)
        ax.set_ylabel(f"steps, worst seed (never = {never})")
        ax.set_xticks(list(x), [f"{r['strength']:g}" for r in rows])
        ax.set_xlabel(f"{FAMILIES[family][2]} (weak -> strong)")
        ax.set_title(family)
        twin = ax.twinx()
        damage = [r["damage_unverified"] for r in rows]
        twin.plot(x, damage, color="tab:red", marker="^", label="damage")
        missed = [i for i, r in enumerate(rows) if not all(r["attacker_banned"])]
        twin.scatter(missed, [damage[i] for i in missed], s=150, marker="X", color="black", zorder=3,
                     label="not banned (a seed)")
        twin.set_yscale("symlog", linthresh=HARMLESS_NATS)   # linear up to the line, then log
        twin.set_ylim(min(-HARMLESS_NATS, *damage), max(2 * HARMLESS_NATS, *damage) * 1.5)
        twin.axhline(HARMLESS_NATS, color="tab:red", lw=0.8, ls="--")
        twin.set_ylabel("damage unverified (val loss, nats)", color="tab:red")
        handles, labels = (a + b for a, b in zip(ax.get_legend_handles_labels(), twin.get_legend_handles_labels()))
    spare = list(axes.flat)[len(families):]
    for ax in spare:
        ax.axis("off")
    # one legend for all panels: in a spare panel, else under the last one's title
    (spare[0] if spare else ax).legend(handles, labels, loc="center" if spare else "upper left", fontsize=8)
    fig.suptitle("Verification strength sweep (gpt-tiny, emulated 4-stage pipeline, attacker rank 1; "
                 f"dashed red: damage {HARMLESS_NATS} nats; damage axis linear below it, log above)", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _worst(values: list[int | None], never: int) -> int:
    """The latest over seeds, a seed never caught counted at ``never``."""
    return max(never if v is None else v for v in values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: a few points, one seed, short runs")
    parser.add_argument("--replot", metavar="JSON", help="only redraw the PNG beside JSON from its results")
    parser.add_argument("--out", default=None,
                        help="the JSON to write (the PNG beside it); default benchmarks/results/"
                             "verification_sweep.json, none with --quick")
    args = parser.parse_args(argv)
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), Path(args.replot).with_suffix(".png"))
        return 0
    torch.set_num_threads(1)
    if args.quick:  # past the monitors' 5 warm-up steps, a few attacked ones
        report = sweep(SweepConfig(seeds=(0,), start=6, attack_steps=5), QUICK)
    else:
        report = sweep(SweepConfig(), {family: strengths for family, (_, strengths, _) in FAMILIES.items()})
    print_table(report)
    if args.out or not args.quick:
        _save(report, Path(args.out or ROOT / "benchmarks" / "results" / "verification_sweep.json"))
    else:
        with tempfile.TemporaryDirectory() as tmp:  # a smoke run writes and draws too, but not into results/
            _save(report, Path(tmp) / "verification_sweep.json")
    return 0


def _save(report: dict[str, Any], out: Path) -> None:
    """The JSON at ``out``, the PNG beside it."""
    _write(report, out)
    plot(report, out.with_suffix(".png"))


if __name__ == "__main__":
    sys.exit(main())
