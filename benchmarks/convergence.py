"""Convergence under boundary codecs: loss curves of real `stagewise run`s, each codec against the uncompressed run.

Models: the ``gpt-tiny`` preset and a tiny stock Hugging Face Llama (``hf:llama``, 2 layers of 32), each planned
on 2 stages (``stagewise plan MODEL --cluster default --stages 2 --dtype fp32 --global-batch 8 --compress C``)
and run for ``--steps`` steps (default 300, byte text, lr 3e-3, seed 0, no verification, one gloo process per
rank on this CPU) with ``--compress`` none, fp8, int8 and int4. Per run: the final loss (mean of the last 20
steps) and its relative distance to the uncompressed run's; the curves go to ``results/convergence.png``.

Goals (issue 39): int8 and fp8 within 1% of the uncompressed final loss, int4 within 3%.

Run: ``python benchmarks/convergence.py [--steps N]`` (about 5 minutes on 2 cores), prints a table and writes
``benchmarks/results/convergence.json`` and the plot; ``--quick``: gpt-tiny, none and int8, 10 steps, nothing
written.
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


def _run(name: str, spec: str, codec: str, steps: int, work: Path) -> dict:
    plan, report = work / f"{name}-{codec}.json", work / f"{name}-{codec}.report.json"
    made = _cli("plan", spec, "--cluster", "default", "--stages", "2", "--dtype", "fp32", "--global-batch", "8",
                "--seq", "32", "--compress", codec, "--time-limit", "2", "-o", str(plan), timeout=300)
    if made.returncode:
        return {"model": name, "codec": codec, "error": made.stderr.strip().splitlines()[-1]}
    codecs = [st["out_codec"] for st in json.loads(plan.read_text())["stages"][:-1]]
    t0 = time.perf_counter()
    ran = _cli("run", str(plan), "--steps", str(steps), "--lr", "3e-3", "--seed", "0", "--no-verify",
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 300, --quick 10)")
    ap.add_argument("--quick", action="store_true", help="gpt-tiny, none and int8, 10 steps, nothing written")
    args = ap.parse_args()
    steps = args.steps or (10 if args.quick else 300)
    models = {"gpt-tiny": MODELS["gpt-tiny"]} if args.quick else MODELS
    codecs = ("none", "int8") if args.quick else CODECS
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in models.items():
            for codec in codecs:
                row = _run(name, spec, codec, steps, Path(tmp))
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
    base = {r["model"]: r["final_loss"] for r in rows if r["codec"] == "none" and "final_loss" in r}
    for r in rows:
        if "final_loss" in r and r["model"] in base:
            r["vs_none"] = round(r["final_loss"] / base[r["model"]] - 1, 5)
            r["goal"] = r["codec"] == "none" or abs(r["vs_none"]) <= GOAL[r["codec"]]
    head = ("model", "codec", "final_loss", "vs_none", "goal", "run_s")
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(str(r.get(k, r.get("error", "-"))) for k in head) + " |")
    if args.quick:
        print("quick run: nothing written")
        return
    _plot(rows)
    RESULTS.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(),
                                   "steps": steps, "tail": TAIL, "rows": rows}, indent=1) + "\n")
    print(f"wrote {RESULTS} and {PLOT}")


if __name__ == "__main__":
    main()
