"""Untrusted and mixed pools planned whole: what the planner makes of SENTINEL-, HexiScale- and DT-FM-like pools.

Pools (built here, not files):

* ``sentinel``: 4 trusted data-centre hosts of 4 A100-80GB and 40 untrusted volunteer hosts of 4 GPUs each
  (RTX3090, RTX4090, T4, A10G in turn), each volunteer its own trust domain in one of 5 home regions; 1 Gb/s
  (or 200 Mb/s) and 5 ms between hosts; with 0, 1 and 4 trusted CPU verifier hosts. gpt-1.3b.
* ``hexiscale``: 2 hosts of 4 RTX3090 (as the 3080 Ti, which the catalog lacks) + 2 hosts of 4 RTX3090 + 6 hosts
  of 4 RTX4090, all trusted, 5 Gb/s between hosts. llama-7b in bf16.
* ``dtfm-worldwide``: DT-FM's 64 V100s in 8 AWS regions (``benchmarks/clusters/dtfm-worldwide.yaml``). gpt-1.3b.

Per pool: the planner's plan (``planner.api.plan_chain``, which also plans the pool's restrictions and the
baselines and keeps the fastest simulated), its simulated step, the devices it uses (trusted / untrusted), its
verifiers and where they sit, objective vs simulated, the gap of the simulated step to the proven bound,
planning time; the trusted-only plan (the same call on
the trusted hosts alone) and the best of a few forced ``--stages/--replicas`` grids.

Goals (issue 36): untrusted devices used whenever a plan with them simulates faster than the trusted-only
plan; every plan within 5% of its simulation; monotone over each added-host pair (0 -> 1 -> 4 verifier hosts;
trusted hosts alone -> the pool); every pool no slower than its best forced grid.

Run: ``python benchmarks/pools.py [--time-limit S]`` (default 30 s a plan; about 20 minutes on 2 cores), prints a
table and writes ``benchmarks/results/pools.json`` (after each pool, ``complete`` false until the last); ``--quick``: small pools (2 trusted hosts, 6 volunteers, 2 GPUs each) on
gpt-small at sequence 256, 2 s a plan, nothing written.
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

from cost_models.cluster_file import load_cluster, parse_cluster  # noqa: E402
from planner.api import plan_chain  # noqa: E402
from planner.errors import InfeasiblePlanError  # noqa: E402
from planner.model_io import load_chain  # noqa: E402
from planner.simulate import simulate  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "pools.json"
VOLUNTEER_TYPES = ("RTX3090", "RTX4090", "T4", "A10G")
GRIDS = ((2, 4), (4, 4), (4, 8), (8, 4))
QUICK_GRIDS = ((2, 2), (3, 2))
TOLERANCE = 0.05


def sentinel(gbps: float, verifier_hosts: int, *, trusted_hosts: int = 4, volunteers: int = 40,
             per_host: int = 4) -> object:
    hosts = [{"name": f"dc{i}", "region": "dc", "trust": "operator", "trusted": True,
              "devices": [{"type": "A100-80GB", "count": per_host}]} for i in range(trusted_hosts)]
    hosts += [{"name": f"vol{i}", "region": f"home{i % 5}", "trust": f"vol{i}",
               "devices": [{"type": VOLUNTEER_TYPES[i % 4], "count": per_host}]} for i in range(volunteers)]
    hosts += [{"name": f"chk{i}", "region": "dc", "trust": "operator", "trusted": True, "role": "verifier"}
              for i in range(verifier_hosts)]
    return parse_cluster({"name": f"sentinel-{gbps:g}g-v{verifier_hosts}", "hosts": hosts,
                          "links": {"intra_host": {"bandwidth_gbps": 100, "latency_ms": 0.01},
                                    "default": {"bandwidth_gbps": gbps, "latency_ms": 5}}})


def hexiscale() -> object:
    kinds = ("RTX3090",) * 4 + ("RTX4090",) * 6
    hosts = [{"name": f"h{i}", "region": "lab", "trust": "operator", "trusted": True,
              "devices": [{"type": t, "count": 4}]} for i, t in enumerate(kinds)]
    return parse_cluster({"name": "hexiscale-like", "hosts": hosts,
                          "links": {"intra_host": {"bandwidth_gbps": 100, "latency_ms": 0.01},
                                    "default": {"bandwidth_gbps": 5, "latency_ms": 1}}})


def _uses(plan, cluster) -> dict:
    devices = [cluster.device(r.device) for r in plan.ranks if r.stage is not None]
    return {"trusted": sum(d.trusted for d in devices), "untrusted": sum(not d.trusted for d in devices)}


def _row(name: str, chain, cluster, model: str, seq: int, batch: int, dtype: str, time_limit: float,
         **shape) -> dict:
    start = time.perf_counter()
    try:
        plan = plan_chain(chain, cluster, spec=model, seq=seq, global_batch=batch, dtype=dtype,
                          time_limit_s=time_limit, workers=2, **shape)
    except InfeasiblePlanError as exc:
        return {"case": name, "plan": False, "why": str(exc).split(";")[0][:120],
                "plan_s": round(time.perf_counter() - start, 1)}
    plan_s = time.perf_counter() - start
    sim = simulate(plan).step_ms
    verifiers = sorted({(v.device, cluster.device(v.device).cpu_only) for v in plan.verifiers})
    return {"case": name, "plan": True, "simulated_ms": round(sim, 3), "objective_ms": round(plan.report.objective_ms, 3),
            "objective_vs_simulated": round((plan.report.objective_ms - sim) / sim, 4), "stages": plan.num_stages,
            "replicas": [len(plan.stage_ranks(k)) for k in range(plan.num_stages)], **_uses(plan, cluster),
            "verifiers": len(plan.verifiers), "verifier_sites": len(verifiers),
            "on_cpu_hosts": sum(cpu for _, cpu in verifiers), "method": plan.report.method,
            "bound_ms": round(plan.report.bound_ms, 3) if plan.report.bound_ms is not None else None,
            "gap_of_simulated": round(1 - plan.report.bound_ms / sim, 4) if plan.report.bound_ms else None,
            "plan_s": round(plan_s, 1)}


def _pool(name: str, cluster, chain, model: str, seq: int, batch: int, dtype: str, limit: float, grids) -> dict:
    free = _row(name, chain, cluster, model, seq, batch, dtype, limit)
    print(json.dumps(free), flush=True)
    untrusted = {h.name for h in cluster.hosts if not h.trusted}
    trusted = _row(f"{name} trusted only", chain, cluster.without_hosts(untrusted), model, seq, batch, dtype, limit) \
        if untrusted else None
    if trusted:
        print(json.dumps(trusted), flush=True)
    forced = []
    for pp, dp in grids:
        row = _row(f"{name} grid {pp}x{dp}", chain, cluster, model, seq, batch, dtype, limit / 2, stages=pp,
                   replicas=dp)
        print(json.dumps(row), flush=True)
        forced.append(row)
    return {"free": free, "trusted_only": trusted, "grids": forced}


def _checks(pools: dict[str, dict], pairs: list[tuple[str, str]]) -> dict:
    """The issue's goals, each a list of the cases that miss it (empty: met)."""
    def ms(row):
        return row["simulated_ms"] if row and row.get("plan") else float("inf")
    out = {"not_within_5pct": [], "untrusted_left_idle": [], "slower_than_a_grid": [], "not_monotone": []}
    for name, pool in pools.items():
        rows = [pool["free"], pool["trusted_only"], *pool["grids"]]
        out["not_within_5pct"] += [r["case"] for r in rows if r and r.get("plan")
                                   and abs(r["objective_vs_simulated"]) > TOLERANCE]
        free = pool["free"]
        with_untrusted = [r for r in pool["grids"] if r.get("plan") and r["untrusted"]]
        if free.get("plan") and not free["untrusted"] and any(ms(r) < ms(free) for r in with_untrusted):
            out["untrusted_left_idle"].append(name)
        if any(ms(r) < ms(free) * (1 - 1e-9) for r in pool["grids"]):
            out["slower_than_a_grid"].append(name)
        if pool["trusted_only"] and ms(pool["trusted_only"]) < ms(free) * (1 - 1e-9):
            out["not_monotone"].append(f"{name}: trusted hosts alone plan faster")
    for small, big in pairs:
        if ms(pools[small]["free"]) < ms(pools[big]["free"]) * (1 - 1e-9):
            out["not_monotone"].append(f"{small} -> {big}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=None, help="per plan (s; default 30, --quick 2)")
    ap.add_argument("--quick", action="store_true", help="small pools on gpt-small, nothing written")
    args = ap.parse_args()
    limit = args.time_limit or (2.0 if args.quick else 30.0)
    pools: dict[str, dict] = {}
    pairs: list[tuple[str, str]] = []
    if args.quick:
        _, chain = load_chain("gpt-small", batch=1, seq=256)
        for hosts in (0, 1):
            name = f"sentinel-small-v{hosts}"
            pools[name] = _pool(name, sentinel(1.0, hosts, trusted_hosts=2, volunteers=6, per_host=2), chain,
                                "gpt-small", 256, 16, "auto", limit, QUICK_GRIDS)
        pairs.append(("sentinel-small-v0", "sentinel-small-v1"))
    else:
        _, chain = load_chain("gpt-1.3b", batch=1, seq=1024)
        for gbps in (1.0, 0.2):
            names = []
            for hosts in (0, 1, 4):
                name = f"sentinel-{gbps:g}g-v{hosts}"
                pools[name] = _pool(name, sentinel(gbps, hosts), chain, "gpt-1.3b", 1024, 64, "auto", limit, GRIDS)
                names.append(name)
                _write(pools, _checks(pools, pairs + list(zip(names, names[1:]))), limit, done=False)
            pairs += list(zip(names, names[1:]))
        pools["dtfm-worldwide"] = _pool("dtfm-worldwide", load_cluster(ROOT / "benchmarks" / "clusters" /
                                                                       "dtfm-worldwide.yaml"),
                                        chain, "gpt-1.3b", 1024, 64, "auto", limit, GRIDS)
        _write(pools, _checks(pools, pairs), limit, done=False)
        _, llama = load_chain("llama-7b", batch=1, seq=2048)
        pools["hexiscale"] = _pool("hexiscale", hexiscale(), llama, "llama-7b", 2048, 64, "bf16", limit,
                                   ((4, 10), (8, 5), (10, 4), (20, 2)))
    checks = _checks(pools, pairs)
    if not args.quick:
        _write(pools, checks, limit, done=True)
    head = ("case", "simulated_ms", "objective_vs_simulated", "gap_of_simulated", "trusted", "untrusted", "stages",
            "verifiers", "on_cpu_hosts", "method", "plan_s")
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for pool in pools.values():
        for row in [pool["free"], pool["trusted_only"], *pool["grids"]]:
            if row:
                print("| " + " | ".join(str(row.get(k, "-")) if row.get("plan") or k == "case"
                                        else "no plan" for k in head) + " |")
    print("\ngoals (cases that miss each):", json.dumps(checks))
    print("quick run: nothing written" if args.quick else f"wrote {RESULTS}")


def _write(pools: dict[str, dict], checks: dict, limit: float, *, done: bool) -> None:
    """The results so far (``complete``: False while pools are left: a run stopped early keeps what it did)."""
    RESULTS.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(),
                                   "time_limit_s": limit, "complete": done, "pools": pools,
                                   "goals_missed": checks}, indent=1) + "\n")


if __name__ == "__main__":
    main()
