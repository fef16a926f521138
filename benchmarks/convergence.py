"""Convergence under boundary codecs: loss curves of real `stagewise run`s, each codec against the uncompressed run.

Models: the ``gpt-tiny`` preset and a tiny stock Hugging Face Llama (``hf:llama``, 2 layers of 32), each planned
on 2 stages (``stagewise plan MODEL --cluster default --stages 2 --dtype fp32 --global-batch 8 --compress C``)
and run for ``--steps`` steps (default 300, byte text, lr 3e-3, seed 0, no verification, one gloo process per
rank on this CPU) with ``--compress`` none, fp8, int8 and int4. Per run: the final loss (mean of the last 20
steps) and its relative distance to the uncompressed run's; the curves go to ``results/convergence.png``.
``--seeds 0,1,2`` runs every row once per seed and compares the means: one seed's trajectory is chaotic, and two
runs whose boundaries differ by any rounding at all end up about 1% apart in final loss.

Goals (issue 39): int8 and fp8 within 1% of the uncompressed final loss, int4 within 3%.

Run: ``python benchmarks/convergence.py [--steps N]`` (about 5 minutes on 2 cores), prints a table and writes
``benchmarks/results/convergence.json`` and the plot; ``--quick``: gpt-tiny, none and int8, 10 steps, nothing
written. ``--models`` / ``--codecs`` rerun only those rows: they replace their rows in the JSON (the others, and the
``none`` rows they are compared with, are kept); ``--dry-run`` writes nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "convergence.json"
PLOT = ROOT / "benchmarks" / "results" / "convergence.png"
MODELS = {"gpt-tiny": "gpt-tiny",
          "hf-llama": "hf:llama?hidden_size=32,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2,"
                      "intermediate_size=64,vocab_size=256,max_position_embeddings=32"}
CODECS = ("none", "fp8", "int8", "int4")
GOAL = {"fp8": 0.01, "int8": 0.01, "int4": 0.03}
TAIL = 20  # final loss: the mean of the last this many steps (one step's loss is noisy)


def _cli(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "COLUMNS": "160"}
    return subprocess.run([sys.executable, "-m", "planner", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=timeout)


def _run_seeds(name: str, spec: str, codec: str, steps: int, seeds: list[int], work: Path) -> dict:
    """One row: the runs of every seed, their final losses, their mean (the row's) and their mean curve."""
    runs = [_run(name, spec, codec, steps, seed, work) for seed in seeds]
    bad = next((r for r in runs if "error" in r), None)
    if bad is not None:
        return bad
    finals = [r["final_loss"] for r in runs]
    curve = [round(sum(c) / len(c), 5) for c in zip(*(r["losses"] for r in runs))]
    return {**runs[0], "seeds": seeds, "final_losses": finals, "final_loss": round(sum(finals) / len(finals), 5),
            "run_s": round(sum(r["run_s"] for r in runs), 1), "losses": curve}


def _run(name: str, spec: str, codec: str, steps: int, seed: int, work: Path) -> dict:
    plan, report = work / f"{name}-{codec}.json", work / f"{name}-{codec}.report.json"
    made = _cli("plan", spec, "--cluster", "default", "--stages", "2", "--dtype", "fp32", "--global-batch", "8",
                "--seq", "32", "--compress", codec, "--time-limit", "2", "-o", str(plan), timeout=300)
    if made.returncode:
        return {"model": name, "codec": codec, "error": made.stderr.strip().splitlines()[-1]}
    codecs = [st["out_codec"] for st in json.loads(plan.read_text())["stages"][:-1]]
    t0 = time.perf_counter()
    ran = _cli("run", str(plan), "--steps", str(steps), "--lr", "3e-3", "--seed", str(seed), "--no-verify",
               "--timeout", "120", "--report", str(report), timeout=300 + 2 * steps)
    if ran.returncode or not report.exists():
        return {"model": name, "codec": codec, "error": (ran.stderr or ran.stdout).strip().splitlines()[-1]}
    losses = json.loads(report.read_text())["losses"]
    tail = losses[-TAIL:]
    return {"model": name, "codec": codec, "codecs": codecs, "steps": len(losses),
            "final_loss": round(sum(tail) / len(tail), 5), "run_s": round(time.perf_counter() - t0, 1),
            "losses": [round(x, 5) for x in losses]}


def _plot(rows: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for r in rows:
            if r["model"] == model and "losses" in r:
                ax.plot(r["losses"], label=r["codec"], linewidth=1)
        ax.set_title(model)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.legend()
    fig.tight_layout()
    fig.savefig(PLOT, dpi=100)


def _pick(arg: str, known: dict, flag: str) -> dict:
    names = [n for n in arg.split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise SystemExit(f"{flag}: expected a comma-separated subset of {', '.join(known)}, found {arg!r}")
    return {n: known[n] for n in names}


def _kept(steps: int, seeds: list[int], models: set[str], codecs: set[str]) -> list[dict]:
    """The recorded rows a partial rerun leaves in place (same steps and seeds only, so every row compares alike)."""
    if not RESULTS.exists():
        return []
    old = json.loads(RESULTS.read_text())
    if old.get("steps") != steps:
        return []
    return [r for r in old["rows"] if not (r["model"] in models and r["codec"] in codecs)
            and r.get("seeds", [0]) == seeds]


def _ordered(rows: list[dict]) -> list[dict]:
    order = {(m, c): i for i, (m, c) in enumerate((m, c) for m in MODELS for c in CODECS)}
    return sorted(rows, key=lambda r: order.get((r["model"], r["codec"]), len(order)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 300, --quick 10)")
    ap.add_argument("--quick", action="store_true", help="gpt-tiny, none and int8, 10 steps, nothing written")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated rows to run (default: all)")
    ap.add_argument("--codecs", default=",".join(CODECS), help="comma-separated codecs to run (default: all)")
    ap.add_argument("--dry-run", action="store_true", help="print the table, write nothing")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds; a row is their mean (default 0)")
    args = ap.parse_args()
    steps = args.steps or (10 if args.quick else 300)
    models = {"gpt-tiny": MODELS["gpt-tiny"]} if args.quick else _pick(args.models, MODELS, "--models")
    codecs = ("none", "int8") if args.quick else tuple(_pick(args.codecs, dict.fromkeys(CODECS), "--codecs"))
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    kept = _kept(steps, seeds, set(models), set(codecs)) if not args.quick else []
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in models.items():
            for codec in codecs:
                row = _run_seeds(name, spec, codec, steps, seeds, Path(tmp))
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
    rows = _ordered(kept + rows)
    base = {r["model"]: r["final_loss"] for r in rows if r["codec"] == "none" and "final_loss" in r}
    base_seeds = {r["model"]: (r["seeds"], r["final_losses"]) for r in rows
                  if r["codec"] == "none" and "final_losses" in r}
    for r in rows:
        if "final_loss" in r and r["model"] in base:
            r["vs_none"] = round(r["final_loss"] / base[r["model"]] - 1, 5)
            paired = base_seeds.get(r["model"])
            if paired and r.get("seeds") == paired[0]:  # the same seed's data and initial weights: less noise
                r["vs_none_per_seed"] = [round(a / b - 1, 5) for a, b in zip(r["final_losses"], paired[1])]
            r["goal"] = r["codec"] == "none" or abs(r["vs_none"]) <= GOAL[r["codec"]]
    head = ("model", "codec", "final_loss", "vs_none", "goal", "run_s")
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(str(r.get(k, r.get("error", "-"))) for k in head) + " |")
    if args.quick or args.dry_run:
        print("nothing written")
        return
    _plot(rows)
    RESULTS.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(),
                                   "steps": steps, "tail": TAIL, "rows": rows}, indent=1) + "\n")
    print(f"wrote {RESULTS} and {PLOT}")


if __name__ == "__main__":
    main()
