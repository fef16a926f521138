"""Hand-made plans for the runtime tests: a real trace + coarsen, a hand-made Solution, compile_plan.

The cluster is local: ``n`` CPU devices on one trusted host (or, with
``speeds``, devices whose catalog speed differs, for emulated heterogeneity).
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Sequence

import torch

from cost_models.cluster import ClusterSpec
from cost_models.cluster_file import parse_cluster
from cost_models.training import TrainingConfig
from planner.plan import Plan
from planner.plan_values import ModelRef
from planner.simulate import predict
from planner.solver.policy import VerificationPolicy
from planner.solver.solution import (
    Solution,
    SolveReport,
    StagePlacement,
    VerifierPlacement,
)


def local_cluster(n: int, *, device_types: Sequence[str] | None = None, verifier_host: bool = False,
                  untrusted: Sequence[int] = ()) -> ClusterSpec:
    """``n`` devices, one per host ``h<i>`` (all CPU unless ``device_types`` says otherwise), trusted
    except the hosts ``untrusted`` (trust domain ``rented``)."""
    types = list(device_types or ["CPU"] * n)
    hosts = [{"name": f"h{i}", "region": "local", "trust": "rented" if i in untrusted else "operator",
              "trusted": i not in untrusted, "devices": [{"type": t, "count": 1}]} for i, t in enumerate(types)]
    if verifier_host:
        hosts.append({"name": "verifier", "region": "local", "trust": "operator", "trusted": True,
                      "role": "verifier"})
    return parse_cluster({"name": "local", "hosts": hosts,
                                  "links": {"intra_host": {"bandwidth_gbps": 100, "latency_ms": 0.01},
                                            "default": {"bandwidth_gbps": 10, "latency_ms": 0.05}}})


@functools.lru_cache(maxsize=None)
def chain_for(spec: str, *, batch: int, seq: int | None):
    from models.registry import build_model
    from planner.coarsen import coarsen
    from planner.trace import trace

    bundle = build_model(spec, batch=batch, seq=seq, device="meta")
    graph = trace(bundle.module, bundle.example_inputs, name=spec)
    return coarsen(graph)


def make_plan(spec: str, *, microbatch: int, num_microbatches: int, stages: Sequence[tuple[int, int]],
              seq: int | None = None, replicas: dict[int, tuple[int, ...]] | None = None,
              schedule: str = "1f1b", optimizer: str = "sgd",
              verifiers: Sequence[tuple] = (),
              device_types: Sequence[str] | None = None, verifier_host: bool = False,
              verifier_config=None, dtype: str = "float32", recompute: Sequence[int] = (),
              untrusted: Sequence[int] = ()) -> Plan:
    """A compiled plan. ``stages``: (first_block, last_block) per stage; ``replicas``: stage -> microbatch
    counts per replica; ``verifiers``: (boundary, device index, directions[, sender device indices]); devices are numbered in
    stage/replica order, then the verifier host's CPU (``len(devices)``); ``recompute``: the stages whose
    blocks are checkpointed; ``untrusted``: device indices whose hosts are not trusted."""
    from planner.compile import compile_plan

    chain = chain_for(spec, batch=microbatch, seq=seq)
    replicas = replicas or {}
    n_dev = sum(len(replicas.get(k, (num_microbatches,))) for k in range(len(stages)))
    cluster = local_cluster(n_dev, device_types=device_types, verifier_host=verifier_host, untrusted=untrusted)
    ids = [d.id for d in cluster.devices]
    placements, next_dev = [], 0
    for k, (lo, hi) in enumerate(stages):
        counts = replicas.get(k, (num_microbatches,))
        devs = tuple(ids[next_dev:next_dev + len(counts)])
        next_dev += len(counts)
        placements.append(StagePlacement(index=k, first_block=lo, last_block=hi, devices=devs, microbatches=counts,
                                         recompute=k in recompute))
    vplace = tuple(VerifierPlacement(boundary=b, device=ids[d], directions=dirs,
                                     senders=tuple(ids[s] for s in (senders[0] if senders else ())))
                   for b, d, dirs, *senders in verifiers)
    report = SolveReport(method="hand", status="FEASIBLE", objective_ms=0.0, bound_ms=None, gap=None, solve_s=0.0)
    solution = Solution(stages=tuple(placements), verifiers=vplace, num_microbatches=num_microbatches,
                        schedule=schedule, predicted_step_ms=0.0, memory_bytes=(), report=report)
    config = TrainingConfig(global_batch=microbatch * num_microbatches, microbatch_size=microbatch,
                            schedule=schedule, optimizer=optimizer, dtype=dtype, mixed_precision=dtype != "float32")
    policy = VerificationPolicy(enabled=bool(verifiers), trusted_endpoints=False)
    ref = ModelRef(spec=spec, name=spec, fingerprint=chain.fingerprint, batch=microbatch, seq=seq)
    return predict(compile_plan(solution, chain, cluster, config, policy, ref, verifier_config=verifier_config))


def save_plan(plan: Plan, folder: Path, name: str = "plan.json") -> Path:
    return plan.save(Path(folder) / name)



def reference_run(plan: Plan, *, steps: int, seed: int = 0, lr: float | None = None, lr_warmup: int = 0):
    """The unpipelined run the pipeline must reproduce: the whole model on the whole global batch,
    as gradient accumulation over the plan's microbatches in order (the same sums as one full-batch
    backward; accumulating in the pipeline's order keeps Adam's near-zero-gradient elements comparable).

    Returns (loss per step, gradients of the last step by name, parameters after the last step).
    """
    from models.registry import build_model, loss_fn
    from planner.runtime.data import make_source
    from planner.runtime.rank.precision import LossScaler, Precision
    from planner.runtime.rank.rank_setup import make_lr_warmup, make_optimizer

    torch.set_num_threads(1)
    ref = plan.model
    bundle = build_model(ref.spec, batch=plan.config.microbatch_size, seq=ref.seq, device="cpu", seed=seed)
    model, source, loss_of = bundle.module, make_source(bundle, seq=ref.seq, seed=seed), loss_fn(bundle)
    opt = make_optimizer(plan.config.optimizer, list(model.parameters()), lr=lr)
    warmup = make_lr_warmup(opt, lr_warmup)
    precision = Precision.of(plan.config.dtype)  # the whole model under autocast, fp32 master weights
    scaler = LossScaler() if precision.scaled else None
    losses, grads = [], {}
    for step in range(steps):
        inputs, targets = source.batch(step, plan.config.global_batch)
        mbs, total = plan.config.microbatch_size, 0.0
        for lo in range(0, plan.config.global_batch, mbs):
            with precision.autocast(torch.device("cpu")):
                loss = loss_of(model(*(t[lo:lo + mbs] for t in inputs)), targets[lo:lo + mbs]) / plan.num_microbatches
            (loss * (scaler.scale if scaler else 1.0)).backward()
            total += float(loss.detach())
        losses.append(total)
        # every name of a tied parameter (a stage may know it by either)
        if scaler is not None:
            overflow = scaler.unscale(list(model.parameters()))
            scaler.update(overflow)
            assert not overflow, "the reference overflowed: pick a case that does not"
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
        opt.step()
        opt.zero_grad(set_to_none=True)
        if warmup is not None:
            warmup.step()
    clones: dict[int, torch.Tensor] = {}  # aliases of a tied parameter share one clone (compare by id)
    params = {n: clones.setdefault(id(p), p.detach().clone())
              for n, p in model.named_parameters(remove_duplicate=False)}
    return losses, grads, params


def load_dumps(folder: Path, num_ranks: int) -> list[dict]:
    return [torch.load(Path(folder) / f"rank{r}.pt") for r in range(num_ranks)]


def tied_gpt():
    """A model factory with weight tying across the first and last stage (embedding = LM head)."""
    from models.gpt import GPT, GPTConfig
    return GPT(GPTConfig(vocab_size=256, max_seq=16, n_layers=2, d_model=32, n_heads=2, tie_weights=True))
