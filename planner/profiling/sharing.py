"""How fast single-thread processes that compute at once progress, each relative to one alone (CoreSharing)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np

from cost_models.measured import CoreSharing, sharing_speeds
from models.registry import build_model
from planner.errors import RankFailureError


def _sharing_worker() -> None:
    """One process of :func:`measure_core_sharing` (run as ``python -c``, arguments model, batch, seq and
    microbatches ``m``): ``m`` forwards of the model held at once, then their backwards, one thread, as
    many times as fit in each window read from stdin (``start window_s`` on the machine-wide monotonic
    clock); it answers each with its rate (microbatches' passes per second)."""
    import torch

    model, batch, seq = sys.argv[1], int(sys.argv[2]), None if sys.argv[3] == "-" else int(sys.argv[3])
    microbatches = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    torch.set_num_threads(1)
    bundle = build_model(model, batch=batch, seq=seq, device="cpu")
    module, inputs = bundle.module.train(), bundle.example_inputs

    def one_pass() -> None:
        outs = [module(*inputs) for _ in range(microbatches)]  # activations of m microbatches in flight
        for out in outs:
            (out if out.dim() == 0 else out.float().square().mean()).backward()
        module.zero_grad(set_to_none=True)

    one_pass()  # warm-up: allocations and kernel choices
    print("ready", flush=True)
    for line in sys.stdin:
        start, window_s = (float(x) for x in line.split())
        time.sleep(max(0.0, start - time.perf_counter()))
        passes, end = 0, start + window_s
        while (now := time.perf_counter()) < end:
            one_pass()
            passes += 1
        print(passes / (now - start), flush=True)


def measure_core_sharing(*, model: str, batch: int, seq: int | None, processes: int, window_s: float,
                         rounds: int, timeout_s: float = 120.0, microbatches: int = 1) -> CoreSharing:
    """Per-process progress of ``k = 1..processes`` single-thread processes computing at once (the
    model's forwards and backwards in a loop, ``microbatches`` in flight), each as a fraction of one
    alone (:class:`~cost_models.measured.CoreSharing`). Rounds go through every ``k`` in turn, each ratio against the same
    round's lone process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([os.getcwd(), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [sys.executable, "-c", "from planner.profiling.sharing import _sharing_worker; _sharing_worker()",
           model, str(batch), "-" if seq is None else str(seq), str(microbatches)]
    procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for _ in range(processes)]
    try:
        for proc in procs:
            _sharing_reply(proc, timeout_s)
        rates: list[list[float]] = []
        for _ in range(rounds):
            row = []
            for k in range(1, processes + 1):
                start = time.perf_counter() + 0.2
                for proc in procs[:k]:
                    proc.stdin.write(f"{start} {window_s}\n")
                    proc.stdin.flush()
                row.append(float(np.mean([float(_sharing_reply(proc, timeout_s + window_s)) for proc in procs[:k]])))
            rates.append(row)
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate()
    return CoreSharing(cores=os.cpu_count() or 1, speed=sharing_speeds(rates, [row[0] for row in rates]),
                       window_s=window_s, rounds=rounds, microbatches=microbatches)


def _sharing_reply(proc: subprocess.Popen, timeout_s: float) -> str:
    """The next line a sharing worker prints, or a RankFailureError if it dies or stays silent."""
    import select
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        err = (proc.communicate()[1] or "").strip().splitlines() or ["no output"]
        raise RankFailureError("core sharing probe worker", expected=f"a reply within {timeout_s:.0f} s",
                               found=err[-1], fix="check that the model spec imports from this directory")
    return line.strip()
