"""The CPU cost of verification at realistic widths (``verification.py``): one stage's two checks against its
forward + backward, and the replicas' contribution checks against a replica's step."""
from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from benchmarks._verification_emulation import plan_default_config
from planner.integrity import contributions as contrib
from planner.integrity import robust_reduce
from planner.integrity.verifier import Verifier

__all__ = ["check_cost", "contribution_cost"]


def check_cost(widths: tuple[int, ...], *, seq: int = 128, microbatch: int = 4, layers: int = 3,
               steps: int = 8) -> list[dict[str, Any]]:
    """CPU time of one stage (``layers`` GPT blocks) forward + backward per microbatch, against
    the two checks its outputs get (activation out, gradient out; the link test included)."""
    from models.gpt import GPTBlock, GPTConfig

    rows = []
    for d in widths:
        cfg = GPTConfig(vocab_size=256, max_seq=seq, n_layers=layers, d_model=d, n_heads=max(1, d // 64))
        stage = torch.nn.Sequential(*[GPTBlock(cfg) for _ in range(layers)])
        verifier = Verifier(plan_default_config(), [(0, "act"), (1, "act"), (0, "grad"), (1, "grad")])
        compute = checks = 0.0
        timed = 0
        for step in range(steps):
            for mb in range(4):
                x = torch.randn(microbatch, seq, d, requires_grad=True)
                t0 = time.process_time()
                y = stage(x)
                y.backward(torch.randn_like(y) * 1e-3)
                t1 = time.process_time()
                verifier.check(0, "act", x.detach(), step=step, mb=mb, sender=0)
                t2 = time.process_time()
                verifier.check(1, "act", y.detach(), step=step, mb=mb, sender=1)
                verifier.check(1, "grad", torch.randn_like(y) * 1e-3, step=step, mb=mb, sender=2)
                t3 = time.process_time()
                verifier.check(0, "grad", x.grad, step=step, mb=mb, sender=1)
                t4 = time.process_time()
                if step >= steps // 2:         # fences ready: the steady-state cost
                    compute += t1 - t0
                    checks += (t2 - t1) / 2 + (t4 - t3) + (t3 - t2) / 2
                    timed += 1
            verifier.end_step(step, [verifier.flag_events(step)])
        rows.append({"d_model": d, "seq": seq, "microbatch": microbatch, "layers_per_stage": layers,
                     "stage_fwd_bwd_ms": round(1e3 * compute / timed, 2),
                     "checks_ms": round(1e3 * checks / timed, 2), "overhead": round(checks / compute, 4)})
    return rows


def contribution_cost(widths: tuple[int, ...], *, seq: int = 128, microbatch: int = 4, layers: int = 3,
                      microbatches: int = 4, replicas: int = 2, steps: int = 6) -> list[dict[str, Any]]:
    """Issue 37's checks of a replicated stage (``layers`` GPT blocks, ``microbatches`` a replica a step)
    against a replica's forwards + backwards of a step, CPU time: the sketch each replica makes of its
    gradient contribution, the lead verifier's judgement of ``replicas`` sketches, and the optional robust
    sum (centered clipping of ``replicas`` contributions, per replica)."""
    from models.gpt import GPTBlock, GPTConfig

    rows = []
    for d in widths:
        cfg = GPTConfig(vocab_size=256, max_seq=seq, n_layers=layers, d_model=d, n_heads=max(1, d // 64))
        stage = torch.nn.Sequential(*[GPTBlock(cfg) for _ in range(layers)])
        monitor = contrib.ContributionMonitor(seed=0)
        seed = contrib.sketch_seed(0, 1)
        times: dict[str, list[float]] = {"compute": [], "sketch": [], "judge": [], "robust": []}
        reference, radius = None, None   # the runtime's: the EMA of past robust sums (its first step: the median)
        for step in range(steps):
            t0 = time.process_time()
            for _ in range(microbatches):
                x = torch.randn(microbatch, seq, d, requires_grad=True)
                stage(x).backward(torch.randn(microbatch, seq, d) * 1e-3)
            t1 = time.process_time()
            flat = torch.cat([p.grad.reshape(-1) for p in stage.parameters()])
            t2 = time.process_time()
            mine = contrib.sketch(flat, seed=seed)
            t3 = time.process_time()
            peers = [flat + 1e-3 * torch.randn_like(flat) for _ in range(replicas - 1)]
            sketches = {0: mine, **{r + 1: contrib.sketch(c, seed=seed) for r, c in enumerate(peers)}}
            t4 = time.process_time()
            monitor.judge(1, sketches, step=step)
            t5 = time.process_time()
            robust_reduce.centered_clip([flat, *peers], reference=reference, history_radius=radius)
            t6 = time.process_time()
            reference, radius = flat.clone(), float(flat.norm())
            stage.zero_grad(set_to_none=True)
            if step >= 1:   # the first warms up
                for key, dt in (("compute", t1 - t0), ("sketch", t3 - t2), ("judge", t5 - t4), ("robust", t6 - t5)):
                    times[key].append(1e3 * dt)
        med = {key: statistics.median(v) for key, v in times.items()}
        rows.append({"d_model": d, "params": flat.numel(), "replicas": replicas,
                     "microbatches_per_replica": microbatches, "replica_step_compute_ms": round(med["compute"], 1),
                     "sketch_ms": round(med["sketch"], 2), "judge_ms": round(med["judge"], 2),
                     "robust_sum_ms": round(med["robust"], 2),
                     "overhead": round((med["sketch"]) / med["compute"], 4),
                     "overhead_robust": round((med["sketch"] + med["robust"]) / med["compute"], 4)})
    return rows
