"""Executor probe: the CPU time the runtime's own executor costs per message and per pass, beyond the passes.

Run by ``planner.profiling.probes.measure_executor`` (cost models may not import
``planner.runtime``)::

    python -m planner.profiling.overhead_probe --model gpt-tiny --batch 2 --seq 32 --microbatches 4 --steps 6

It compiles a 2-stage 1F1B plan of the model (its blocks split in half, one
CPU rank per stage) and runs it with the real runtime (``launch``: two gloo
processes, one thread each) for ``--steps`` steps. Every rank records, per
step, the CPU time of the thread that runs its program, split as the executor
books it (``planner.runtime.rank.metrics.StepMetrics``): what is left outside the
passes, waits, verification and the optimizer (``own_cpu_ms``) is the
executor's own work; the part of it spent posting messages (``comm_cpu_ms``,
the runtime's ``comm.send``/``recv`` and the executor's bookkeeping around
them) is charged to the message instructions, the rest (preparing inputs,
prefetching, freeing, the step's metrics) to the passes. The process's CPU
time beyond that thread (``backend_cpu_ms``: gloo's threads moving the bytes)
is charged to the messages too. CPU time, not wall time: on a shared machine
the wall time also holds the time the rank was descheduled, which the
simulator's core sharing prices itself.

Prints one JSON line on stdout: ``{"message_bytes": n, "comm_cpu_per_message_ms": ...,
"backend_cpu_per_message_ms": ..., "bookkeeping_per_pass_ms": ..., "ranks": [...]}`` (medians over the
steps after ``--warmup``, summed over both ranks, per message / pass instruction).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from cost_models.cluster_file import parse_cluster
from cost_models.training import TrainingConfig
from models.registry import build_model
from planner.coarsen import coarsen
from planner.compile import compile_plan
from planner.errors import InvalidInputError
from planner.instruction_costs import CostModel
from planner.plan_load import load_plan
from planner.plan_values import ModelRef
from planner.runtime.launcher.launch import launch
from planner.runtime.options import RunOptions
from planner.runtime.rank.metrics import read_metrics
from planner.simulate import predict
from planner.solver.policy import VerificationPolicy
from planner.solver.solution import Solution, SolveReport, StagePlacement
from planner.trace import trace

MESSAGE_OPS = ("SEND_F", "SEND_B", "RECV_F", "RECV_B")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m planner.profiling.overhead_probe")
    p.add_argument("--model", required=True, help="model preset or module:factory")
    p.add_argument("--batch", type=int, default=2, help="microbatch size")
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out (start-up, caches)")
    p.add_argument("--timeout-s", type=float, default=120.0)
    return p.parse_args(argv)


def probe_plan(model: str, *, batch: int, seq: int | None, microbatches: int, folder: Path) -> Path:
    """A 2-stage 1F1B plan of ``model`` (its blocks split in half, two CPU devices), saved in ``folder``."""

    bundle = build_model(model, batch=batch, seq=seq, device="meta")
    chain = coarsen(trace(bundle.module, bundle.example_inputs, name=model))
    n = len(chain.blocks)
    if n < 2:
        raise InvalidInputError(f"blocks of {model}", expected="at least 2 (one per probe stage)", found=str(n))
    hosts = [{"name": f"h{i}", "region": "local", "trust": "operator", "trusted": True,
              "devices": [{"type": "CPU", "count": 1}]} for i in range(2)]
    link = {"bandwidth_gbps": 10, "latency_ms": 0.05}
    cluster = parse_cluster({"name": "probe", "hosts": hosts, "links": {"intra_host": link, "default": link}})
    ids = [d.id for d in cluster.devices]
    half = n // 2
    stages = tuple(StagePlacement(index=k, first_block=lo, last_block=hi, devices=(ids[k],),
                                  microbatches=(microbatches,)) for k, (lo, hi) in enumerate(((0, half - 1),
                                                                                              (half, n - 1))))
    report = SolveReport(method="hand", status="FEASIBLE", objective_ms=0.0, bound_ms=None, gap=None, solve_s=0.0)
    solution = Solution(stages=stages, verifiers=(), num_microbatches=microbatches, schedule="1f1b",
                        predicted_step_ms=0.0, memory_bytes=(), report=report)
    config = TrainingConfig(global_batch=batch * microbatches, microbatch_size=batch, schedule="1f1b",
                            optimizer="adam")
    ref = ModelRef(spec=model, name=model, fingerprint=chain.fingerprint, batch=batch, seq=seq)
    plan = predict(compile_plan(solution, chain, cluster, config, VerificationPolicy(enabled=False), ref))
    return plan.save(folder / "overhead-probe-plan.json")


def summarize(plan: Any, rows: list[Any], warmup: int) -> dict[str, Any]:
    """Per rank medians of the executor's CPU split, and the per-instruction figures over both ranks."""

    ranks = []
    for r in range(plan.num_ranks):
        mine = [m for m in rows if m.rank == r and m.step >= warmup] or [m for m in rows if m.rank == r]
        med = {k: statistics.median(getattr(m, k) for m in mine) for k in ("step_ms", "thread_cpu_ms", "comm_ms",
                                                                            "comm_cpu_ms", "compute_cpu_ms")}
        ranks.append({"rank": r, "messages": sum(1 for i in plan.programs[r] if i.op in MESSAGE_OPS),
                      "passes": sum(1 for i in plan.programs[r] if i.op in ("F", "B")), **med,
                      "own_cpu_ms": statistics.median(m.own_cpu_ms for m in mine),
                      "backend_cpu_ms": statistics.median(max(m.cpu_ms - m.thread_cpu_ms, 0.0) for m in mine)})
    messages = sum(x["messages"] for x in ranks)
    passes = sum(x["passes"] for x in ranks)
    comm = sum(x["comm_cpu_ms"] for x in ranks)
    return {"message_bytes": CostModel.for_plan(plan).boundary_bytes[0], "messages": messages, "passes": passes,
            "comm_cpu_per_message_ms": comm / messages,
            "backend_cpu_per_message_ms": sum(x["backend_cpu_ms"] for x in ranks) / messages,
            "bookkeeping_per_pass_ms": max(sum(x["own_cpu_ms"] for x in ranks) - comm, 0.0) / passes,
            "ranks": ranks}


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)

    with tempfile.TemporaryDirectory(prefix="stagewise-overhead-") as tmp:
        folder = Path(tmp)
        path = probe_plan(args.model, batch=args.batch, seq=args.seq, microbatches=args.microbatches,
                          folder=folder)
        metrics = folder / "metrics.jsonl"
        # --model is the operator's word (`stagewise profile --model`): a factory's plan runs only when named
        launch(RunOptions(plan=str(path), steps=args.steps, timeout_s=args.timeout_s, metrics=str(metrics),
                          threads=1, backend="gloo", model=args.model), log_dir=folder / "logs")
        report = summarize(load_plan(path), read_metrics(metrics), args.warmup)
    print(json.dumps({"model": args.model, "batch": args.batch, "seq": args.seq,
                      "microbatches": args.microbatches, "steps": args.steps, **report}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
