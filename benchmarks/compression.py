"""Compression on slow links: what boundary codecs buy the planner on wide-area pools, priced and simulated.

Pools: ``swarm-like`` (one trusted host of 2 A100-80GB and 16 untrusted single-T4 volunteers in 4 home regions,
200 Mb/s and 20 ms between hosts, verification on) and DT-FM's ``worldwide`` case (64 V100s in 8 AWS regions,
``benchmarks/clusters/dtfm-worldwide.yaml``), gpt-1.3b at sequence 2048, global batch 64. Each pool is planned
(``planner.api.plan_chain``) with ``--compress`` none, auto, fp8, int8 and int4; per row: the simulated step,
its speed-up over none, objective vs simulated, the stages and their codecs, the devices used. Two variants of
the SWARM-like pool, none and auto only: verification off (``swarm-like-unverified``) and SWARM's larger batch,
256 (``swarm-like-b256``).

On the SWARM-like pool trusted end stages leave a uniform pp x dp grid one replica per stage (2 trusted
devices), so only grids wider in the middle than at the ends (``planner.solver.search.grid.tapered``) put the
volunteers to work: the A100s at the ends, T4 replicas between, fp8 boundaries and PowerSGD all-reduces. Fixed
codecs (fp8, int8, int4) keep exact all-reduces, which over 200 Mb/s cost more than the T4s add: those plans stay
on the A100s.

Goals (issue 39): ``auto`` >= 1.3x faster than ``none`` in simulation on both pools; objective within 5% of
simulated everywhere.

Run: ``python benchmarks/compression.py [--time-limit S]`` (default 30 s a plan), prints a table and writes
``benchmarks/results/compression.json``; ``--quick``: gpt-small at sequence 256 on a 6-volunteer pool, choices
none, auto and int8, 2 s a plan, nothing written.
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

from cost_models.cluster_file import load_cluster, parse_cluster
from cost_models.codecs import COMPRESS_CHOICES
from planner.api import plan_chain
from planner.errors import InfeasiblePlanError
from planner.model_io import load_chain
from planner.simulate import simulate
from planner.solver.policy import VerificationPolicy

RESULTS = ROOT / "benchmarks" / "results" / "compression.json"
GOAL_SPEEDUP = 1.3
QUICK_CHOICES = ("none", "auto", "int8")  # --quick: the baseline, the planner's choice and one fixed codec
GOAL_POOLS = ("swarm-like", "dtfm-worldwide")  # the two (--quick's gpt-small fits the A100s: a smoke test)
TOLERANCE = 0.05


def swarm_like(volunteers: int = 16) -> object:
    hosts = [{"name": "dc", "region": "dc", "trust": "operator", "trusted": True,
              "devices": [{"type": "A100-80GB", "count": 2}]}]
    hosts += [{"name": f"t{i}", "region": f"home{i % 4}", "trust": f"t{i}", "devices": [{"type": "T4"}]}
              for i in range(volunteers)]
    return parse_cluster({"name": "swarm-like", "hosts": hosts,
                          "links": {"intra_host": {"bandwidth_gbps": 100, "latency_ms": 0.01},
                                    "default": {"bandwidth_gbps": 0.2, "latency_ms": 20}}})


def _row(pool: str, cluster, chain, model: str, seq: int, batch: int, compress: str, limit: float,
         policy: VerificationPolicy | None = None) -> dict:
    start = time.perf_counter()
    try:
        plan = plan_chain(chain, cluster, spec=model, seq=seq, global_batch=batch, time_limit_s=limit, workers=2,
                          compress=compress, policy=policy)
    except InfeasiblePlanError as exc:
        return {"pool": pool, "compress": compress, "plan": False, "why": str(exc).split(";")[0][:120]}
    sim = simulate(plan).step_ms
    used = [cluster.device(r.device) for r in plan.ranks if r.stage is not None]
    return {"pool": pool, "compress": compress, "plan": True, "global_batch": batch,
            "simulated_ms": round(sim, 1),
            "objective_vs_simulated": round((plan.report.objective_ms - sim) / sim, 4),
            "stages": plan.num_stages, "replicas": [len(plan.stage_ranks(st.index)) for st in plan.stages],
            "codecs": [st.out_codec for st in plan.stages[:-1]],
            "allreduce": [st.allreduce_codec for st in plan.stages if len(plan.stage_ranks(st.index)) > 1],
            "trusted": sum(d.trusted for d in used), "untrusted": sum(not d.trusted for d in used),
            "plan_s": round(time.perf_counter() - start, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=None, help="per plan (s; default 30, --quick 2)")
    ap.add_argument("--quick", action="store_true", help="gpt-small on a small pool, nothing written")
    args = ap.parse_args()
    limit = args.time_limit or (2.0 if args.quick else 30.0)
    if args.quick:
        model, seq = "gpt-small", 256
        cases = [("swarm-small", swarm_like(6), 16, None, QUICK_CHOICES)]
    else:
        model, seq = "gpt-1.3b", 2048
        cases = [("swarm-like", swarm_like(), 64, None, COMPRESS_CHOICES),
                 ("dtfm-worldwide", load_cluster(ROOT / "benchmarks" / "clusters" / "dtfm-worldwide.yaml"), 64, None,
                  COMPRESS_CHOICES),
                 ("swarm-like-unverified", swarm_like(), 64, VerificationPolicy(enabled=False), ("none", "auto")),
                 ("swarm-like-b256", swarm_like(), 256, None, ("none", "auto"))]
    _, chain = load_chain(model, batch=1, seq=seq)
    rows = []
    for name, cluster, batch, policy, choices in cases:
        for compress in choices:
            row = _row(name, cluster, chain, model, seq, batch, compress, limit, policy)
            rows.append(row)
            print(json.dumps(row), flush=True)
    base = {r["pool"]: r["simulated_ms"] for r in rows if r["compress"] == "none" and r["plan"]}
    for r in rows:
        if r["plan"] and r["pool"] in base:
            r["speedup"] = round(base[r["pool"]] / r["simulated_ms"], 3)
    head = ("pool", "compress", "global_batch", "simulated_ms", "speedup", "objective_vs_simulated", "stages",
            "replicas", "trusted", "untrusted", "codecs", "allreduce")
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(str(r.get(k, "-")) for k in head) + " |")
    missed = {"auto_below_1.3x": [r["pool"] for r in rows if r["compress"] == "auto" and r["pool"] in GOAL_POOLS
                                  and r.get("speedup", 0) < GOAL_SPEEDUP],
              "not_within_5pct": [f"{r['pool']} {r['compress']}" for r in rows
                                  if r["plan"] and abs(r["objective_vs_simulated"]) > TOLERANCE]}
    print("\ngoals (cases that miss each):", json.dumps(missed))
    if args.quick:
        print("quick run: nothing written")
        return
    RESULTS.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(),
                                   "time_limit_s": limit, "model": model, "seq": seq, "rows": rows,
                                   "goals_missed": missed}, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
