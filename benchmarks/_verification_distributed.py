"""The step time of ``stagewise run`` itself with and without verification (``verification.py``): the hand-made
plans it runs and the timed runs. The wide models' factory specs name ``benchmarks.verification``, which
re-exports them."""
from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

from cost_models.cluster_file import parse_cluster
from planner.simulate import predict
from planner.verifier_config import VerifierConfig

__all__ = [
    "OVERHEAD_MODELS",
    "WIDER_GPT",
    "WIDE_GPT",
    "allowed_model",
    "distributed_overhead",
    "overhead_plan",
    "wide_gpt",
    "wider_gpt",
]

WIDE_GPT = "benchmarks.verification:wide_gpt"
WIDE_SEQ = 128


WIDER_GPT = "benchmarks.verification:wider_gpt"


def wide_gpt():
    """A wider model for the distributed overhead (a factory for ``build_model``): 8 layers,
    d=384, byte vocabulary, 128-token windows."""
    from models.gpt import GPT, GPTConfig
    return GPT(GPTConfig(vocab_size=256, max_seq=WIDE_SEQ, n_layers=8, d_model=384, n_heads=6))


def wider_gpt():
    """A realistic width (GPT-2 small's d=768) for the distributed overhead: 4 layers (one per
    stage, so that a step stays a few seconds on a shared 2-core machine), 128-token windows."""
    from models.gpt import GPT, GPTConfig
    return GPT(GPTConfig(vocab_size=256, max_seq=WIDE_SEQ, n_layers=4, d_model=768, n_heads=12))


# name -> (model spec, seq, steps per run): few steps for the wide ones (the first 3 are warm-up)
OVERHEAD_MODELS: dict[str, tuple[str, int | None, int]] = {
    "gpt-tiny": ("gpt-tiny", None, 30), "gpt d=384": (WIDE_GPT, WIDE_SEQ, 8), "gpt d=768": (WIDER_GPT, WIDE_SEQ, 6)}


def overhead_plan(spec: str, folder: Path, *, host: bool, seq: int | None = None, depth: int = 4,
                  untrusted: frozenset[int] = frozenset(), split: bool = False) -> Path:
    """A ``depth``-stage, 4-microbatch plan of ``spec`` on local CPUs whose verifier checks every
    boundary both ways: a CPU-only verifier host (rank ``depth``) if ``host``, else rank 0 (the
    first stage's device, trusted) as the tests' plans and a small deployment would. ``untrusted``: the stages
    on untrusted hosts; ``split``: boundary 0 verified by rank 0, the others by the last stage's rank."""
    from cost_models.training import TrainingConfig
    from models.registry import build_model
    from planner.coarsen import coarsen
    from planner.compile import compile_plan
    from planner.plan_values import ModelRef
    from planner.solver.policy import VerificationPolicy
    from planner.solver.solution import (
        Solution,
        SolveReport,
        StagePlacement,
        VerifierPlacement,
    )
    from planner.trace import trace

    microbatch, count = 4, 4
    bundle = build_model(spec, batch=microbatch, seq=seq, device="meta")
    chain = coarsen(trace(bundle.module, bundle.example_inputs, name=spec))
    hosts = [{"name": f"h{i}", "region": "local", "trust": f"v{i}" if i in untrusted else "operator",
              "trusted": i not in untrusted, "devices": [{"type": "CPU", "count": 1}]} for i in range(depth)]
    if host:
        hosts.append({"name": "verifier", "region": "local", "trust": "operator", "trusted": True,
                      "role": "verifier"})
    cluster = parse_cluster({"name": "local", "hosts": hosts,
                                     "links": {"intra_host": {"bandwidth_gbps": 100, "latency_ms": 0.01},
                                               "default": {"bandwidth_gbps": 10, "latency_ms": 0.05}}})
    ids = [d.id for d in cluster.devices]
    layers = len(chain.blocks) - 2                       # embed, layers..., head
    cuts = [1 + round(k * layers / depth) for k in range(depth + 1)]
    ranges = [(0 if k == 0 else cuts[k], len(chain.blocks) - 1 if k == depth - 1 else cuts[k + 1] - 1)
              for k in range(depth)]
    stages = tuple(StagePlacement(index=k, first_block=lo, last_block=hi, devices=(ids[k],), microbatches=(count,))
                   for k, (lo, hi) in enumerate(ranges))
    verifier = ids[depth] if host else ids[0]
    checks = tuple(VerifierPlacement(boundary=b, device=ids[depth - 1] if split and b else verifier,
                                     directions=("act", "grad")) for b in range(depth - 1))
    report = SolveReport(method="hand", status="FEASIBLE", objective_ms=0.0, bound_ms=None, gap=None, solve_s=0.0)
    solution = Solution(stages=stages, verifiers=checks, num_microbatches=count, schedule="1f1b",
                        predicted_step_ms=0.0, memory_bytes=(), report=report)
    config = TrainingConfig(global_batch=microbatch * count, microbatch_size=microbatch, schedule="1f1b",
                            optimizer="adam")
    ref = ModelRef(spec=spec, name=spec, fingerprint=chain.fingerprint, batch=microbatch, seq=seq)
    plan = predict(compile_plan(solution, chain, cluster, config, VerificationPolicy(enabled=True, trusted_endpoints=False),
                        ref, verifier_config=VerifierConfig()))
    return plan.save(folder / f"{spec.split(':')[-1]}-{'host' if host else 'stage'}{'-split' if split else ''}.json")


def distributed_overhead(models: dict[str, tuple[str, int | None, int]], *, reps: int,
                         wait_first: bool = False, slowdown: float = 1.0,
                         hosts: tuple[bool, ...] = (False, True), depth: int = 4) -> list[dict[str, Any]]:
    """Step time of ``stagewise run`` with and without verification (the same plan, runs
    interleaved so that the machine's load drifts into both alike): per model and verifier
    placement, the median over runs of each run's median step (wall) and of its CPU time
    summed over ranks (what a shared machine's load inflates least). ``models``: name ->
    (spec, seq, steps). ``wait_first``: also run verification waiting for each verdict
    before using the tensor (``--wait-verdicts``, the executor's old way). ``slowdown`` > 1:
    every stage's compute emulated ``slowdown`` times slower than this CPU (``stagewise run
    --emulate-speed --emulate-slowdown``), so its core idles during compute as a GPU's host
    CPU does, and the checks can overlap it as they would there. ``hosts``: the verifier placements timed
    (True: on a CPU verifier host, False: on stage rank 0); ``depth``: the plans' stages."""
    import tempfile

    modes = ("off", "on") + (("wait",) if wait_first else ())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (spec, seq, steps) in models.items():
            for host in hosts:
                path = overhead_plan(spec, Path(tmp), host=host, seq=seq, depth=depth)
                runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
                for _ in range(reps):
                    for mode in modes:
                        runs[mode].append(_overhead_run(path, steps, mode, slowdown, model=allowed_model(spec)))
                ms = {m: statistics.median(r["ms"] for r in runs[m]) for m in modes}
                cpu = {m: statistics.median(r["cpu"] for r in runs[m]) for m in modes}
                row = {"model": name, "verifier": f"CPU host (rank {depth})" if host else "stage rank 0",
                       "steps": steps, "runs": reps, "slowdown": slowdown, "step_ms_verify_on": round(ms["on"], 1),
                       "step_ms_verify_off": round(ms["off"], 1), "overhead": round(ms["on"] / ms["off"] - 1.0, 4),
                       "cpu_ms_verify_on": round(cpu["on"], 1), "cpu_ms_verify_off": round(cpu["off"], 1),
                       "cpu_overhead": round(cpu["on"] / cpu["off"] - 1.0, 4)}
                if wait_first:
                    row.update({"step_ms_wait_first": round(ms["wait"], 1),
                                "overhead_wait_first": round(ms["wait"] / ms["off"] - 1.0, 4),
                                "cpu_ms_wait_first": round(cpu["wait"], 1),
                                "cpu_overhead_wait_first": round(cpu["wait"] / cpu["off"] - 1.0, 4)})
                rows.append(row)
                before = (f" (waiting first: {row['overhead_wait_first']:+.1%} wall, "
                          f"{row['cpu_overhead_wait_first']:+.1%} CPU)") if wait_first else ""
                print(f"  distributed {name} {row['verifier']}: {row['overhead']:+.1%} wall, "
                      f"{row['cpu_overhead']:+.1%} CPU{before}", file=sys.stderr, flush=True)
    return rows


def allowed_model(spec: str) -> str | None:
    """``run --model``: a factory spec (``module:function``) runs only where the user allows it by name."""
    return spec if ":" in spec else None


def _overhead_run(path: Path, steps: int, mode: str, slowdown: float = 1.0, *, model: str | None = None) -> dict[str, float]:
    """One ``stagewise run``: verification off, on (deferred verdicts) or on waiting first."""
    from planner.runtime.launcher.launch import launch
    from planner.runtime.options import RunOptions

    result = launch(RunOptions(plan=str(path), steps=steps, timeout_s=600, model=model, verify=mode != "off",
                               wait_verdicts=mode == "wait", emulate=slowdown > 1.0, emulate_slowdown=slowdown))
    warm = min(3, steps - 1)
    return {"ms": statistics.median(result["step_ms"][warm:]), "cpu": statistics.median(result["cpu_ms"][warm:])}
