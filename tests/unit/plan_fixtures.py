"""Hand-made chains, clusters and solutions for the plan/compile/validate/simulate tests.

Nothing the tests use traces a model, so they stay fast. Run this file to
regenerate the golden plan after an intended format or cost-model change::

    python tests/unit/plan_fixtures.py --write-golden

and review the diff of tests/fixtures/golden_plan.json before committing it.
``--write-doc-gantt`` redraws docs/gantt-1f1b.png/.svg (traces gpt-1.3b on
the meta device: a few seconds).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import sys
from pathlib import Path
from typing import Sequence

from cost_models.cluster import ClusterSpec
from cost_models.cluster_file import default_cluster, parse_cluster
from cost_models.training import TrainingConfig
from planner.compile import compile_plan
from planner.ir import Block, BlockChain
from planner.plan import Plan
from planner.plan_history import HistoryEntry
from planner.plan_values import ModelRef
from planner.simulate import predict
from planner.solver.policy import VerificationPolicy
from planner.solver.solution import (
    Solution,
    SolveReport,
    StagePlacement,
    VerifierPlacement,
)

GOLDEN_PATH = Path(__file__).resolve().parents[1] / "fixtures" / "golden_plan.json"
DOC_GANTT_STEM = Path(__file__).resolve().parents[2] / "docs" / "gantt-1f1b"

# A device given inline (not from the catalog), so datasheet updates never move the golden file.
TEST_DEVICE = {"name": "TEST-GPU", "kind": "gpu", "peak_flops": {"float32": 1.0e13}, "mem_bytes": 16 * 2**30,
               "mem_bw_bytes_per_s": 5.0e11, "efficiency": 0.5}
SLOW_DEVICE = {**TEST_DEVICE, "name": "TEST-SLOW", "peak_flops": {"float32": 5.0e12}}
CPU_DEVICE = {**TEST_DEVICE, "name": "TEST-CPU", "kind": "cpu", "peak_flops": {"float32": 1.0e12},
              "mem_bw_bytes_per_s": 1.0e11}


def block(index: int, *, fwd_flops: int = 10**9, bwd_flops: int | None = None, params: int = 10**5,
          saved_act_bytes: int = 10**6, out_bytes: int = 2**16, name: str | None = None) -> Block:
    name = name or f"layers.{index}"
    return Block(index=index, name=name, node_names=(f"{name}.mm", f"{name}.act"), module_paths=(name,),
                 param_names=(f"{name}.weight",), fwd_flops=fwd_flops,
                 bwd_flops=2 * fwd_flops if bwd_flops is None else bwd_flops, param_count=params,
                 param_bytes=4 * params, saved_act_bytes=saved_act_bytes, out_bytes=out_bytes,
                 boundary_nodes=(f"{name}.act",), mem_traffic_bytes=0)


def chain(blocks: Sequence[Block], *, microbatch_size: int = 2, name: str = "toy") -> BlockChain:
    blocks = tuple(blocks)
    digest = hashlib.sha256(repr([(b.name, b.fwd_flops, b.param_count) for b in blocks]).encode()).hexdigest()
    return BlockChain(model_name=name, fingerprint=digest, blocks=blocks, input_bytes=1024,
                      microbatch_size=microbatch_size)


def uniform_chain(n_blocks: int, **kw) -> BlockChain:
    return chain([block(i, **kw) for i in range(n_blocks)])


def cluster(hosts: Sequence[tuple[str, dict, int]], *, bandwidth_gbps: float = 1e9, latency_ms: float = 0.0,
            verifier_host: bool = False, trusted: Sequence[str] = ()) -> ClusterSpec:
    """A cluster of (host, inline device spec, count); huge bandwidth and no latency by default (free comm)."""
    link = {"bandwidth_gbps": bandwidth_gbps, "latency_ms": latency_ms}
    host_rows = [{"name": h, "region": "r", "trust": h, "trusted": h in trusted,
                  "devices": [{"type": spec["name"], "spec": spec, "count": n}]} for h, spec, n in hosts]
    if verifier_host:
        host_rows.append({"name": "verifier", "region": "r", "trust": "operator", "trusted": True,
                          "role": "verifier", "devices": [{"type": "TEST-CPU", "spec": CPU_DEVICE, "count": 1}]})
    return parse_cluster({"name": "test", "hosts": host_rows,
                                  "links": {"intra_host": link, "default": link}})


def free_cluster(n_devices: int, spec: dict = TEST_DEVICE) -> ClusterSpec:
    """``n_devices`` identical devices on separate hosts, communication (practically) free."""
    return cluster([(f"h{i}", spec, 1) for i in range(n_devices)])


def solution(ranges: Sequence[tuple[int, int]], devices: Sequence[Sequence[str]], num_microbatches: int, *,
             splits: Sequence[Sequence[int]] | None = None, schedule: str = "1f1b",
             verifiers: Sequence[VerifierPlacement] = ()) -> Solution:
    stages = []
    for k, ((lo, hi), devs) in enumerate(zip(ranges, devices)):
        if splits is not None:
            split = tuple(splits[k])
        else:  # as even as possible, earlier replicas take the remainder
            q, r = divmod(num_microbatches, len(devs))
            split = tuple(q + (i < r) for i in range(len(devs)))
        stages.append(StagePlacement(index=k, first_block=lo, last_block=hi, devices=tuple(devs),
                                     microbatches=split))
    report = SolveReport(method="hand", status="FEASIBLE", objective_ms=0.0, bound_ms=None, gap=None, solve_s=0.0)
    return Solution(stages=tuple(stages), verifiers=tuple(verifiers), num_microbatches=num_microbatches,
                    schedule=schedule, predicted_step_ms=0.0, memory_bytes=(), report=report)


def model_ref(ch: BlockChain) -> ModelRef:
    return ModelRef(spec=f"tests:{ch.model_name}", name=ch.model_name, fingerprint=ch.fingerprint,
                    batch=ch.microbatch_size, seq=None)


def config(num_microbatches: int, schedule: str = "1f1b", microbatch_size: int = 2) -> TrainingConfig:
    return TrainingConfig(global_batch=num_microbatches * microbatch_size, microbatch_size=microbatch_size,
                          schedule=schedule, optimizer="adam", dtype="float32")


def compile_simple(ch: BlockChain, cl: ClusterSpec, sol: Solution,
                   policy: VerificationPolicy | None = None) -> Plan:
    return predict(compile_plan(sol, ch, cl, config(sol.num_microbatches, sol.schedule), policy or VerificationPolicy(),
                        model_ref(ch)))


def golden_plan() -> Plan:
    """A fixed small plan exercising every instruction: 3 stages (the middle one replicated), 4
    microbatches, 1F1B, a CPU verifier host, a verifier on a trusted stage rank and a local check."""
    ch = chain([block(i, fwd_flops=(i + 1) * 10**9, params=(i + 1) * 10**4) for i in range(5)], name="golden")
    cl = cluster([("trusted-a", TEST_DEVICE, 1), ("worker-b", TEST_DEVICE, 1), ("worker-c", SLOW_DEVICE, 1),
                  ("trusted-d", TEST_DEVICE, 1)], bandwidth_gbps=10.0, latency_ms=0.5, verifier_host=True,
                 trusted=("trusted-a", "trusted-d"))
    sol = solution([(0, 0), (1, 2), (3, 4)], [("trusted-a/0",), ("worker-b/0", "worker-c/0"), ("trusted-d/0",)],
                   4, splits=[(4,), (3, 1), (4,)],
                   verifiers=(VerifierPlacement(boundary=0, device="verifier/0", directions=("grad",)),
                              VerifierPlacement(boundary=1, device="trusted-d/0")))
    first = HistoryEntry(event="planned", when_utc="2026-01-01T00:00:00Z", reason="planned on test")  # fixed time
    return dataclasses.replace(compile_simple(ch, cl, sol), history=(first,))


def doc_plan() -> Plan:
    """The plan of docs/gantt-1f1b.png: gpt-1.3b (traced at microbatch 1 x 1024 tokens, bf16 mixed
    precision), 4 stages, 8 microbatches, 1F1B on the embedded default cluster.

    Trusted A100s hold the first and last stage, the two volunteers' RTX 3090s the middle ones
    (six layers each, so that their compute roughly matches the 0.5 Gb/s link between them).
    Boundary 0's gradients and boundary 2's activations are checked by their trusted consumers;
    boundary 1 (volunteer to volunteer) by the last stage's A100, which receives copies.
    """
    import torch

    from models.registry import build_model
    from planner.coarsen import coarsen
    from planner.trace import trace

    torch.set_num_threads(1)
    bundle = build_model("gpt-1.3b", batch=1, seq=1024, device="meta")
    ch = coarsen(trace(bundle.module, bundle.example_inputs, name="gpt-1.3b"))
    last = len(ch.blocks) - 1
    sol = solution([(0, 6), (7, 12), (13, 18), (19, last)],
                   [("dc-a100/0",), ("volunteer-1/0",), ("volunteer-2/0",), ("dc-a100/1",)], 8,
                   verifiers=(VerifierPlacement(boundary=0, device="dc-a100/0", directions=("grad",)),
                              VerifierPlacement(boundary=1, device="dc-a100/1"),
                              VerifierPlacement(boundary=2, device="dc-a100/1", directions=("act",))))
    cfg = TrainingConfig(global_batch=8, microbatch_size=1, schedule="1f1b", optimizer="adam", dtype="bfloat16",
                         mixed_precision=True)
    ref = ModelRef(spec="gpt-1.3b", name="gpt-1.3b", fingerprint=ch.fingerprint, batch=1, seq=1024)
    return predict(compile_plan(sol, ch, default_cluster(), cfg, VerificationPolicy(), ref))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write-golden", action="store_true", help=f"rewrite {GOLDEN_PATH}")
    parser.add_argument("--write-doc-gantt", action="store_true", help=f"redraw {DOC_GANTT_STEM}.png/.svg")
    args = parser.parse_args(argv)
    if not (args.write_golden or args.write_doc_gantt):
        parser.print_help()
        return 1
    if args.write_golden:
        golden_plan().save(GOLDEN_PATH, sign=False)  # the fixture is the same on every machine
        print(f"wrote {GOLDEN_PATH}")
    if args.write_doc_gantt:
        from planner.gantt import write_gantt
        from planner.simulate import simulate
        plan = doc_plan()
        for path in write_gantt(plan, simulate(plan), DOC_GANTT_STEM):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
