"""Point-to-point probe: ping-pong between two processes over torch.distributed.

Run once per rank by ``cost_models.profile.measure_p2p`` (cost models may not
import ``torch.distributed``; only ``planner/runtime`` does)::

    python -m planner.runtime.p2p_probe --rank R --world-size 2 \\
        --init-method tcp://127.0.0.1:PORT --backend gloo --sizes 1024,1048576 --repeats 5

For each message size rank 0 sends, rank 1 receives and sends it back; half
the median round trip is the one-way time. Rank 0 prints one JSON line on
stdout: ``{"backend": ..., "points": [{"bytes": n, "one_way_ms": t}, ...]}``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m planner.runtime.p2p_probe")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--init-method", required=True)
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--sizes", required=True, help="comma-separated message sizes in bytes")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=60.0)
    return p.parse_args(argv)


def _one_way_ms(buf: torch.Tensor, rank: int, repeats: int, warmup: int) -> float:
    times = []
    for i in range(warmup + repeats):
        if buf.is_cuda:
            torch.cuda.synchronize(buf.device)
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, dst=1)
            dist.recv(buf, src=1)
        else:
            dist.recv(buf, src=0)
            dist.send(buf, dst=0)
        if buf.is_cuda:
            torch.cuda.synchronize(buf.device)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3 / 2.0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.world_size != 2 or args.rank not in (0, 1):
        print("p2p_probe: expected --world-size 2 and --rank 0 or 1", file=sys.stderr)
        return 2
    sizes = [int(s) for s in args.sizes.split(",") if s]
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", args.rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, init_method=args.init_method, rank=args.rank,
                            world_size=args.world_size, timeout=timedelta(seconds=args.timeout_s))
    try:
        points = []
        for nbytes in sizes:
            buf = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=device)
            points.append({"bytes": buf.numel() * 4, "one_way_ms": _one_way_ms(buf, args.rank, args.repeats,
                                                                               args.warmup)})
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if args.rank == 0:
        print(json.dumps({"backend": args.backend, "device": str(device), "points": points}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
