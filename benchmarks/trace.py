"""Tracing cost: time and peak memory to trace big presets on the meta device, and ONNX import time.

Cases, each in a fresh subprocess so peak RSS (``resource.getrusage``, the
process's high-water mark) belongs to that case alone:

- ``llama-7b`` (batch 1, seq 4096) and ``gpt-1.3b`` (batch 1, seq 2048): build on
  the meta device, ``planner.trace.trace`` (torch.export + per-op FLOPs), then
  ``coarsen``. Goal for llama-7b: traced in <= 30 s using <= 2 GB.
- Hugging Face models as users build them (``hf:`` specs, ``transformers``
  installed): GPT-2 124M's default config (batch 1, seq 1024) and a Llama-2-7B
  config (batch 1, seq 4096), same steps. Goal for the Llama: <= 30 s, <= 2 GB.
- ``gpt-small`` ONNX import: export once with real CPU weights (seq 128, not
  timed), then time ``planner.onnx_import.load_onnx`` + ``coarsen`` in a fresh
  process (weights stay on disk: the graph is read without external data).

Run: ``python benchmarks/trace.py [--quick] [--only presets|hf|onnx ...]``
(``--quick``: a smoke run, every group on a tiny model, nothing written; ``--only`` runs
those groups and keeps the other cases' last figures, each case saying when it
was measured; ``--only presets hf`` skips the ONNX case, whose export writes ~650 MB).
Prints a table and writes ``benchmarks/results/trace.json``.
Times are wall-clock and noisy on a shared machine; the memory figures are not.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "trace.json"
HF_LLAMA_7B = ("hf:llama?hidden_size=4096,intermediate_size=11008,num_hidden_layers=32,num_attention_heads=32,"
               "num_key_value_heads=32,vocab_size=32000,max_position_embeddings=4096")
GOALS = {"trace llama-7b": {"max_s": 30.0, "max_rss_gb": 2.0},
         "trace hf llama-7b": {"max_s": 30.0, "max_rss_gb": 2.0}}
# (case name, group, spec, batch, seq)
TRACE_CASES = (("trace llama-7b", "presets", "llama-7b", 1, 4096), ("trace gpt-1.3b", "presets", "gpt-1.3b", 1, 2048),
               ("trace hf gpt2-124m", "hf", "hf:gpt2", 1, 1024),
               ("trace hf llama-7b", "hf", HF_LLAMA_7B, 1, 4096))
ONNX_CASE = ("gpt-small", 1, 128)
# --quick: the same steps on tiny models (seconds each)
QUICK_TRACE_CASES = (("trace gpt-tiny", "presets", "gpt-tiny", 1, 32),
                     ("trace hf gpt2 1 layer", "hf", "hf:gpt2?n_layer=1,n_embd=64,n_head=2,vocab_size=256", 1, 32))
QUICK_ONNX_CASE = ("gpt-tiny", 1, 32)
GROUPS = ("presets", "hf", "onnx")


def _peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux reports KiB


def child_trace(spec: str, batch: int, seq: int) -> dict:
    """Runs in the subprocess: build on meta, trace, coarsen; report times and peak RSS."""
    import torch

    torch.set_num_threads(1)
    from models.registry import build_model
    from planner.coarsen import coarsen
    from planner.trace import trace

    rss_before = _peak_rss_gb()
    t0 = time.perf_counter()
    bundle = build_model(spec, batch=batch, seq=seq, device="meta")
    t1 = time.perf_counter()
    graph = trace(bundle.module, bundle.example_inputs, name=spec)
    t2 = time.perf_counter()
    chain = coarsen(graph)
    t3 = time.perf_counter()
    return {"build_s": t1 - t0, "trace_s": t2 - t1, "coarsen_s": t3 - t2, "total_s": t3 - t0,
            "peak_rss_gb": _peak_rss_gb(), "rss_after_imports_gb": rss_before, "nodes": len(graph),
            "blocks": len(chain), "params": graph.param_count, "fwd_tflops": graph.fwd_flops / 1e12,
            "bwd_over_fwd": graph.bwd_flops / graph.fwd_flops}


def child_onnx(path: str) -> dict:
    from planner.coarsen import coarsen
    from planner.onnx_import import load_onnx

    rss_before = _peak_rss_gb()
    t0 = time.perf_counter()
    graph = load_onnx(path)
    t1 = time.perf_counter()
    chain = coarsen(graph)
    t2 = time.perf_counter()
    return {"import_s": t1 - t0, "coarsen_s": t2 - t1, "total_s": t2 - t0, "peak_rss_gb": _peak_rss_gb(),
            "rss_after_imports_gb": rss_before, "nodes": len(graph), "blocks": len(chain),
            "params": graph.param_count, "fwd_tflops": graph.fwd_flops / 1e12}


def export_gpt_small(folder: Path, case: tuple[str, int, int] = ONNX_CASE) -> Path:
    import torch

    torch.set_num_threads(1)
    from models.registry import build_model
    from planner.onnx_import import export_onnx

    spec, batch, seq = case
    bundle = build_model(spec, batch=batch, seq=seq, device="cpu")
    return export_onnx(bundle.module, bundle.example_inputs, folder / f"{spec}.onnx")


def _run_child(*args: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"case {args} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: every group on a tiny model, nothing "
                        "written")
    parser.add_argument("--only", nargs="+", choices=GROUPS, help="run these case groups; keep the others' figures")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.child:
        kind, *rest = args.child
        result = child_trace(rest[0], int(rest[1]), int(rest[2])) if kind == "trace" else child_onnx(rest[0])
        print(json.dumps(result))
        return 0

    groups = set(args.only or GROUPS)
    cases: dict[str, dict] = _kept_cases(groups) if args.only and not args.quick else {}
    now = time.strftime("%Y-%m-%dT%H:%M:%S")
    for name, group, spec, batch, seq in QUICK_TRACE_CASES if args.quick else TRACE_CASES:
        if group in groups:
            cases[name] = {"spec": spec, "batch": batch, "seq": seq, "when": now,
                           **_run_child("trace", spec, str(batch), str(seq))}
    if "onnx" in groups:
        onnx_case = QUICK_ONNX_CASE if args.quick else ONNX_CASE
        # gpt-small's export (~650 MB) goes beside the repository, not into a small /tmp
        with tempfile.TemporaryDirectory(dir=None if args.quick else ROOT / "benchmarks") as tmp:
            t0 = time.perf_counter()
            path = export_gpt_small(Path(tmp), onnx_case)
            export_s = time.perf_counter() - t0
            spec, batch, seq = onnx_case
            cases[f"onnx import {spec}"] = {"spec": spec, "batch": batch, "seq": seq, "export_s": export_s,
                                            "when": now, **_run_child("onnx", str(path))}
    goals = {}
    for name, goal in GOALS.items():
        case = cases.get(name)
        if case is not None:
            goals[name] = {**goal, "trace_s": case["total_s"], "peak_rss_gb": case["peak_rss_gb"],
                           "met": case["total_s"] <= goal["max_s"] and case["peak_rss_gb"] <= goal["max_rss_gb"]}
    _print(cases, goals)
    if args.quick:
        print("quick run: nothing written")
        return 0
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": "trace", "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
               "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                           "note": "wall-clock on a shared machine: times are noisy, RSS is not"},
               "cases": cases, "goals": goals}
    RESULTS.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0 if all(g["met"] for g in goals.values()) else 1


def _kept_cases(groups: set[str]) -> dict[str, dict]:
    """The last figures of the cases not run now (``--only``), from the results file."""
    if not RESULTS.is_file():
        return {}
    previous = json.loads(RESULTS.read_text())
    group_of = {name: group for name, group, *_ in TRACE_CASES}
    kept = {}
    for name, case in previous.get("cases", {}).items():
        if group_of.get(name, "onnx" if name.startswith("onnx") else "presets") not in groups:
            kept[name] = {**case, "when": case.get("when", previous.get("when"))}
    return kept


def _print(cases: dict, goals: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="tracing cost (fresh process per case)")
    for col in ("case", "shape", "nodes", "blocks", "params", "time s", "of which trace/import s", "peak RSS GB"):
        table.add_column(col, justify="left" if col == "case" else "right")
    for name, c in cases.items():
        inner = c.get("trace_s", c.get("import_s"))
        table.add_row(name, f"{c['batch']}x{c['seq']}", str(c["nodes"]), str(c["blocks"]), f"{c['params'] / 1e9:.2f}B",
                      f"{c['total_s']:.1f}", f"{inner:.1f}", f"{c['peak_rss_gb']:.2f}")
    console = Console(width=120)
    console.print(table)
    for name, g in goals.items():
        status = "met" if g["met"] else "NOT met"
        console.print(f"goal {name}: <= {g['max_s']:.0f} s and <= {g['max_rss_gb']:.0f} GB -> "
                      f"{g['trace_s']:.1f} s, {g['peak_rss_gb']:.2f} GB: {status}")


if __name__ == "__main__":
    sys.exit(main())
