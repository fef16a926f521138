"""Clocks and repeat statistics for the profiler's timings: which clock to read, how to summarise repeats."""
from __future__ import annotations

import time
from typing import Any, Callable, Literal, Sequence

import numpy as np

from planner.errors import InvalidInputError

Clock = Literal["wall", "cpu"]
Statistic = Literal["min", "median"]
STATISTICS: tuple[str, ...] = ("min", "median")


def sync(device: Any) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock_reader(clock: Clock) -> Callable[[], float]:
    """``wall``: elapsed time. ``cpu``: this process's CPU time, which time-sharing with other
    processes does not inflate; it equals the work's duration only with one torch thread on a
    CPU device (for measuring on a shared machine)."""
    if clock == "wall":
        return time.perf_counter
    if clock == "cpu":
        import torch
        if torch.get_num_threads() != 1:
            raise InvalidInputError("cpu clock", expected="torch.get_num_threads() == 1",
                                    found=str(torch.get_num_threads()), fix="set one thread (--threads 1)")
        return time.process_time
    raise InvalidInputError("clock", expected="wall or cpu", found=repr(clock))


def summarize_ms(times: Sequence[float], statistic: Statistic = "min") -> float:
    """``min``: other processes only ever add time, so the minimum is the steadiest estimate of
    what the device itself takes. ``median``: what the same work takes in a typical repeat."""
    if not times:
        raise InvalidInputError("timings", expected="at least one repeat", found="none")
    if statistic == "min":
        return min(times)
    if statistic == "median":
        return float(np.median(times))
    raise InvalidInputError("profile statistic", expected=" or ".join(STATISTICS), found=repr(statistic))


def best_ms(fn: Callable[[], Any], device: Any, repeats: int, warmup: int = 1, clock: Clock = "wall",
            statistic: Statistic = "min") -> float:
    """Fastest of ``repeats`` timed runs (the device's throughput figures are best-case by definition),
    or their ``statistic``."""
    now = clock_reader(clock)
    times = []
    for i in range(warmup + repeats):
        sync(device)
        t0 = now()
        fn()
        sync(device)
        if i >= warmup:
            times.append((now() - t0) * 1e3)
    return summarize_ms(times, statistic)

