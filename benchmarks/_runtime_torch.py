"""The runtime benchmark's baseline: the same split with torch.distributed.pipelining's Schedule1F1B."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._runtime_setup import MICROBATCH, MODEL, NUM_MB, SEQ

__all__ = ["run_torch_pipelining", "torch_worker"]


ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).with_name("runtime.py")  # the benchmark, whose --torch-worker runs a rank


def run_torch_pipelining(steps: int, split_layer: int) -> dict[str, Any]:
    """The same split with torch.distributed.pipelining's Schedule1F1B, two processes."""
    from planner.runtime.launcher.launch import free_port
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        procs = [subprocess.Popen([sys.executable, str(SCRIPT), "--torch-worker", tmp, "--steps", str(steps),
                                   "--split", str(split_layer)], env={**env, "RANK": str(r)}) for r in range(2)]
        for p in procs:
            if p.wait(timeout=600) != 0:
                raise RuntimeError("torch.distributed.pipelining worker failed")
        per_rank = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(2)]
    step_ms = [max(vals) for vals in zip(*(r["wall"] for r in per_rank))]
    cpu_ms = [sum(vals) for vals in zip(*(r["cpu"] for r in per_rank))]
    return {"measured_ms": statistics.median(step_ms[1:]), "step_ms": [round(s, 3) for s in step_ms],
            "cpu_ms": statistics.median(cpu_ms[1:])}


def torch_worker(out_dir: str, steps: int, split_layer: int) -> None:
    """One rank of the torch.distributed.pipelining baseline (started by run_torch_pipelining)."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from models.registry import build_model, lm_loss
    from planner.runtime.data import make_source

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    bundle = build_model(MODEL, batch=MICROBATCH, seq=SEQ, device="cpu", seed=0)
    model = bundle.module
    layers = list(model.layers)

    class Part(nn.Module):
        def __init__(self, first: bool) -> None:
            super().__init__()
            self.first = first
            self.embed = model.embed if first else None
            self.layers = nn.ModuleList(layers[:split_layer] if first else layers[split_layer:])
            self.head = None if first else model.head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.embed(x) if self.first else x
            for layer in self.layers:
                x = layer(x)
            return x if self.first else self.head(x)

    part = Part(rank == 0)
    act = torch.empty(MICROBATCH, SEQ, 128, device="meta", requires_grad=True)
    idx = torch.empty(MICROBATCH, SEQ, dtype=torch.long, device="meta")
    logits = torch.empty(MICROBATCH, SEQ, 256, device="meta", requires_grad=True)
    stage = PipelineStage(part, rank, 2, torch.device("cpu"), input_args=(idx,) if rank == 0 else (act,),
                          output_args=act if rank == 0 else logits)
    schedule = Schedule1F1B(stage, n_microbatches=NUM_MB, loss_fn=lm_loss)
    opt = torch.optim.Adam(part.parameters(), lr=1e-3)
    source = make_source(bundle, seq=SEQ, seed=0)
    times, cpu, last, last_cpu = [], [], time.perf_counter(), time.process_time()
    for step in range(steps):
        (x,), y = source.batch(step, MICROBATCH * NUM_MB)
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        now, now_cpu = time.perf_counter(), time.process_time()
        times.append(1e3 * (now - last))
        cpu.append(1e3 * (now_cpu - last_cpu))
        last, last_cpu = now, now_cpu
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps({"wall": times, "cpu": cpu}))
    dist.barrier()
    dist.destroy_process_group()
