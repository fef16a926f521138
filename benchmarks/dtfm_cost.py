"""DT-FM's communication cost of a layout, re-implemented from the paper, checked against DT-FM's code.

Source: Yuan et al., "Decentralized Training of Foundation Models in
Heterogeneous Environments" (NeurIPS 2022), Sec. 3 cost model; code DS3Lab/DT-FM
``scheduler/heuristic_evolutionary_solver/scheduler.py`` at commit
``cda948f02111ad194ce108d4c65b85258afd0c19`` (read for the model figures; no code copied).

A layout is ``groups``: one list of GPU indices per pipeline stage, the stage's
data-parallel replicas (8 x 8 for the 64-GPU cases). With delay ``a`` (s) and
bandwidth ``b`` (Gb/s) between two GPUs,

* data parallel: ``max`` over groups and members ``d`` of
  ``sum_{d' != d} 2 (a[d,d'] + G / (k b[d,d']))``, ``G`` the stage's fp32
  gradient in Gb and ``k`` the group size (scatter-reduce then all-gather);
* pipeline parallel: two groups are joined by the perfect matching of their
  GPUs whose slowest edge ``a + A / b`` is fastest (bottleneck matching; ``A`` the
  fp16 activations of one replica's batch in Gb), and the stage order is the
  shortest Hamiltonian path over those pair costs (exact DP over subsets);
* total = data parallel + 2 x pipeline parallel (activations forward, gradients back).

Figures as DT-FM's code has them for GPT-3 XL (1.3B): 24 layers, hidden 2048,
sequences of 2048 tokens, global batch 1M tokens (488.3 sequences, 61.0 per
replica at 8-way data parallel). Two quirks kept for equal numbers: activations
are counted as ``2024 * 2048`` values per sequence (``activation_seq_len=2024``,
sic) and in GiB (2**30 bytes), gradients as 1.3 "GB" per 1.3B fp32 parameters
(1e9 bytes); both then times 8 as Gb over Gb/s links.

Run: ``python benchmarks/dtfm_cost.py --dtfm-src DIR [--python PY]``, ``DIR``
holding DT-FM's ``config.py`` and ``scheduler.py`` (its ``scheduler/
heuristic_evolutionary_solver`` folder; needs numpy and scipy in ``PY``). Per
case it runs DT-FM's GCMA search (seeded: their code assigns ``random.seed = i``
instead of calling it), prices its best layout and a few random layouts with
their code and with ``dtfm_cost`` on matrices read back from
``benchmarks/clusters/dtfm-<case>.yaml``, and writes ``benchmarks/results/dtfm_scheduler.json``.

``--quick`` writes nothing: with ``--dtfm-src``, a tiny search (2 trails of a population of 4) priced both
ways; without it, ``dtfm_cost`` of the layouts recorded in the results file against the cost DT-FM's code gave
them there (the re-implementation checked without DT-FM's code at hand).
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import dtfm_cases  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "dtfm_scheduler.json"
SOURCE_COMMIT = dtfm_cases.SOURCE[2]
QUICK_SEARCH = {"trails": 2, "population": 4, "random_layouts": 1}
MAX_REL_DIFF = 1e-9  # --quick: ours and theirs agree to rounding


def _has_perfect_matching(ok: np.ndarray) -> bool:
    """Whether the bipartite graph ``ok[i, j]`` (rows to columns) matches every row (augmenting paths)."""
    n = ok.shape[0]
    owner = [-1] * n  # column -> row

    def augment(row: int, seen: list[bool]) -> bool:
        for col in np.flatnonzero(ok[row]):
            if not seen[col]:
                seen[col] = True
                if owner[col] < 0 or augment(owner[col], seen):
                    owner[col] = row
                    return True
        return False

    return all(augment(r, [False] * n) for r in range(n))


def bottleneck_matching(cost: np.ndarray) -> float:
    """Smallest ``t`` such that the edges of cost <= t match every row: binary search over the values."""
    values = np.unique(cost)
    lo, hi = 0, len(values) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _has_perfect_matching(cost <= values[mid]):
            hi = mid
        else:
            lo = mid + 1
    return float(values[lo])


def shortest_path_order(pair_cost: np.ndarray) -> tuple[float, list[int]]:
    """Cheapest order visiting every stage once (open path, any start): Held-Karp over subsets."""
    n = pair_cost.shape[0]
    best = np.full((1 << n, n), math.inf)
    back = np.full((1 << n, n), -1, dtype=int)
    for s in range(n):
        best[1 << s, s] = 0.0
    for mask in range(1, 1 << n):
        for last in range(n):
            here = best[mask, last]
            if here == math.inf:
                continue
            for nxt in range(n):
                if not mask >> nxt & 1 and here + pair_cost[last, nxt] < best[mask | 1 << nxt, nxt]:
                    best[mask | 1 << nxt, nxt] = here + pair_cost[last, nxt]
                    back[mask | 1 << nxt, nxt] = last
    full = (1 << n) - 1
    last = int(np.argmin(best[full]))
    total, order, mask = float(best[full, last]), [], full
    while last >= 0:
        order.append(last)
        mask, last = mask ^ (1 << last), int(back[mask, last])
    return total, order[::-1]


def dtfm_cost_parts(groups: Sequence[Sequence[int]], delay_ms: np.ndarray, bandwidth_gbps: np.ndarray, *,
                    params: float = 1.3e9, layers: int = 24, hidden: int = 2048, seq_len: int = 2048,
                    batch_tokens: float = 1e6, activation_seq_len: int = 2024) -> dict:
    """``dtfm_cost``'s terms: ``data_parallel_s``, ``pipeline_parallel_s`` (one way) and the stage ``order``."""
    stages, k = len(groups), len(groups[0])
    assert all(len(g) == k for g in groups), "every stage needs the same number of replicas"
    lat, bw = np.asarray(delay_ms, float) / 1e3, np.asarray(bandwidth_gbps, float)
    grad_gb = params / 1e9 * 4 * (layers / stages) / layers * 8          # fp32 gradient of one stage
    seqs = batch_tokens / seq_len / k                                    # one replica's batch
    act_gb = activation_seq_len * hidden * 2 * seqs / 2**30 * 8         # fp16 activations of that batch
    dp = 0.0
    for g in groups:
        ix = np.ix_(g, g)
        per_peer = 2 * (lat[ix] + grad_gb / (bw[ix] * k))
        np.fill_diagonal(per_peer, 0.0)
        dp = max(dp, float(per_peer.sum(axis=1).max()))
    pair = np.zeros((stages, stages))
    for i in range(stages):
        for j in range(i + 1, stages):
            ix = np.ix_(groups[i], groups[j])
            pair[i, j] = pair[j, i] = bottleneck_matching(lat[ix] + act_gb / bw[ix])
    pp, order = shortest_path_order(pair)
    return {"data_parallel_s": dp, "pipeline_parallel_s": pp, "order": order}


def dtfm_cost(groups: Sequence[Sequence[int]], delay_ms: np.ndarray, bandwidth_gbps: np.ndarray, *,
              params: float = 1.3e9, layers: int = 24, hidden: int = 2048, seq_len: int = 2048,
              batch_tokens: float = 1e6, activation_seq_len: int = 2024) -> float:
    """DT-FM's communication cost (s) of ``groups`` (one list of GPU indices per stage): DP + 2 x PP."""
    parts = dtfm_cost_parts(groups, delay_ms, bandwidth_gbps, params=params, layers=layers, hidden=hidden,
                            seq_len=seq_len, batch_tokens=batch_tokens, activation_seq_len=activation_seq_len)
    return parts["data_parallel_s"] + 2 * parts["pipeline_parallel_s"]


def matrices_from_cluster(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """(delay ms, bandwidth Gb/s) between every pair of a cluster file's stage devices, in file order."""
    from cost_models import load_cluster

    cluster = load_cluster(path)
    ids = [d.id for d in cluster.stage_devices]
    delay, bw = np.empty((len(ids), len(ids))), np.empty((len(ids), len(ids)))
    for i, a in enumerate(ids):
        for j, b in enumerate(ids):
            link = cluster.link(a, b)
            delay[i, j], bw[i, j] = link.latency_ms, link.bandwidth_gbps
    return delay, bw


# Run inside DT-FM's folder with a Python that has scipy; reads a JSON spec on stdin, prints JSON.
_DRIVER = r'''
import contextlib, json, random, sys, time
import numpy as np
spec = json.load(sys.stdin)
sys.path.insert(0, spec["src"])
with contextlib.redirect_stdout(sys.stderr):
    import config, scheduler as s
    make = dict(zip(["datacenter", "spot", "universities", "regional", "worldwide"],
                    [config.simulate_0_datacenter, config.simulate_1_datacenter_spot_gpu,
                     config.simulate_2_multi_universities, config.simulate_3_regional_geo_distributed,
                     config.simulate_4_worldwide_geo_distributed]))
    py_seed, np_seed = random.seed, np.random.seed  # GCMA rebinds both names to ints
    def price(groups):
        pp, order, _ = s.compute_pipeline_parallel_cost(groups)
        return s.compute_data_parallel_cost(candidate_partition=groups) + 2 * pp, [int(x) for x in order]
    out = {}
    for case in spec["cases"]:
        s.peer_delay, s.peer_bandwidth, _ = make[case]()
        py_seed(spec["seed"]); np_seed(spec["seed"])
        t0 = time.perf_counter()
        pop, scores, _ = s.GCMA(nodes=list(range(s.num_devices)), population_size=spec["population"],
                                trails=spec["trails"], mode="default")
        flat = pop[int(np.argmin(scores))]
        groups = [[int(x) for x in flat[i:i + s.partition_size]] for i in range(0, s.num_devices, s.partition_size)]
        cost, order = price(groups)
        wall = time.perf_counter() - t0
        random.seed, np.random.seed = py_seed, np_seed
        out[case] = {"groups": groups, "cost": cost, "gcma_min_score": float(min(scores)), "order": order,
                     "wall_s": wall, "candidates": len(scores),
                     "random": [price(g)[0] for g in spec["random_layouts"][case]]}
print(json.dumps(out))
'''


def recorded_check() -> int:
    """``dtfm_cost`` of every layout the results file records against the cost DT-FM's code gave it there."""
    recorded = json.loads(RESULTS.read_text())["cases"]
    worst = 0.0
    for case in dtfm_cases.CASES:
        delay, bw = matrices_from_cluster(ROOT / "benchmarks" / "clusters" / f"dtfm-{case}.yaml")
        rows = [(recorded[case]["best_groups"], recorded[case]["their_cost_s"])]
        rows += [(r["groups"], r["their_cost_s"]) for r in recorded[case]["random_layouts"]]
        errs = [abs(dtfm_cost(g, delay, bw) / theirs - 1) for g, theirs in rows]
        worst = max(worst, *errs)
        print(f"{case:13s} {len(rows)} recorded layouts: max rel diff {max(errs):.1e}")
    print(f"quick run (recorded layouts, no DT-FM source): max relative difference {worst:.1e}; nothing written")
    return 0 if worst <= MAX_REL_DIFF else 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtfm-src", help="DT-FM's scheduler/heuristic_evolutionary_solver folder (required "
                                       "unless --quick)")
    ap.add_argument("--python", default=sys.executable, help="a Python with numpy and scipy for DT-FM's code")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trails", type=int, default=None, help=f"default 200 (--quick: {QUICK_SEARCH['trails']})")
    ap.add_argument("--population", type=int, default=None,
                    help=f"default 100 (--quick: {QUICK_SEARCH['population']})")
    ap.add_argument("--random-layouts", type=int, default=None,
                    help=f"default 2 (--quick: {QUICK_SEARCH['random_layouts']})")
    ap.add_argument("--quick", action="store_true", help="a smoke run writing nothing (see the module's doc)")
    args = ap.parse_args()
    if args.quick and not args.dtfm_src:
        sys.exit(recorded_check())
    if not args.dtfm_src:
        ap.error("--dtfm-src is required (or --quick)")
    defaults = QUICK_SEARCH if args.quick else {"trails": 200, "population": 100, "random_layouts": 2}
    args.trails = args.trails or defaults["trails"]
    args.population = args.population or defaults["population"]
    args.random_layouts = args.random_layouts or defaults["random_layouts"]
    rng = np.random.default_rng(args.seed)
    layouts = {c: [rng.permutation(64).reshape(8, 8).tolist() for _ in range(args.random_layouts)]
               for c in dtfm_cases.CASES}
    spec = {"src": str(Path(args.dtfm_src).resolve()), "cases": list(dtfm_cases.CASES), "seed": args.seed,
            "trails": args.trails, "population": args.population, "random_layouts": layouts}
    run = subprocess.run([args.python, "-c", _DRIVER], input=json.dumps(spec), capture_output=True, text=True)
    if run.returncode:
        sys.exit(run.stderr[-3000:])
    theirs = json.loads(run.stdout)
    cases, worst = {}, 0.0
    for case in dtfm_cases.CASES:
        t = theirs[case]
        delay, bw = matrices_from_cluster(ROOT / "benchmarks" / "clusters" / f"dtfm-{case}.yaml")
        t0 = time.perf_counter()
        ours = dtfm_cost_parts(t["groups"], delay, bw)
        ours_s = time.perf_counter() - t0
        our_cost = ours["data_parallel_s"] + 2 * ours["pipeline_parallel_s"]
        rand = [{"groups": g, "their_cost_s": tc, "our_cost_s": dtfm_cost(g, delay, bw)}
                for g, tc in zip(layouts[case], t["random"])]
        errs = [abs(our_cost / t["cost"] - 1)] + [abs(r["our_cost_s"] / r["their_cost_s"] - 1) for r in rand]
        worst = max(worst, *errs)
        cases[case] = {"best_groups": t["groups"], "their_cost_s": t["cost"], "our_cost_s": our_cost,
                       "their_gcma_min_score_s": t["gcma_min_score"], "our_data_parallel_s": ours["data_parallel_s"],
                       "our_pipeline_parallel_s": ours["pipeline_parallel_s"], "their_stage_order": t["order"],
                       "our_stage_order": ours["order"], "search_wall_s": t["wall_s"],
                       "candidates_scored": t["candidates"], "our_cost_eval_s": ours_s, "random_layouts": rand,
                       "max_rel_diff": max(errs)}
        print(f"{case:13s} theirs {t['cost']:10.6f} s  ours {our_cost:10.6f} s  rel diff {max(errs):.1e}  "
              f"search {t['wall_s']:.1f} s")
    if args.quick:
        print(f"quick run: max relative difference {worst:.1e}; nothing written")
        sys.exit(0 if worst <= MAX_REL_DIFF else 1)
    RESULTS.write_text(json.dumps({
        "benchmark": "dtfm_scheduler", "source": {"repo": dtfm_cases.SOURCE[0], "commit": SOURCE_COMMIT,
                                                  "path": "scheduler/heuristic_evolutionary_solver/scheduler.py"},
        "search": {"algorithm": "GCMA (mode default)", "seed": args.seed, "trails": args.trails,
                   "population": args.population},
        "max_rel_diff": worst, "cases": cases}, indent=1) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}; max relative difference {worst:.1e}")


if __name__ == "__main__":
    main()
