"""Measurements run in other processes: the p2p ping-pong between two ranks and the runtime executor's probe."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from typing import Any, Sequence

from cost_models.measured import P2PResult, fit_message_cost, fit_p2p
from planner.errors import RankFailureError


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


POSTING_MAX_BYTES = 1 << 22  # messages timed for their CPU cost: several of each size are in flight at once


def _posting_sizes(sizes: Sequence[int]) -> list[int]:
    """The probe's sizes up to :data:`POSTING_MAX_BYTES` (at least the smallest two): a line through them
    prices activations and gradients, without holding ``posts`` buffers of the largest sizes."""
    ordered = sorted(set(sizes))
    return [s for s in ordered if s <= POSTING_MAX_BYTES] or ordered[:2]


def measure_p2p(*, sizes: Sequence[int], repeats: int, backend: str, timeout_s: float, posts: int = 8) -> P2PResult:
    """Ping-pong between two ``planner.runtime.rank.p2p_probe`` processes, then the CPU time of ``posts``
    messages posted back to back per size and side (0: not measured); rank 0 reports JSON on stdout."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "planner.runtime.rank.p2p_probe", "--world-size", "2",
           "--init-method", f"tcp://127.0.0.1:{port}", "--backend", backend,
           "--sizes", ",".join(str(s) for s in sizes), "--repeats", str(repeats), "--timeout-s", str(timeout_s),
           "--posts", str(posts), "--post-sizes", ",".join(str(s) for s in _posting_sizes(sizes))]
    procs = [subprocess.Popen(cmd + ["--rank", str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for r in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout_s + 30))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
            p.communicate()
        raise RankFailureError("p2p probe", expected=f"two processes finishing within {timeout_s:.0f} s",
                               found="a hang", fix="rerun with --no-p2p to skip the P2P measurement") from None
    for rank, (p, (_, err)) in enumerate(zip(procs, outs)):
        if p.returncode != 0:
            last = (err.strip().splitlines() or ["no output"])[-1]
            raise RankFailureError(f"p2p probe rank {rank}", expected="exit 0",
                                   found=f"exit {p.returncode}: {last}", fix="rerun with --no-p2p to skip it")
    try:
        report = json.loads(outs[0][0].strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        raise RankFailureError("p2p probe rank 0", expected="a JSON report on stdout",
                               found=repr(outs[0][0][-200:])) from None
    result = fit_p2p([(int(p["bytes"]), float(p["one_way_ms"])) for p in report["points"]], report["backend"])
    posting = tuple(report.get("posting") or ())
    if not posting:
        return result
    return P2PResult(backend=result.backend, bandwidth_gbps=result.bandwidth_gbps, latency_ms=result.latency_ms,
                     points=result.points, messages=fit_message_cost(posting), posting=posting)


EXECUTOR_WARMUP_STEPS = 2  # the probe's first steps (start-up, cold caches), left out where it has more


def measure_executor(*, model: str, batch: int, seq: int | None, steps: int, timeout_s: float,
                     microbatches: int = 4) -> dict[str, Any]:
    """Run ``planner.profiling.overhead_probe`` (a 2-stage plan of ``model`` on the real runtime, two gloo
    processes) and return its report: the executor thread's CPU per message instruction posting it
    (``comm_cpu_per_message_ms``), the backend threads' per message (``backend_cpu_per_message_ms``), the
    executor's other CPU per pass (``bookkeeping_per_pass_ms``) and the probe's message size."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "planner.profiling.overhead_probe", "--model", model, "--batch", str(batch),
           "--microbatches", str(microbatches), "--steps", str(steps),
           "--warmup", str(min(EXECUTOR_WARMUP_STEPS, steps - 1)), "--timeout-s", str(timeout_s)]
    if seq is not None:
        cmd += ["--seq", str(seq)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s + 60)
    except subprocess.TimeoutExpired:
        raise RankFailureError("executor probe", expected=f"a run finishing within {timeout_s:.0f} s",
                               found="a hang", fix="rerun with --no-p2p to skip it") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RankFailureError("executor probe", expected="exit 0", found=f"exit {proc.returncode}: {last}",
                               fix="rerun with --no-p2p to skip it")
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        raise RankFailureError("executor probe", expected="a JSON report on stdout",
                               found=repr(proc.stdout[-200:])) from None
