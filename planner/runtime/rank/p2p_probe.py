"""Point-to-point probe: ping-pong between two processes over torch.distributed.

Run once per rank by ``planner.profiling.probes.measure_p2p`` (cost models may not
import ``torch.distributed``; only ``planner/runtime`` does)::

    python -m planner.runtime.rank.p2p_probe --rank R --world-size 2 \\
        --init-method tcp://127.0.0.1:PORT --backend gloo --sizes 1024,1048576 --repeats 5

For each message size rank 0 sends, rank 1 receives and sends it back; half
the median round trip is the one-way time. Then (``--posts N``), per size,
the CPU time a message costs each end as the runtime posts it (with
``planner.runtime.wire.comm.send``/``recv``): a receive posted before the peer
sends and a send posted after the peer has posted its receive, ``N`` of each,
each right after an untimed sweep over ``--evict-bytes`` (the runtime posts
right after a pass has filled the caches), rank 0 in both roles in turn.
Rank 0 prints one JSON line on stdout: ``{"backend": ..., "points":
[{"bytes": n, "one_way_ms": t}, ...], "posting": [{"bytes": n, "send_ms": ...,
"recv_ms": ..., "send_cpu_ms": ..., "recv_cpu_ms": ...}, ...]}``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from planner.runtime.wire import comm
from planner.runtime.wire.comm import Kind


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m planner.runtime.rank.p2p_probe")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--init-method", required=True)
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--sizes", required=True, help="comma-separated message sizes in bytes")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument("--posts", type=int, default=0, help="messages posted back to back per size and role "
                                                        "to time posting (0: do not)")
    p.add_argument("--post-sizes", default=None, help="comma-separated message sizes to time posting at "
                                                      "(default: --sizes)")
    p.add_argument("--evict-bytes", type=int, default=4 << 20,
                   help="bytes swept before each timed post, as a pass leaves the caches (default 4 MiB)")
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


def _posting_ms(nbytes: int, rank: int, posts: int, repeats: int, device: torch.device,
                evict_bytes: int) -> dict[str, float]:
    """Per message of ``nbytes`` (rank 0's view; rank 1 plays the other side): the median CPU ms the
    posting thread spends posting one send (``send_ms``) and one receive (``recv_ms``) with the runtime's
    ``comm.send``/``comm.recv``, and the process CPU time (every thread: gloo's own move the bytes) from
    posting to completion per message, on the sending (``send_cpu_ms``) and the receiving side
    (``recv_cpu_ms``), median over rounds. The runtime posts right after a pass has filled the caches
    with its tensors, so before each post an untimed sweep over ``evict_bytes`` does the same here. The
    receiver posts all its receives first, so each send finds its receive posted, as the runtime's
    prefetched receives let it."""
    numel = max(nbytes // 4, 1)
    src = torch.ones(numel, dtype=torch.float32, device=device)
    scratch = torch.ones(max(evict_bytes // 4, 1), dtype=torch.float32, device=device)
    send_ms, recv_ms, send_cpu, recv_cpu = [], [], [], []

    def posted(post: Callable[[int], comm.Pending], works: list, times: list[float]) -> float:
        """Post ``posts`` messages, each after a sweep; the sweeps' CPU seconds."""
        swept = 0.0
        for p in range(posts):
            c0 = time.thread_time()
            scratch.mul_(1.0)
            c1 = time.thread_time()
            works.append(post(p))
            times.append(1e3 * (time.thread_time() - c1))
            swept += c1 - c0
        return swept

    for i in range(2 * (repeats + 1)):
        sender = i % 2  # alternate roles: rank 0 times both its sends and its receives
        works: list[comm.Pending] = []
        times: list[float] = []
        cpu = 0.0
        if rank != sender:
            c0 = time.process_time()
            swept = posted(lambda p: comm.recv([((numel,), torch.float32)], peer=sender, kind=Kind.ACT, boundary=0,
                                               mb=p, device=device, doing="probing the cost of a receive"),
                           works, times)
            cpu += time.process_time() - c0 - swept
        dist.barrier()  # its CPU time is not the messages'
        c0 = time.process_time()
        swept = 0.0
        if rank == sender:
            swept = posted(lambda p: comm.send([src], peer=1 - sender, kind=Kind.ACT, boundary=0, mb=p,
                                               doing="probing the cost of a send"), works, times)
        for work in works:
            work.wait()
        cpu += time.process_time() - c0 - swept
        dist.barrier()
        if i >= 2:  # the first round of each role warms up
            (send_ms if rank == sender else recv_ms).extend(times)
            (send_cpu if rank == sender else recv_cpu).append(1e3 * max(cpu, 0.0) / posts)
    return {"send_ms": statistics.median(send_ms), "recv_ms": statistics.median(recv_ms),
            "send_cpu_ms": statistics.median(send_cpu), "recv_cpu_ms": statistics.median(recv_cpu)}


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
        posting = []
        post_sizes = [int(s) for s in args.post_sizes.split(",") if s] if args.post_sizes else sizes
        for nbytes in post_sizes if args.posts > 0 else ():
            posting.append({"bytes": max(nbytes // 4, 1) * 4,
                            **_posting_ms(nbytes, args.rank, args.posts, args.repeats, device, args.evict_bytes)})
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if args.rank == 0:
        print(json.dumps({"backend": args.backend, "device": str(device), "points": points,
                          "posting": posting}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
