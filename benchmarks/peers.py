"""Peers: Stagewise against DT-FM's scheduler on DT-FM's five published network cases (GPT-3 1.3B).

Per case (``benchmarks/clusters/dtfm-<case>.yaml``, transcribed by ``dtfm_cases.py``): 64 V100s, global
batch 512 sequences of 2048 tokens, fp16 compute, no verification (DT-FM trusts every worker). Layouts:

* ``free``: Stagewise's plan (``planner.api.plan_chain``, ``--time-limit`` seconds);
* ``8x8``: Stagewise's plan with 8 stages of 8 replicas (``--stages 8 --replicas 8``), DT-FM's shape;
* ``ppdp``: the best uniform pp x dp grid (``--baseline ppdp``);
* ``dtfm``: DT-FM's scheduler's best layout (``results/dtfm_scheduler.json``, run side by side from its own
  code by ``dtfm_cost.py``): its 8 groups as stages in its stage order, layers split evenly.

Each is costed by our simulator (the step of its compiled programs) and, for the 8 x 8 layouts, by DT-FM's
own communication cost model (``dtfm_cost``: it cannot price unequal groups). Goals (issue 18): the 8 x 8
plan no dearer than DT-FM's under DT-FM's model; the free plan no slower than ppdp and DT-FM's layout under
our simulator; objective within 5% of simulated; planning within 60 s. Writes ``results/peers.json``.

Run: ``python benchmarks/peers.py [--time-limit 45] [--cases worldwide,...]`` (``--quick``: the worldwide case
with gpt-small at sequence 128, 1 s limits, nothing written). A run of some ``--cases`` at the results file's
limit keeps the other cases' rows (``cases_rerun``: the date each case last ran).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from dtfm_cost import dtfm_cost, matrices_from_cluster

import cost_models
from cost_models.memory import trace_dtype
from cost_models.training import TrainingConfig
from planner.api import plan_chain
from planner.compile import compile_plan
from planner.model_io import load_chain
from planner.plan_values import ModelRef
from planner.simulate import predict, simulate
from planner.solver.objective import even_split
from planner.solver.policy import VerificationPolicy
from planner.solver.problem_build import scale_chain
from planner.solver.solution import Solution, SolveReport, StagePlacement

CASES = ("datacenter", "spot", "universities", "regional", "worldwide")
BATCH, SEQ, DTYPE = 512, 2048, "float16"
MODEL = "gpt-1.3b"
# --quick: a model with more blocks than DT-FM's 8 stages, short sequences, one case
QUICK = {"model": "gpt-small", "seq": 128, "time_limit": 1.0, "cases": "worldwide"}
POLICY = VerificationPolicy(enabled=False)


def _groups(plan, index_of: dict[str, int]) -> list[list[int]] | None:
    """The plan's stages as DT-FM groups (GPU indices), when it is 8 stages of 8."""
    groups = [[index_of[plan.ranks[r].device] for r in plan.stage_ranks(k)] for k in range(plan.num_stages)]
    return groups if len(groups) == 8 and all(len(g) == 8 for g in groups) else None


def _dtfm_layout(chain, cluster, groups: list[list[int]], order: list[int], microbatch: int, model: str = MODEL,
                 seq: int = SEQ):
    """DT-FM's layout as our plan: stage k = group order[k], an even share of the blocks."""
    ids = [d.id for d in cluster.stage_devices]
    L, S = len(chain.blocks), len(order)
    bounds = [round(i * L / S) for i in range(S + 1)]
    M = BATCH // microbatch
    stages = tuple(StagePlacement(index=k, first_block=bounds[k], last_block=bounds[k + 1] - 1,
                                  devices=tuple(ids[i] for i in groups[g]), microbatches=even_split(M, len(groups[g])))
                   for k, g in enumerate(order))
    report = SolveReport(method="dtfm", status="FEASIBLE", objective_ms=0.0, bound_ms=None, gap=None, solve_s=0.0)
    sol = Solution(stages=stages, verifiers=(), num_microbatches=M, schedule="1f1b", predicted_step_ms=0.0,
                   memory_bytes=(), report=report)
    config = TrainingConfig(global_batch=BATCH, microbatch_size=microbatch, dtype=DTYPE)
    ref = ModelRef(spec=model, name=chain.model_name, fingerprint=chain.fingerprint, batch=chain.microbatch_size,
                   seq=seq, dtype=trace_dtype(chain))
    return predict(compile_plan(sol, scale_chain(chain, microbatch), cluster, config, POLICY, ref))


def _row(name: str, plan, wall_s: float | None, delay, bw, index_of) -> dict:
    sim = simulate(plan).step_ms
    groups = _groups(plan, index_of)
    r = plan.report
    return {"layout": name, "stages": plan.num_stages,
            "replicas": [len(plan.stage_ranks(k)) for k in range(plan.num_stages)],
            "microbatches": plan.num_microbatches, "simulated_s": sim / 1e3,
            "objective_s": r.objective_ms / 1e3 if r.objective_ms else None,
            "objective_vs_simulated": (r.objective_ms - sim) / sim if r.objective_ms else None,
            "bound_s": None if r.bound_ms is None else r.bound_ms / 1e3, "plan_wall_s": wall_s,
            "dtfm_cost_s": None if groups is None else dtfm_cost(groups, delay, bw)}


def run_case(case: str, chain, time_limit_s: float, scheduler: dict, model: str = MODEL, seq: int = SEQ
             ) -> list[dict]:
    path = HERE / "clusters" / f"dtfm-{case}.yaml"
    cluster = cost_models.load_cluster(path)
    delay, bw = matrices_from_cluster(path)
    index_of = {d.id: i for i, d in enumerate(cluster.stage_devices)}
    rows = []
    for name, kwargs in (("free", {}), ("8x8", {"stages": 8, "replicas": 8}), ("ppdp", {"baseline": "ppdp"})):
        start = time.perf_counter()
        plan = plan_chain(chain, cluster, spec=model, seq=seq, global_batch=BATCH, policy=POLICY,
                          time_limit_s=time_limit_s, dtype=DTYPE, **kwargs)
        rows.append(_row(name, plan, time.perf_counter() - start, delay, bw, index_of))
        print(f"  {case:12s} {name:5s} simulated {rows[-1]['simulated_s']:8.2f} s  objective "
              f"{rows[-1]['objective_s'] or 0:8.2f} s  dtfm-model {rows[-1]['dtfm_cost_s'] or float('nan'):8.2f} s  "
              f"plan {rows[-1]['plan_wall_s']:.1f} s", flush=True)
        if name == "free":
            microbatch = plan.config.microbatch_size
    theirs = scheduler["cases"][case]
    plan = _dtfm_layout(chain, cluster, theirs["best_groups"], theirs["their_stage_order"], microbatch, model, seq)
    rows.append(_row("dtfm", plan, theirs["search_wall_s"], delay, bw, index_of))
    rows[-1]["dtfm_cost_theirs_s"] = theirs["their_cost_s"]
    print(f"  {case:12s} dtfm  simulated {rows[-1]['simulated_s']:8.2f} s  dtfm-model {rows[-1]['dtfm_cost_s']:8.2f} s",
          flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=None, help=f"default 45 s (--quick: {QUICK['time_limit']:g})")
    ap.add_argument("--cases", default=None, help=f"default {','.join(CASES)} (--quick: {QUICK['cases']})")
    ap.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK['model']} at sequence {QUICK['seq']}, "
                    "nothing written")
    args = ap.parse_args()
    model, seq = (QUICK["model"], QUICK["seq"]) if args.quick else (MODEL, SEQ)
    time_limit = args.time_limit or (QUICK["time_limit"] if args.quick else 45.0)
    cases = args.cases or (QUICK["cases"] if args.quick else ",".join(CASES))
    scheduler = json.loads((HERE / "results" / "dtfm_scheduler.json").read_text())
    _, chain = load_chain(model, batch=1, seq=seq)
    out = {"benchmark": "peers", "model": model, "global_batch": BATCH, "seq": seq, "dtype": DTYPE,
           "time_limit_s": time_limit, "date": time.strftime("%Y-%m-%d"), "cases": {}}
    for case in cases.split(","):
        out["cases"][case] = run_case(case, chain, time_limit, scheduler, model, seq)
    if args.quick:
        print("quick run: nothing written")
        return
    target = HERE / "results" / "peers.json"
    if target.exists():  # a run of some cases keeps the others' rows (each row says the limit it ran at)
        kept = json.loads(target.read_text())
        if kept.get("time_limit_s") == time_limit and kept.get("model") == model:
            out["cases"] = {**kept.get("cases", {}), **out["cases"]}
            out["cases_rerun"] = {**kept.get("cases_rerun", {}), **dict.fromkeys(cases.split(","), out["date"])}
    target.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
