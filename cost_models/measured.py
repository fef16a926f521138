"""What a device profile measured, as values, the fits that make them from raw timings, and their loaders.

- :class:`BlockSample` and :class:`Calibration`: measured blocks beside the figures the cost model prices
  them from, and the ``efficiency`` / ``op_overhead_ms`` fitted to them (:func:`fit_calibration`);
- :class:`P2PResult` and :class:`MessageCost`: point-to-point latency and bandwidth (:func:`fit_p2p`) and
  the CPU time a message costs its two ends (:func:`fit_message_cost`, :func:`with_executor_cost`);
- :class:`CoreSharing`: how fast processes that compute at once on one machine progress
  (:func:`sharing_speeds`);
- :func:`load_sharing` / :func:`load_message_cost`: those tables from a profile document.

Nothing here times hardware (``planner.profiling`` alone does); the simulator and the CLI use these
values without importing the measuring code.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from cost_models.compute import BWD_OPS_FACTOR, BWD_TRAFFIC_FACTOR
from planner.errors import InvalidInputError


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockSample:
    """A measured block beside the figures the cost model prices it from."""

    name: str
    fwd_ms: float
    bwd_ms: float
    fwd_flops: int
    bwd_flops: int
    mem_traffic_bytes: int
    n_ops: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Calibration:
    """Fitted ``efficiency`` and ``op_overhead_ms``, and how well they fit (relative errors).

    ``peak_scale`` (>= 1) multiplies the peak the fit was given: blocks that ran
    faster than that peak allows mean the matmul that measured it was disturbed
    (another process) or too small to reach it. The peak then becomes what the
    blocks reached and ``efficiency`` is 1, which prices every block exactly as
    the fit does; clamping the efficiency to 1 instead would price every block
    slower than measured (and a device scaled down from it would not be as slow
    as meant).
    """

    efficiency: float
    op_overhead_ms: float
    median_abs_rel_err: float
    max_abs_rel_err: float
    n_samples: int
    peak_scale: float = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class MessageCost:
    """CPU time a point-to-point message costs the processes at its two ends, beyond its time on the wire:
    posting it and moving its bytes through the backend (gloo's threads, the kernel's socket copies).

    ``send_ms + nbytes * send_ms_per_mib / 2**20`` on the sender, likewise ``recv_*`` on the receiver,
    fitted over message sizes (:func:`fit_message_cost`) of what ``planner.runtime.rank.p2p_probe`` measures:
    messages posted with the runtime's own calls, each right after a sweep that leaves the caches as
    a pass does (posting from cold caches costs a few times what a tight loop of posts does). Ranks that
    share a machine's cores pay it out of their compute (``planner.simulate.simulate(plan, messages=...)``).

    ``executor_ms`` and ``executor_pass_ms``: what the runtime's executor itself costs on top, per message
    instruction (its bookkeeping around each post, and what its messages cost the process beyond the bare
    probe's) and per forward/backward pass (preparing inputs, prefetching, freeing, the step's metrics), as
    ``planner.profiling.overhead_probe`` measures it running a small plan (:func:`with_executor_cost`);
    0 in profiles taken before that probe existed.
    """

    send_ms: float
    recv_ms: float
    send_ms_per_mib: float = 0.0
    recv_ms_per_mib: float = 0.0
    executor_ms: float = 0.0
    executor_pass_ms: float = 0.0

    def __post_init__(self) -> None:
        values = (self.send_ms, self.recv_ms, self.send_ms_per_mib, self.recv_ms_per_mib, self.executor_ms,
                  self.executor_pass_ms)
        if any(not (v >= 0.0) for v in values):  # also rejects NaN
            raise InvalidInputError("message CPU costs", expected="ms >= 0", found=repr(values),
                                    fix="measure them again (stagewise profile)")

    def send_cpu_ms(self, nbytes: float) -> float:
        return self.send_ms + nbytes * self.send_ms_per_mib / 2**20

    def recv_cpu_ms(self, nbytes: float) -> float:
        return self.recv_ms + nbytes * self.recv_ms_per_mib / 2**20

    def to_dict(self) -> dict[str, float]:
        return {"send_ms": self.send_ms, "recv_ms": self.recv_ms, "send_ms_per_mib": self.send_ms_per_mib,
                "recv_ms_per_mib": self.recv_ms_per_mib, "executor_ms": self.executor_ms,
                "executor_pass_ms": self.executor_pass_ms}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> "MessageCost":
        try:
            return cls(send_ms=float(doc["send_ms"]), recv_ms=float(doc["recv_ms"]),
                       send_ms_per_mib=float(doc.get("send_ms_per_mib", 0.0)),
                       recv_ms_per_mib=float(doc.get("recv_ms_per_mib", 0.0)),
                       executor_ms=float(doc.get("executor_ms", 0.0)),
                       executor_pass_ms=float(doc.get("executor_pass_ms", 0.0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidInputError("message CPU costs", expected="{send_ms, recv_ms, ...}",
                                    found=repr(doc)[:120]) from exc


@dataclass(frozen=True, slots=True, kw_only=True)
class P2PResult:
    backend: str
    bandwidth_gbps: float
    latency_ms: float
    points: tuple[tuple[int, float], ...]  # (bytes, one-way ms)
    messages: MessageCost | None = None
    posting: tuple[dict[str, float], ...] = ()  # the probe's per-size posting and CPU measurements
    executor: dict[str, Any] | None = None  # planner.profiling.overhead_probe's report (MessageCost.executor_*)


@dataclass(frozen=True, slots=True, kw_only=True)
class CoreSharing:
    """How fast passes progress when ``k`` single-thread processes compute at once on one machine.

    ``speed[k - 1]`` is each process's rate with ``k`` computing, as a fraction of one process
    computing alone (so ``speed[0] == 1``), measured on a machine with ``cores`` processors. Even
    processor sharing would be ``min(1, cores / k)``; measured rates are lower where cores share
    an execution unit (hyperthreads), caches or memory bandwidth, and where more processes than
    cores pay for switching. Past the table, the last measured aggregate rate is shared evenly.
    """

    cores: int
    speed: tuple[float, ...]
    window_s: float = 0.0
    rounds: int = 0
    microbatches: int = 1  # in flight in each probe process (see ProfileSettings.sharing_microbatches)

    def __post_init__(self) -> None:
        if isinstance(self.cores, bool) or not isinstance(self.cores, int) or self.cores < 1:
            raise InvalidInputError("core sharing cores", expected="a whole number >= 1", found=repr(self.cores))
        if not self.speed or any(not (0.0 < v <= 1.0 + 1e-9) for v in self.speed) or abs(self.speed[0] - 1.0) > 1e-9:
            raise InvalidInputError("core sharing speeds", expected="1.0 for one process, then rates in (0, 1]",
                                    found=repr(self.speed), fix="measure them again (stagewise profile --sharing)")

    def rate(self, computing: int) -> float:
        """Each pass's progress (per ms of a pass alone) while ``computing`` passes compute at once."""
        if computing <= 0:
            return 0.0
        if computing <= len(self.speed):
            return self.speed[computing - 1]
        return self.speed[-1] * len(self.speed) / computing

    def to_dict(self) -> dict[str, Any]:
        return {"cores": self.cores, "speed": list(self.speed), "window_s": self.window_s, "rounds": self.rounds,
                "microbatches": self.microbatches}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> "CoreSharing":
        try:
            return cls(cores=doc["cores"], speed=tuple(float(v) for v in doc["speed"]),
                       window_s=float(doc.get("window_s", 0.0)), rounds=int(doc.get("rounds", 0)),
                       microbatches=int(doc.get("microbatches", 1)))
        except (KeyError, TypeError) as exc:
            raise InvalidInputError("core sharing table", expected="{cores, speed: [...]}",
                                    found=repr(doc)[:120]) from exc


def sharing_speeds(rates: Sequence[Sequence[float]], alone: Sequence[float]) -> tuple[float, ...]:
    """Per-process speeds from measured rounds: ``rates[r][k - 1]`` is the mean per-process pass rate of
    round ``r`` with ``k`` processes, ``alone[r]`` that round's rate of one. Each round's ratios, then
    their median (rounds are short and this host's speed drifts between them); capped at 1, since
    company never speeds a process up, and made non-increasing in ``k``."""
    if not rates or len(rates) != len(alone) or any(a <= 0 for a in alone):
        raise InvalidInputError("core sharing rounds", expected="one alone rate > 0 per round", found=repr(alone))
    ratios = np.array([[min(r / a, 1.0) for r in row] for row, a in zip(rates, alone)])
    speed = np.median(ratios, axis=0)
    speed[0] = 1.0
    return tuple(float(v) for v in np.minimum.accumulate(speed))


# --- fits ---------------------------------------------------------------------
def _fit_terms(samples: Sequence[BlockSample], peak_flops: float, mem_bw: float
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per measurement (forward and backward of every block): compute ms at efficiency 1, memory ms, ops, ms."""
    x, m, n, y = [], [], [], []
    for s in samples:
        x += [1e3 * s.fwd_flops / peak_flops, 1e3 * s.bwd_flops / peak_flops]
        m += [1e3 * s.mem_traffic_bytes / mem_bw, 1e3 * BWD_TRAFFIC_FACTOR * s.mem_traffic_bytes / mem_bw]
        n += [s.n_ops, BWD_OPS_FACTOR * s.n_ops]
        y += [s.fwd_ms, s.bwd_ms]
    return np.array(x), np.array(m), np.array(n), np.array(y)


def _log_err(eff: np.ndarray, ovh: np.ndarray, x: np.ndarray, m: np.ndarray, n: np.ndarray,
             y: np.ndarray) -> np.ndarray:
    pred = np.maximum(x[None, None, :] / eff[:, None, None], m[None, None, :]) + ovh[None, :, None] * n[None, None, :]
    return np.sum(np.log(np.maximum(pred, 1e-9) / y[None, None, :]) ** 2, axis=2)


def fit_calibration(samples: Sequence[BlockSample], *, peak_flops: float, mem_bw_bytes_per_s: float) -> Calibration:
    """Efficiency and per-op overhead minimising the squared log error of predicted block times.

    The model is exactly ``cost_models.compute``'s: ``max(flops / (peak * eff),
    traffic / bw) + ops * overhead``. A coarse log grid, then a fine one around
    the best point: robust, no derivatives, and cheap for tens of blocks. An
    efficiency above 1 is returned as ``efficiency=1`` and ``peak_scale`` (see
    :class:`Calibration`).
    """
    if not samples:
        raise InvalidInputError("calibration samples", expected="at least one measured block", found="none")
    x, m, n, y = _fit_terms(samples, peak_flops, mem_bw_bytes_per_s)
    if np.any(y <= 0):
        raise InvalidInputError("measured block times", expected="> 0 ms", found=repr(y.min()))
    eff = np.logspace(-3, 1, 121)
    ovh = np.concatenate(([0.0], np.logspace(-5, 1, 121)))
    err = _log_err(eff, ovh, x, m, n, y)
    i, j = np.unravel_index(np.argmin(err), err.shape)
    fine_eff = np.clip(eff[i] * np.logspace(-0.04, 0.04, 41), 1e-3, 10.0)
    fine_ovh = ovh[j] * np.logspace(-0.03, 0.03, 41) if ovh[j] > 0 else np.concatenate(([0.0], np.logspace(-6, -5, 11)))
    err = _log_err(fine_eff, fine_ovh, x, m, n, y)
    i, j = np.unravel_index(np.argmin(err), err.shape)
    best_eff, best_ovh = float(fine_eff[i]), float(fine_ovh[j])
    pred = np.maximum(x / best_eff, m) + best_ovh * n
    rel = np.abs(pred - y) / y
    return Calibration(efficiency=min(best_eff, 1.0), op_overhead_ms=best_ovh,
                       median_abs_rel_err=float(np.median(rel)), max_abs_rel_err=float(rel.max()),
                       n_samples=int(y.size), peak_scale=max(best_eff, 1.0))


def fit_p2p(points: Sequence[tuple[int, float]], backend: str) -> P2PResult:
    """Latency and bandwidth from (bytes, one-way ms) points by least squares ``t = lat + bytes / bw`` in relative
    error (each point weighted by ``1 / t``): in absolute error the largest message's noise sets the intercept
    (three profiles of one quiet machine fitted 0.07-0.36 ms where its 1 KiB message took 0.048-0.070 ms)."""
    if len(points) < 2 or len({b for b, _ in points}) < 2:
        raise InvalidInputError("p2p points", expected="two or more message sizes", found=repr(points))
    b = np.array([p[0] for p in points], dtype=float)
    t = np.array([p[1] for p in points], dtype=float)
    slope, intercept = np.polyfit(b, t, 1, w=1.0 / np.maximum(t, 1e-9))
    if intercept < 0 or slope <= 0:
        # Noise swamped the line: latency from the smallest message, and (conservatively)
        # the whole time of the largest one as transfer time.
        intercept = float(t[np.argmin(b)])
        slope = float(t[np.argmax(b)] / b.max())
    bandwidth_gbps = 8.0 / (slope * 1e-3) / 1e9
    return P2PResult(backend=backend, bandwidth_gbps=float(bandwidth_gbps), latency_ms=float(intercept),
                     points=tuple((int(p[0]), float(p[1])) for p in points))


def _nonneg_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least-squares ``y = a + b x`` with ``a, b >= 0``: where the free fit makes one negative (noise),
    that term is 0 and the other is refitted alone."""
    if len(set(x.tolist())) >= 2:
        b, a = np.polyfit(x, y, 1)
        if a >= 0 and b >= 0:
            return float(a), float(b)
    through_origin = float(max(np.dot(x, y) / np.dot(x, x), 0.0)) if np.dot(x, x) > 0 else 0.0
    flat = float(max(np.mean(y), 0.0))
    err_origin = float(np.sum((y - through_origin * x) ** 2))
    err_flat = float(np.sum((y - flat) ** 2))
    return (0.0, through_origin) if err_origin < err_flat else (flat, 0.0)


def fit_message_cost(posting: Sequence[dict[str, float]]) -> MessageCost:
    """A :class:`MessageCost` from the probe's per-size measurements (``bytes``, ``send_cpu_ms``,
    ``recv_cpu_ms``: process CPU time per message on each side): a line in the size on each side."""
    if not posting:
        raise InvalidInputError("message CPU measurements", expected="at least one message size", found="none")
    mib = np.array([float(p["bytes"]) for p in posting]) / 2**20
    send = _nonneg_line(mib, np.array([float(p["send_cpu_ms"]) for p in posting]))
    recv = _nonneg_line(mib, np.array([float(p["recv_cpu_ms"]) for p in posting]))
    return MessageCost(send_ms=send[0], send_ms_per_mib=send[1], recv_ms=recv[0], recv_ms_per_mib=recv[1])


def with_executor_cost(messages: MessageCost, report: dict[str, Any]) -> MessageCost:
    """``messages`` with the executor probe's costs: per message instruction, the CPU its messages cost the
    probe's processes (the executor thread posting them, the backend's threads) beyond what ``messages``
    prices for a bare message of that size (mean of the two ends; never below 0), and per pass, the
    executor's bookkeeping."""
    nbytes = float(report["message_bytes"])
    bare = 0.5 * (messages.send_cpu_ms(nbytes) + messages.recv_cpu_ms(nbytes))
    per_message = float(report["comm_cpu_per_message_ms"]) + float(report["backend_cpu_per_message_ms"])
    return replace(messages, executor_ms=max(per_message - bare, 0.0),
                   executor_pass_ms=max(float(report["bookkeeping_per_pass_ms"]), 0.0))


def load_sharing(profile: str | Path | dict[str, Any]) -> CoreSharing | None:
    """The core sharing table of a profile (a path or its document); None if it was not measured."""
    doc = profile if isinstance(profile, dict) else json.loads(Path(profile).read_text())
    table = doc.get("sharing")
    return None if table is None else CoreSharing.from_dict(table)


def load_message_cost(profile: str | Path | dict[str, Any]) -> MessageCost | None:
    """The per-message CPU costs of a profile (a path or its document); None if they were not measured."""
    doc = profile if isinstance(profile, dict) else json.loads(Path(profile).read_text())
    table = (doc.get("p2p") or {}).get("messages")
    return None if table is None else MessageCost.from_dict(table)
