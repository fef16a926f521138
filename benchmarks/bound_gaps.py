"""Bound gaps on communication-bound pools (issue 36, item 7): the planner's valid bound with and without the
link term (``planner.solver.bound.links``), and the gap of the simulated step to it.

Cases (all ``planner.api.plan_chain``, as ``stagewise plan`` calls it, dtype ``auto``):

* ``dtfm-worldwide`` and ``dtfm-regional``: DT-FM's 64 V100s (``benchmarks/clusters/dtfm-*.yaml``), gpt-1.3b at
  1024 tokens, global batch 64 (as ``benchmarks/pools.py`` plans DT-FM's case);
* ``swarm-t4``: the packaged volunteer swarm (16 untrusted T4s on 200 Mb/s, a trusted host of 2), gpt-1.3b at
  1024 tokens, global batch 32 (as ``benchmarks/solver.py``);
* ``sailor-like``: A100 and V100 nodes in two zones, 16 Gb/s between them (``benchmarks/clusters/sailor-like.yaml``),
  gpt-1.3b at 1024 tokens, global batch 64.

Per case the plan is made twice at the same ``--time-limit``: once as shipped and once with the link term
removed (the old bound; the plan is the same: the bound does not steer the search). Reported: the simulated
step, the objective, both bounds, their gaps (``1 - bound / simulated``), and what limits the new bound:
``compute`` (the fluid LP or the Lagrangian bound), ``links`` (the transfers, all-reduces or stage 0's
window across slow links), ``memory`` (stage 0's in-flight window, or no island holding the model),
``replicas`` (``planner.solver.bound.replicas``: each stage's busy time against its replicas' all-reduce, the
last stage's path), ``fill`` (``planner.solver.bound.fill``: every stage's replicas at their own kind's speed after
the path before them, stage 0's all-reduce and optimizer step after the pipeline, every other stage's after its
own first input and passes, each replica's first backward after the round trip below it, its stages counted).
``tails`` (``planner.solver.bound.tails``, raised above fill after the search: the pipeline's depth and an early
stage's all-reduce behind the deepest stream); ``terms_at_plan_count``: fill and tails at the plan's microbatch
count without a work budget, capped at the simulated step. ``set_by``: what the planner's own report says set the
bound (``M=<count> <term>``, a key of ``bound.counts.TERMS``; ``limited_by`` is this script's reading of the terms).
``previous_bound_ms`` / ``previous_gap``: the
bound and gap the results file held before this run (the last commit's code). The bound includes each
microbatch count's raised after the search (``bound.counts.raised_bounds``, called by ``planner.solver.api._solve``).

**Random pools** (``random_rows``): the named cases are four shapes, so ``RANDOM_POOLS`` memory-tight pools are
drawn at random as well (``tests.unit.test_bound_in_flight``'s draw: a trusted host of two T4s and 2-4 volunteers'
T4s, or 3-5 one-T4 hosts, on 0.2-2 Gb/s links; random chains of 4-7 blocks whose activations fill most of a T4, 8 or
16 microbatches), each planned at ``RANDOM_LIMIT_S`` with and without the in-flight slot terms (``bound.fill_rows``'s
slot cycles, ``bound.tails``' slots): the simulated step, both bounds and their gaps.

Run: ``python benchmarks/bound_gaps.py [--time-limit S]`` (default 60 s a plan; two plans a case), prints a table
and writes ``benchmarks/results/bound_gaps.json``; ``--quick``: gpt-small at 256 tokens on two of the
clusters (a cluster file and a preset), 2 s a plan, one random pool at 1 s, nothing written.
"""
from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cost_models.cluster_file import load_cluster
from planner.api import plan_chain
from planner.model_io import load_chain
from planner.simulate import simulate
from planner.solver import count_solve
from planner.solver.api import BOUND_NOTE, problem_for
from planner.solver.bound import fill_rows, tails
from planner.solver.bound.counts import TERMS
from planner.solver.bound.fill import fill_bound_ms
from planner.solver.bound.links import LinkBound, link_lower_bound
from planner.solver.bound.tails import tail_bound_ms
from planner.solver.problem import recompute_problem

RESULTS = ROOT / "benchmarks" / "results" / "bound_gaps.json"
CLUSTERS = ROOT / "benchmarks" / "clusters"
GOAL_GAP = 0.10
# (case, cluster file or packaged name, global batch)
CASES = (("dtfm-worldwide", CLUSTERS / "dtfm-worldwide.yaml", 64),
         ("dtfm-regional", CLUSTERS / "dtfm-regional.yaml", 64),
         ("swarm-t4", "swarm-t4", 32),
         ("sailor-like", CLUSTERS / "sailor-like.yaml", 64))
QUICK_CASES = CASES[0], CASES[2]  # --quick: a cluster file and a named preset
RANDOM_POOLS, RANDOM_LIMIT_S, RANDOM_SEED = 12, 3.0, 8800


@contextmanager
def _without_link_term():
    """The planner as it was before the link term: ``count_solve`` sees a link bound of 0."""
    kept = count_solve.link_lower_bound
    count_solve.link_lower_bound = lambda problem, **_: LinkBound(bound_ms=0.0, limit="compute",
                                                                  threshold_gbps=None, islands=0)
    try:
        yield
    finally:
        count_solve.link_lower_bound = kept


@contextmanager
def _without_slots():
    """The bounds as they were before the in-flight slot terms (fill's slot cycles, the tails' slots)."""
    kept = fill_rows.SLOT_CYCLES, tails.SLOTS
    fill_rows.SLOT_CYCLES = tails.SLOTS = False
    try:
        yield
    finally:
        fill_rows.SLOT_CYCLES, tails.SLOTS = kept


def _random_row(seed: int, limit: float) -> dict:
    """One random memory-tight pool (module docstring, **Random pools**) planned with and without the slot terms."""
    import numpy as np

    from tests.unit.test_bound_in_flight import tight_draw

    kind = ("swarm2", "hosts")[seed % 2]
    cluster, policy, chain, batch = tight_draw(np.random.default_rng(RANDOM_SEED + seed), kind)
    plans = []
    for off in (False, True):
        with _without_slots() if off else nullcontext():
            plans.append(plan_chain(chain, cluster, spec="tests:chain", global_batch=batch, microbatch_size=1,
                                    policy=policy, time_limit_s=limit, workers=2))
    new, old = plans
    sim, sim_old = simulate(new).step_ms, simulate(old).step_ms
    bound, bound_old = new.report.bound_ms or 0.0, old.report.bound_ms or 0.0
    return {"seed": RANDOM_SEED + seed, "pool": kind, "devices": sum(len(h.devices) for h in cluster.hosts),
            "blocks": len(chain.blocks), "microbatches": new.config.num_microbatches, "stages": new.num_stages,
            "simulated_ms": round(float(sim), 3), "old_bound_ms": round(float(bound_old), 3),
            "bound_ms": round(float(bound), 3), "old_gap": round(float(1 - bound_old / sim_old), 4),
            "gap": round(float(1 - bound / sim), 4), "same_plan": bool(abs(sim - sim_old) <= 1e-6 * sim)}


def _plan(chain, cluster, model: str, seq: int, batch: int, limit: float):
    start = time.perf_counter()
    plan = plan_chain(chain, cluster, spec=model, seq=seq, global_batch=batch, dtype="auto", time_limit_s=limit,
                      workers=2)
    return plan, time.perf_counter() - start


def _link_terms(chain, cluster, plan) -> dict:
    """The link bound at the plan's microbatch size, with and without recomputation: its value and limit."""
    config = plan.config
    problem = problem_for(chain, cluster, config, plan.policy, config.microbatch_size)[0]
    out = {}
    for name, p in (("plain", problem), ("recompute", recompute_problem(problem))):
        found = link_lower_bound(p)
        out[name] = {"bound_ms": round(found.bound_ms, 3), "limit": found.limit,
                     "threshold_gbps": found.threshold_gbps, "islands": found.islands}
    return out


def _terms_at_plan(chain, cluster, plan, sim_ms: float) -> dict[str, float]:
    """The raised terms at the plan's microbatch count, as ``bound.counts`` raises them (fill, then tails above
    it), without a work budget and capped at the simulated step: which of them reaches the bound."""
    config = plan.config
    problem = problem_for(chain, cluster, config, plan.policy, config.microbatch_size)[0]
    if any(st.recompute for st in plan.stages):
        problem = recompute_problem(problem)
    fill = fill_bound_ms(problem, cap_ms=sim_ms)
    return {"fill": round(fill, 3), "tails": round(max(fill, tail_bound_ms(problem, fill, cap_ms=sim_ms)), 3)}


def set_by(plan) -> str:
    """What the planner's report says set its bound: ``M=<count> <term>`` (a key of ``bound.counts.TERMS``)."""
    names = {what: key for key, what in TERMS.items()}
    for note in plan.report.notes:
        m = re.match(rf"{re.escape(BOUND_NOTE)}[\d.]+ ms, set at M=(\d+) by (.+)$", note)
        if m:
            return f"M={m.group(1)} {names.get(m.group(2), '?')}"
    return "-"


def _case(name: str, where, batch: int, chain, model: str, seq: int, limit: float) -> dict:
    cluster = load_cluster(where)
    new, new_s = _plan(chain, cluster, model, seq, batch, limit)
    with _without_link_term():
        old, old_s = _plan(chain, cluster, model, seq, batch, limit)
    sim, sim_old = simulate(new).step_ms, simulate(old).step_ms
    bound, bound_old = new.report.bound_ms or 0.0, old.report.bound_ms or 0.0
    links = _link_terms(chain, cluster, new)
    terms = _terms_at_plan(chain, cluster, new, sim)
    binding = "compute" if bound <= bound_old * (1 + 1e-9) else \
        "tails" if terms["tails"] > terms["fill"] * (1 + 1e-6) and bound > terms["fill"] * (1 + 1e-6) else \
        max(links.values(), key=lambda x: x["bound_ms"])["limit"]
    return {"case": name, "model": model, "seq": seq, "global_batch": batch, "microbatches": new.config.num_microbatches,
            "set_by": set_by(new),
            "stages": new.num_stages, "simulated_ms": round(sim, 3), "objective_ms": round(new.report.objective_ms, 3),
            "old_bound_ms": round(bound_old, 3), "bound_ms": round(bound, 3),
            "old_gap": round(1 - bound_old / sim_old, 4), "gap": round(1 - bound / sim, 4),
            "limited_by": binding, "terms_at_plan_count": terms, "link_bound_at_plan_size": links, "same_plan": abs(sim - sim_old) <= 1e-6 * sim,
            "method": new.report.method, "plan_s": round(new_s, 1), "old_plan_s": round(old_s, 1)}


def _random_summary(rows: list[dict]) -> dict:
    """The random pools' median gaps with and without the slot terms, how many they lifted, the largest gap."""
    if not rows:
        return {}
    import statistics
    return {"median_old_gap": round(statistics.median(r["old_gap"] for r in rows), 4),
            "median_gap": round(statistics.median(r["gap"] for r in rows), 4),
            "lifted": int(sum(r["bound_ms"] > r["old_bound_ms"] * (1 + 1e-6) for r in rows)),
            "max_gap": float(max(r["gap"] for r in rows))}


def _previous() -> dict[str, dict]:
    """The rows the results file holds now, by case (empty where there is none)."""
    if not RESULTS.exists():
        return {}
    return {r["case"]: r for r in json.loads(RESULTS.read_text())["rows"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=None, help="per plan (s; default 60, --quick 2)")
    ap.add_argument("--quick", action="store_true", help="gpt-small at 256 tokens, 2 s a plan, nothing written")
    ap.add_argument("--cases", nargs="+", choices=[c[0] for c in CASES], default=None,
                    help="only these cases (nothing written: the results file holds every case)")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    limit = args.time_limit or (2.0 if args.quick else 60.0)
    model, seq = ("gpt-small", 256) if args.quick else ("gpt-1.3b", 1024)
    _, chain = load_chain(model, batch=1, seq=seq)
    rows, before = [], {} if args.quick else _previous()
    cases = QUICK_CASES if args.quick else CASES
    if args.cases:
        cases = tuple(c for c in cases if c[0] in args.cases)
    for name, where, batch in cases:
        row = _case(name, where, batch, chain, model, seq, limit)
        if name in before:
            row |= {"previous_bound_ms": before[name]["bound_ms"], "previous_gap": before[name]["gap"]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(f"\n{'case':<16}{'simulated ms':>14}{'old bound':>12}{'old gap':>9}{'bound':>12}{'gap':>8}"
          f"  limited by  set by (the report)")
    for r in rows:
        print(f"{r['case']:<16}{r['simulated_ms']:>14.1f}{r['old_bound_ms']:>12.1f}{100 * r['old_gap']:>8.1f}%"
              f"{r['bound_ms']:>12.1f}{100 * r['gap']:>7.1f}%  {r['limited_by']:<10}  {r['set_by']}")
    missed = [r["case"] for r in rows if r["gap"] > GOAL_GAP]
    print(f"goal gap <= {100 * GOAL_GAP:.0f}% at {limit:g} s: " + ("met" if not missed else f"missed by {missed}"))
    randoms = [] if args.cases else [_random_row(k, 1.0 if args.quick else RANDOM_LIMIT_S)
                                     for k in range(1 if args.quick else RANDOM_POOLS)]
    if randoms:
        print(f"\n{'random pool':<16}{'simulated ms':>14}{'old bound':>12}{'old gap':>9}{'bound':>12}{'gap':>8}")
    for r in randoms:
        print(f"{r['pool'] + ' ' + str(r['seed']):<16}{r['simulated_ms']:>14.1f}{r['old_bound_ms']:>12.1f}"
              f"{100 * r['old_gap']:>8.1f}%{r['bound_ms']:>12.1f}{100 * r['gap']:>7.1f}%")
    summary = _random_summary(randoms)
    if summary:
        print(f"random pools: median gap {100 * summary['median_old_gap']:.1f}% -> {100 * summary['median_gap']:.1f}%, "
              f"{summary['lifted']} of {len(randoms)} lifted, largest gap {100 * summary['max_gap']:.1f}%")
    if not args.quick and not args.cases:
        RESULTS.write_text(json.dumps({
            "benchmark": "bound_gaps", "date": time.strftime("%Y-%m-%d"), "time_limit_s": limit,
            "machine": f"{platform.machine()}, {platform.system()}, 2 cores shared (nice 19, not quiet)",
            "goal_gap": GOAL_GAP, "goal_missed": missed, "rows": rows,
            "random_limit_s": RANDOM_LIMIT_S, "random_summary": summary, "random_rows": randoms}, indent=1) + "\n")
        print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
