"""The runtime benchmark's model, its profiles of this CPU, its clusters and hand-placed plans."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cost_models.cluster_file import parse_cluster
from planner.simulate import predict

__all__ = ["LAYERS", "MICROBATCH", "MODEL", "NUM_MB", "SEQ", "Machine", "bench_gpt", "chain", "cluster",
           "compile_solution", "config", "hand_solution", "local_link", "profile_cpu"]


MODEL = "benchmarks.runtime:bench_gpt"
MICROBATCH, NUM_MB, SEQ, LAYERS = 4, 4, 64, 8


def bench_gpt():
    """The benchmark model (a factory for ``build_model``): 8 layers, d=128, byte vocabulary."""
    from models.gpt import GPT, GPTConfig
    return GPT(GPTConfig(vocab_size=256, max_seq=SEQ, n_layers=LAYERS, d_model=128, n_heads=4))
def chain():
    from models.registry import build_model
    from planner.coarsen import coarsen
    from planner.trace import trace
    bundle = build_model(MODEL, batch=MICROBATCH, seq=SEQ, device="meta")
    return coarsen(trace(bundle.module, bundle.example_inputs, name="bench-gpt"))


P2P_SIZES = (1 << 10, 1 << 17, 1 << 20, 1 << 22)  # around the 128 KiB activations the stages exchange


# Microbatches each core sharing probe process holds in flight: what a 1F1B stage of these plans holds
# (the 2-stage plan's first stage 2, the 4-stage plan's stages 4..1), so the caches see a stage's load.
SHARING_MICROBATCHES = 2


@dataclass(frozen=True)
class Machine:
    """What the first profile measured of how ranks on this machine's cores slow each other:
    ``sharing`` (passes that overlap, :data:`SHARING_MICROBATCHES` in flight per probe process) and
    ``messages`` (CPU time per message at each end, and the executor's own per message and per pass, as
    ``planner.profiling.overhead_probe`` measured it) price the predictions; ``previous_sharing`` (one
    microbatch in flight, no message costs) is the model before them, and ``bare_messages`` the model
    before the executor probe, priced beside it."""

    sharing: Any
    messages: Any
    previous_sharing: Any
    bare_messages: Any = None  # ``messages`` without the executor probe's costs (the model before them)


def profile_cpu(path: Path, *, p2p: bool = False, sharing: bool = False, warm: bool = False) -> Path:
    """A single-thread profile of this CPU, calibrated on the benchmark model's own blocks; with
    ``sharing``, also how fast 1..2 x cores processes computing at once progress here; with ``p2p``,
    gloo's latency, bandwidth and CPU time per message between two local processes. Block passes are
    timed after a cache-evicting sweep (the profile's default), or with ``warm`` in a tight loop (as before).

    The median of the repeats, not the minimum: a step adds up many passes, so it sees their
    typical time on this shared machine, not the best one."""
    from planner.profiling.profile import ProfileSettings, profile_device, write_profile
    torch.set_num_threads(1)
    settings = ProfileSettings(model=MODEL, batch=MICROBATCH, seq=SEQ, matmul_size=512, copy_bytes=32 << 20,
                               repeats=10, p2p=p2p, p2p_sizes=P2P_SIZES, statistic="median", sharing=sharing,
                               sharing_rounds=3, sharing_microbatches=SHARING_MICROBATCHES, executor_steps=10,
                               **({"evict_bytes": 0} if warm else {}))
    return write_profile(profile_device(settings), path)


def local_link(profile: Path) -> dict[str, float]:
    """Gloo between two processes of this machine, as a profile with ``p2p`` measured it."""
    p2p = json.loads(profile.read_text())["p2p"]
    return {"bandwidth_gbps": p2p["bandwidth_gbps"], "latency_ms": p2p["latency_ms"]}


def cluster(profile: Path, efficiencies: list[float], link: dict[str, float]):
    """One host per device, all this CPU's profile; a device's efficiency scale (<= 1) makes it slower."""
    base = json.loads(profile.read_text())["device"]["efficiency"]
    hosts = [{"name": f"cpu{i}", "region": "local", "trust": "operator", "trusted": True,
              "devices": [{"type": str(profile), "count": 1, "efficiency": base * e}]}
             for i, e in enumerate(efficiencies)]
    return parse_cluster({"name": "bench", "hosts": hosts, "links": {"intra_host": link, "default": link}})


def config(schedule: str = "1f1b"):
    from cost_models.training import TrainingConfig
    return TrainingConfig(global_batch=MICROBATCH * NUM_MB, microbatch_size=MICROBATCH, schedule=schedule,
                          optimizer="adam")


def compile_solution(solution, ch, cl, folder: Path, name: str) -> Path:
    from planner.compile import compile_plan
    from planner.plan_values import ModelRef
    from planner.solver.policy import VerificationPolicy
    ref = ModelRef(spec=MODEL, name="bench-gpt", fingerprint=ch.fingerprint, batch=MICROBATCH, seq=SEQ)
    plan = predict(compile_plan(solution, ch, cl, config(solution.schedule), VerificationPolicy(enabled=False), ref))
    return plan.save(folder / f"{name}.json")


def hand_solution(ch, cl, ranges: list[tuple[int, int]]):
    from planner.solver.solution import Solution, SolveReport, StagePlacement
    ids = [d.id for d in cl.devices]
    stages = tuple(StagePlacement(index=k, first_block=lo, last_block=hi, devices=(ids[k],),
                                  microbatches=(NUM_MB,)) for k, (lo, hi) in enumerate(ranges))
    report = SolveReport(method="hand", status="FEASIBLE", objective_ms=0.0, bound_ms=None, gap=None, solve_s=0.0)
    return Solution(stages=stages, verifiers=(), num_microbatches=NUM_MB, schedule="1f1b", predicted_step_ms=0.0,
                    memory_bytes=(), report=report)
