"""Cost model accuracy on this CPU: per-block time after calibration, and a stage's peak memory.

1. Calibrate (as ``stagewise profile`` does): measure fp32 matmul throughput and
   copy bandwidth, time every block of the *calibration* models, and fit the
   efficiency and per-op overhead.
2. Time, afresh, every block of the *evaluation* models (gpt-small at another
   batch/sequence than calibration, and llama-tiny, which calibration never
   saw) and compare forward+backward time with ``cost_models.compute``.
   Goal: median absolute error <= 15% per model.
3. Peak memory of one pipeline stage's training step: the middle stage
   (``layers.0..5`` of gpt-small) of a 3-stage 1F1B pipeline, 4 microbatches,
   Adam, emulated in one process in 1F1B order (received activations and
   gradients are random tensors), two optimizer steps. Measured as the peak of
   live tensor storage bytes, tracked op by op with a ``TorchDispatchMode``
   over every storage that ops allocate (plus the parameters), during the
   second step (optimizer state present). Predicted: ``cost_models.memory.
   stage_memory``. Goal: within 20%. (tracemalloc does not see torch's
   allocations; process RSS mixes in the allocator's caching and library
   pages, so it is printed for reference only.)

Run: ``python benchmarks/cost_model.py [--quick]``. Prints tables and writes
``benchmarks/results/cost_model.json``. Timings are noisy on a shared machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import psutil
import torch
from rich.console import Console
from rich.table import Table
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cost_models.compute import block_bwd_ms, block_fwd_ms  # noqa: E402
from cost_models.devices import DeviceSpec  # noqa: E402
from cost_models.memory import in_flight_microbatches, stage_memory  # noqa: E402
from cost_models.profile import (fit_calibration, measure_matmul_flops, measure_memory_bandwidth,  # noqa: E402
                                 model_chain, pair_samples, time_units)
from cost_models.training import TrainingConfig  # noqa: E402
from models.registry import build_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "cost_model.json"
CALIBRATION = (("gpt-small", 1, 32), ("gpt-tiny", 2, 32))
EVALUATION = (("gpt-small", 2, 64), ("llama-tiny", 4, 32))
TIME_GOAL, MEMORY_GOAL = 0.15, 0.20


def _timed_samples(model: str, batch: int, seq: int, repeats: int):
    bundle = build_model(model, batch=batch, seq=seq, device="cpu")
    timings = time_units(bundle.module, bundle.example_inputs, repeats=repeats, device=torch.device("cpu"))
    chain = model_chain(model, batch=batch, seq=seq)
    return chain, pair_samples(chain, timings)


def calibrate(repeats: int, console: Console) -> tuple[DeviceSpec, dict]:
    cpu = torch.device("cpu")
    peak = measure_matmul_flops("float32", size=1024, repeats=repeats, device=cpu)
    bw = measure_memory_bandwidth(nbytes=64 << 20, repeats=repeats, device=cpu)
    samples = []
    for model, batch, seq in CALIBRATION:
        console.log(f"calibration: timing {model} batch {batch} seq {seq}")
        samples += _timed_samples(model, batch, seq, repeats)[1]
    cal = fit_calibration(samples, peak_flops=peak, mem_bw_bytes_per_s=bw)
    spec = DeviceSpec(name="this-cpu", kind="cpu", peak_flops=(("float32", peak),), mem_bytes=1 << 34,
                      mem_bw_bytes_per_s=bw, efficiency=cal.efficiency, op_overhead_ms=cal.op_overhead_ms,
                      measured=True)
    return spec, {"matmul_fp32_flops_per_s": peak, "copy_bytes_per_s": bw, "efficiency": cal.efficiency,
                  "op_overhead_ms": cal.op_overhead_ms, "fit_median_abs_rel_err": cal.median_abs_rel_err,
                  "models": [list(c) for c in CALIBRATION]}


def evaluate_time(spec: DeviceSpec, repeats: int, console: Console) -> list[dict]:
    out = []
    for model, batch, seq in EVALUATION:
        console.log(f"evaluation: timing {model} batch {batch} seq {seq}")
        chain, samples = _timed_samples(model, batch, seq, repeats)
        blocks = {b.name: b for b in chain.blocks}
        rows = []
        for s in samples:
            pred = block_fwd_ms(blocks[s.name], spec) + block_bwd_ms(blocks[s.name], spec)
            meas = s.fwd_ms + s.bwd_ms
            rows.append({"block": s.name, "measured_ms": meas, "predicted_ms": pred, "rel_err": (pred - meas) / meas,
                         "measured_fwd_ms": s.fwd_ms, "measured_bwd_ms": s.bwd_ms,
                         "predicted_fwd_ms": block_fwd_ms(blocks[s.name], spec),
                         "predicted_bwd_ms": block_bwd_ms(blocks[s.name], spec)})
        med = statistics.median(abs(r["rel_err"]) for r in rows)
        out.append({"model": model, "batch": batch, "seq": seq, "median_abs_rel_err": med,
                    "max_abs_rel_err": max(abs(r["rel_err"]) for r in rows), "goal": TIME_GOAL,
                    "meets_goal": med <= TIME_GOAL, "blocks": rows})
    return out


class LiveStorageBytes(TorchDispatchMode):
    """Peak bytes of live tensor storages, checked after every op.

    Every op output's storage is recorded with a weak reference; a storage
    counts until it is freed. Temporaries inside one kernel are not seen.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def track(self, tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                key = st.data_ptr()
                if key and key not in self.live:
                    self.live[key] = (StorageWeakRef(st), st.nbytes())

    def current(self) -> int:
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[key]
        return sum(n for _, n in self.live.values())

    def reset_peak(self) -> None:
        self.peak = self.current()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.track(tree_flatten(out)[0])
        self.peak = max(self.peak, self.current())
        return out


def _one_f_one_b(num_stages: int, stage: int, m: int) -> list[tuple[str, int]]:
    """The order of forward/backward microbatches on one 1F1B stage."""
    warm = min(num_stages - stage - 1, m)
    order = [("F", i) for i in range(warm)]
    f, b = warm, 0
    while b < m:
        if f < m:
            order.append(("F", f))
            f += 1
        order.append(("B", b))
        b += 1
    return order


def evaluate_memory(console: Console, *, batch: int, seq: int) -> dict:
    model, lo, hi, num_stages, stage_idx, m = "gpt-small", 1, 6, 3, 1, 4  # blocks layers.0..layers.5
    console.log(f"memory: stage {stage_idx} of {num_stages} ({model} blocks {lo}..{hi}), 1F1B, M={m}")
    chain = model_chain(model, batch=batch, seq=seq)
    config = TrainingConfig(global_batch=m * batch, microbatch_size=batch, schedule="1f1b", optimizer="adam")
    in_flight = in_flight_microbatches("1f1b", num_stages, stage_idx, m)
    predicted = stage_memory(chain, lo, hi, config, in_flight)

    rss0 = psutil.Process().memory_info().rss
    bundle = build_model(model, batch=batch, seq=seq, device="meta")
    layers = [bundle.module.layers[i] for i in range(lo - 1, hi)]
    stage = torch.nn.Sequential(*layers).to_empty(device="cpu")
    with torch.no_grad():
        for p in stage.parameters():
            p.normal_(0.0, 0.02)
    opt = torch.optim.Adam(stage.parameters(), lr=1e-4)
    d_model = bundle.module.config.d_model
    tracker = LiveStorageBytes()
    tracker.track(list(stage.parameters()) + list(stage.buffers()))
    gen = torch.Generator().manual_seed(0)
    with tracker:
        for step in range(2):
            if step == 1:
                tracker.reset_peak()
            inflight: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            for op, mb in _one_f_one_b(num_stages, stage_idx, m):
                if op == "F":
                    x = torch.randn(batch, seq, d_model, generator=gen).requires_grad_(True)  # received activation
                    inflight[mb] = (x, stage(x))
                else:
                    x, y = inflight.pop(mb)
                    grad = torch.randn(y.shape, generator=gen)  # received gradient
                    torch.autograd.backward(y, grad)
                    del x, y, grad  # x.grad has been "sent"
            opt.step()
            opt.zero_grad(set_to_none=True)
    measured = tracker.peak
    rss_delta = psutil.Process().memory_info().rss - rss0
    err = (predicted.total_bytes - measured) / measured
    return {"model": model, "blocks": [lo, hi], "stage": stage_idx, "num_stages": num_stages, "microbatches": m,
            "in_flight": in_flight, "batch": batch, "seq": seq, "optimizer": "adam",
            "predicted": predicted.to_dict(), "measured_peak_live_bytes": measured,
            "rss_delta_bytes_reference": rss_delta, "rel_err": err, "goal": MEMORY_GOAL,
            "meets_goal": abs(err) <= MEMORY_GOAL,
            "method": "peak of live tensor storage bytes per op (TorchDispatchMode), 2nd training step"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    ap.add_argument("--quick", action="store_true", help="3 repeats and a smaller memory case")
    ap.add_argument("-o", "--output", default=str(RESULTS))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    repeats = 3 if args.quick else args.repeats
    console = Console()
    t0 = time.perf_counter()
    spec, cal = calibrate(repeats, console)
    timing = evaluate_time(spec, repeats, console)
    memory = evaluate_memory(console, batch=1 if args.quick else 2, seq=64 if args.quick else 128)

    table = Table(title=f"per-block fwd+bwd time, predicted vs measured (eff {spec.efficiency:.3f}, "
                        f"op overhead {spec.op_overhead_ms * 1e3:.1f} us)")
    for col in ("model", "batch x seq", "blocks", "median |err|", "max |err|", f"goal <= {TIME_GOAL:.0%}"):
        table.add_column(col)
    for r in timing:
        table.add_row(r["model"], f"{r['batch']} x {r['seq']}", str(len(r["blocks"])),
                      f"{r['median_abs_rel_err']:.1%}", f"{r['max_abs_rel_err']:.1%}",
                      "yes" if r["meets_goal"] else "NO")
    console.print(table)
    mt = Table(title="peak memory of one stage's training step")
    for col in ("stage", "predicted MB", "measured MB", "error", f"goal <= {MEMORY_GOAL:.0%}", "RSS delta MB"):
        mt.add_column(col)
    mt.add_row(f"{memory['model']} blocks {memory['blocks'][0]}..{memory['blocks'][1]}, "
               f"{memory['in_flight']} in flight", f"{memory['predicted']['total_bytes'] / 1e6:,.1f}",
               f"{memory['measured_peak_live_bytes'] / 1e6:,.1f}", f"{memory['rel_err']:+.1%}",
               "yes" if memory["meets_goal"] else "NO", f"{memory['rss_delta_bytes_reference'] / 1e6:,.1f}")
    console.print(mt)

    doc = {"benchmark": "cost_model", "torch": torch.__version__, "threads": args.threads, "repeats": repeats,
           "cpu_count": os.cpu_count(), "elapsed_s": time.perf_counter() - t0, "calibration": cal,
           "time": timing, "memory": memory,
           "note": "measured on a shared 2-core machine while other jobs ran: timings are noisy"}
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, out)
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
