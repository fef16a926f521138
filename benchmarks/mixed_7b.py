"""A 7B model on a mixed consumer pool: what precision and recomputation make possible, and at what step.

The ``llama-7b`` preset (Llama-2-7B's shape, 6.74B parameters) traced on the meta device at
sequence 2048 and 4096, microbatch 1, global batch 64, planned on ``benchmarks/clusters/consumer-40.yaml``
(16 RTX 3090 and 24 RTX 4090, 24 GB each; four untrusted volunteer rigs behind 1 Gb/s) in fp32 and in
bf16, with recomputation off (``never``) and chosen by the solver (``auto``). Each row runs the whole
planning path (``planner.api.plan_chain``) and reports: whether a plan exists, its objective and
simulated step and their difference, the bound and gap, the stages and how many recompute, and the
most any device uses of its usable memory (simulated peak / usable, must stay <= 100%).

Goal (issue 22): the 7B model plans in bf16 with recomputation where needed on this pool, memory
under capacity on every device, objective within 5% of the simulated step.

Run: ``python benchmarks/mixed_7b.py [--time-limit S] [--seqs 2048,4096]``; prints a table and writes
``benchmarks/results/mixed_7b.json`` (``--quick``: the same path on ``llama-tiny`` at sequence 128, two of the
four cases, 1 s per plan, nothing written).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cost_models import memory
from cost_models.cluster_file import load_cluster
from planner.api import plan_chain
from planner.errors import InfeasiblePlanError
from planner.model_io import load_chain
from planner.simulate import simulate

CLUSTER = ROOT / "benchmarks" / "clusters" / "consumer-40.yaml"
RESULTS = ROOT / "benchmarks" / "results" / "mixed_7b.json"
GLOBAL_BATCH = 64
CASES = (("fp32", "never"), ("fp32", "auto"), ("bf16", "never"), ("bf16", "auto"))
MODEL = "llama-7b"
# a smoke run: seconds, not minutes (fp32 without and bf16 with recompute: both settings of each)
QUICK = {"model": "llama-tiny", "seqs": "128", "time_limit": 1.0, "cases": (("fp32", "never"), ("bf16", "auto"))}


def _row(chain, cluster, seq: int, dtype: str, recompute: str, time_limit_s: float, model: str = MODEL) -> dict:
    start = time.perf_counter()
    row = {"seq": seq, "dtype": dtype, "recompute": recompute}
    try:
        plan = plan_chain(chain, cluster, spec=model, seq=seq, global_batch=GLOBAL_BATCH, microbatch_size=1,
                          time_limit_s=time_limit_s, dtype=dtype, recompute=recompute)
    except InfeasiblePlanError as exc:
        return {**row, "plan": None, "why": str(exc).split(";")[0], "wall_s": round(time.perf_counter() - start, 1)}
    sim = simulate(plan)
    usable = [memory.usable_memory_bytes(cluster.device(r.device).spec) for r in plan.ranks]
    r = plan.report
    return {**row, "plan": True, "wall_s": round(time.perf_counter() - start, 1),
            "objective_ms": round(r.objective_ms, 1), "simulated_ms": round(sim.step_ms, 1),
            "objective_vs_simulated": round((r.objective_ms - sim.step_ms) / sim.step_ms, 4),
            "bound_ms": round(r.bound_ms, 1) if r.bound_ms is not None else None,
            "gap_of_simulated": round(1 - r.bound_ms / sim.step_ms, 4) if r.bound_ms else None,
            "stages": plan.num_stages, "ranks": plan.num_ranks,
            "replicas": [len(plan.stage_ranks(k)) for k in range(plan.num_stages)],
            "recompute_stages": sum(st.recompute for st in plan.stages),
            "max_memory_share": round(max(m / u for m, u in zip(sim.peak_mem_bytes, usable) if u > 0), 3),
            "tokens_per_s": round(GLOBAL_BATCH * seq / (sim.step_ms / 1e3))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=None, help=f"per plan (s; default 30, --quick: "
                                                                   f"{QUICK['time_limit']:g})")
    ap.add_argument("--seqs", default=None, help=f"default 2048,4096 (--quick: {QUICK['seqs']})")
    ap.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK['model']} instead of {MODEL}, "
                    "nothing written")
    args = ap.parse_args()
    model = QUICK["model"] if args.quick else MODEL
    seqs = args.seqs or (QUICK["seqs"] if args.quick else "2048,4096")
    time_limit = args.time_limit or (QUICK["time_limit"] if args.quick else 30.0)
    cluster = load_cluster(CLUSTER)
    rows = []
    for seq in (int(s) for s in seqs.split(",")):
        t0 = time.perf_counter()
        _, chain = load_chain(model, batch=1, seq=seq)
        trace_s = time.perf_counter() - t0
        for dtype, recompute in QUICK["cases"] if args.quick else CASES:
            row = {**_row(chain, cluster, seq, dtype, recompute, time_limit, model), "trace_s": round(trace_s, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    head = ("seq", "dtype", "recompute", "plan", "stages", "recompute_stages", "objective_ms", "simulated_ms",
            "objective_vs_simulated", "gap_of_simulated", "max_memory_share", "tokens_per_s", "wall_s")
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for row in rows:
        cells = [("yes" if row["plan"] else "no: " + row["why"][:48]) if k == "plan" else str(row.get(k, "-"))
                 for k in head]
        print("| " + " | ".join(cells) + " |")
    if args.quick:
        print("quick run: nothing written")
        return
    RESULTS.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(),
                                   "time_limit_s": time_limit, "global_batch": GLOBAL_BATCH,
                                   "cluster": CLUSTER.name, "rows": rows}, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
