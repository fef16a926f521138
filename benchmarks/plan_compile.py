"""How long compiling, validating, saving, loading and simulating a plan takes as pipelines grow.

Each case is a hand-made uniform chain (2 blocks per stage) on a synthetic
cluster: ``S`` stages, ``M`` microbatches, every other middle stage
replicated twice, a verifier on every boundary (a CPU verifier host for odd
boundaries, the consumer itself for even ones). For every case we time:
``compile_plan`` (list scheduling, validation and the simulation that fills
``plan.predicted``), ``plan.save``, ``load_plan`` (schema + program
validation) and ``simulate``. Goal: the largest case (32 stages, 256
microbatches, ~80k instructions) compiles in under 10 s and loads in under
5 s on this machine. Also checks, per case, that the simulated step of the
same layout without replicas, verifiers or communication equals the closed
form (M + S - 1)(t_f + t_b).

Run: ``python benchmarks/plan_compile.py [--quick]``. Prints a table and writes
``benchmarks/results/plan_compile.json`` (``--quick``: the small cases, nothing written). Timings are noisy on a
shared machine.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cost_models import compute  # noqa: E402
from cost_models.cluster import ClusterSpec  # noqa: E402
from cost_models.cluster_file import parse_cluster
from cost_models.training import TrainingConfig  # noqa: E402
from planner.compile import compile_plan  # noqa: E402
from planner.ir import Block, BlockChain  # noqa: E402
from planner.plan_load import load_plan  # noqa: E402
from planner.plan_values import ModelRef  # noqa: E402
from planner.simulate import predict, simulate  # noqa: E402
from planner.solver.policy import VerificationPolicy  # noqa: E402
from planner.solver.solution import (  # noqa: E402
    Solution,
    SolveReport,
    StagePlacement,
    VerifierPlacement,
)

RESULTS = Path(__file__).resolve().parent / "results" / "plan_compile.json"
CASES = ((4, 8), (8, 32), (16, 64), (32, 128), (32, 256))
QUICK_CASES = ((4, 8), (8, 32), (16, 64))
COMPILE_GOAL_S, LOAD_GOAL_S = 10.0, 5.0
GPU = {"name": "BENCH-GPU", "kind": "gpu", "peak_flops": {"float32": 2e13}, "mem_bytes": 80 * 2**30,
       "mem_bw_bytes_per_s": 2e12, "efficiency": 0.5}
CPU = {**GPU, "name": "BENCH-CPU", "kind": "cpu", "mem_bytes": 64 * 2**30, "mem_bw_bytes_per_s": 1e11}


def _chain(n_blocks: int, out_bytes: int) -> BlockChain:
    blocks = tuple(Block(index=i, name=f"layers.{i}", node_names=(f"n{i}a", f"n{i}b"), module_paths=(f"layers.{i}",),
                         param_names=(f"layers.{i}.w",), fwd_flops=5 * 10**10, bwd_flops=10**11,
                         param_count=10**7, param_bytes=4 * 10**7, saved_act_bytes=5 * 10**7, out_bytes=out_bytes,
                         boundary_nodes=(f"n{i}b",)) for i in range(n_blocks))
    return BlockChain(model_name="bench", fingerprint=f"bench-{n_blocks}-{out_bytes}", blocks=blocks,
                      input_bytes=4096, microbatch_size=1)


def _cluster(n_gpus: int, bandwidth_gbps: float, latency_ms: float,
             trusted: frozenset[str] = frozenset()) -> ClusterSpec:
    link = {"bandwidth_gbps": bandwidth_gbps, "latency_ms": latency_ms}
    hosts = [{"name": f"g{i}", "region": "r", "trust": f"g{i}",
              "trusted": f"g{i}" in trusted or i == 0 or i == n_gpus - 1,
              "devices": [{"type": GPU["name"], "spec": GPU, "count": 1}]} for i in range(n_gpus)]
    hosts.append({"name": "verifier", "region": "r", "trust": "op", "trusted": True, "role": "verifier",
                  "devices": [{"type": CPU["name"], "spec": CPU, "count": 1}]})
    return parse_cluster({"name": "bench", "hosts": hosts, "links": {"intra_host": link, "default": link}})


def _solution(S: int, M: int, *, replicas: bool, verify: bool) -> tuple[Solution, int]:
    stages, dev = [], 0
    for k in range(S):
        n = 2 if replicas and 0 < k < S - 1 and k % 2 else 1
        split = tuple(M // n + (i < M % n) for i in range(n))
        stages.append(StagePlacement(index=k, first_block=2 * k, last_block=2 * k + 1,
                                     devices=tuple(f"g{dev + i}/0" for i in range(n)), microbatches=split))
        dev += n
    verifiers = ()
    if verify:
        consumer = {k: stages[k].devices[0] for k in range(S)}
        verifiers = tuple(VerifierPlacement(boundary=b, device="verifier/0" if b % 2 else consumer[b + 1],
                                            directions=("act", "grad") if b % 2 else ("act",))
                          for b in range(S - 1))
    report = SolveReport(method="bench", status="FEASIBLE", objective_ms=0.0, bound_ms=None, gap=None, solve_s=0.0)
    return Solution(stages=tuple(stages), verifiers=verifiers, num_microbatches=M, schedule="1f1b",
                    predicted_step_ms=0.0, memory_bytes=(), report=report), dev


def _trusted_hosts(sol: Solution) -> frozenset[str]:
    """Stage 0 and the odd stages run on trusted hosts: the verifiers above (an odd stage checks the even boundary
    before it, the CPU host the rest) then satisfy the trust policy that ``load_plan`` checks."""
    return frozenset(d.split("/")[0] for st in sol.stages if st.index == 0 or st.index % 2 for d in st.devices)


def _case(S: int, M: int, folder: Path) -> dict:
    ch = _chain(2 * S, out_bytes=2**22)
    sol, n_gpus = _solution(S, M, replicas=True, verify=True)
    cluster = _cluster(n_gpus, 100.0, 0.05, _trusted_hosts(sol))
    cfg = TrainingConfig(global_batch=M, microbatch_size=1, schedule="1f1b")
    ref = ModelRef(spec="bench", name="bench", fingerprint=ch.fingerprint, batch=1)
    t0 = time.perf_counter()
    plan = predict(compile_plan(sol, ch, cluster, cfg, VerificationPolicy(), ref))
    t1 = time.perf_counter()
    path = plan.save(folder / f"plan-{S}x{M}.json")
    t2 = time.perf_counter()
    loaded = load_plan(path)
    t3 = time.perf_counter()
    result = simulate(loaded)
    t4 = time.perf_counter()
    assert loaded == plan
    # The same layout, plain: closed form check.
    plain_ch = _chain(2 * S, out_bytes=0)
    plain_sol, _ = _solution(S, M, replicas=False, verify=False)
    plain = predict(compile_plan(plain_sol, plain_ch, _cluster(S, 100.0, 0.0), cfg, VerificationPolicy(enabled=False),
                         ModelRef(spec="bench", name="bench", fingerprint=plain_ch.fingerprint, batch=1)))
    spec = parse_cluster(plain.cluster).device("g0/0").spec
    t = compute.range_fwd_ms(plain_ch, 0, 1, spec) + compute.range_bwd_ms(plain_ch, 0, 1, spec)
    closed = (M + S - 1) * t
    pipeline = simulate(plain).pipeline_ms
    return {"stages": S, "microbatches": M, "ranks": plan.num_ranks,
            "instructions": sum(len(p) for p in plan.programs), "plan_kib": round(path.stat().st_size / 1024, 1),
            "compile_s": round(t1 - t0, 3), "save_s": round(t2 - t1, 3), "load_s": round(t3 - t2, 3),
            "simulate_s": round(t4 - t3, 3), "step_ms": round(result.step_ms, 3),
            "bubble": round(result.bubble_fraction, 4), "closed_form_ms": closed, "simulated_plain_ms": pipeline,
            "closed_form_rel_err": abs(pipeline - closed) / closed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only the small cases; writes nothing")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for S, M in QUICK_CASES if args.quick else CASES:
            rows.append(_case(S, M, Path(tmp)))
    table = Table(title="plan compile / load / simulate (1F1B, replicas, verifiers)")
    cols = ("stages", "microbatches", "ranks", "instructions", "plan_kib", "compile_s", "save_s", "load_s",
            "simulate_s", "step_ms", "bubble", "closed_form_rel_err")
    for c in cols:
        table.add_column(c, justify="right")
    for row in rows:
        table.add_row(*(f"{row[c]:.2e}" if c == "closed_form_rel_err" else str(row[c]) for c in cols))
    console = Console(width=160)
    console.print(table)
    largest = rows[-1]
    ok = largest["compile_s"] <= COMPILE_GOAL_S and largest["load_s"] <= LOAD_GOAL_S and \
        all(r["closed_form_rel_err"] < 1e-9 for r in rows)
    console.print(f"goal (largest case compile <= {COMPILE_GOAL_S} s, load <= {LOAD_GOAL_S} s, closed form exact): "
                  f"{'met' if ok else 'NOT met'}")
    if args.quick:  # a smoke run: nothing written, and a slow shared machine does not fail it
        print("quick run: nothing written")
        return 0 if all(r["closed_form_rel_err"] < 1e-9 for r in rows) else 1
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"benchmark": "plan_compile", "quick": args.quick, "goal_met": ok,
                                   "goals": {"compile_s": COMPILE_GOAL_S, "load_s": LOAD_GOAL_S},
                                   "rows": rows}, indent=1) + "\n")
    print(f"wrote {RESULTS}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
