"""Cost model accuracy on this CPU: per-block time after calibration, and a stage's peak memory.

1. Time every block (``embed``, ``layers.i``, ``head``) of gpt-small (batch 2, seq 64)
   and llama-tiny (batch 4, seq 32), forward and backward, in interleaved rounds
   (fastest of a few repeats per round), with fp32 matmul throughput and copy
   bandwidth measured each round, as ``stagewise profile`` does. One torch
   thread, timed by process CPU time (``--clock cpu`` of the profiler), so that
   other jobs sharing the machine do not inflate the times.
2. ``calibrated``: fit the efficiency and per-op overhead on the even rounds of
   both models (one pair for both), predict with ``cost_models.compute``, and
   compare with the odd rounds (held-out measurements). Goal: median absolute
   error of per-block forward+backward time <= 15% per model.
   ``cross_shape`` (for information): fit on gpt-small at batch 1 x seq 32 and
   gpt-tiny only, compare with the same held-out rounds: how far one calibration
   carries to other shapes (CPU matmul efficiency grows with the matrix size).
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

4. Half precision from the catalog, against a published measurement: Metis's
   shipped A100 profiles (SamsungLabs/Metis ``profile_data_samples/``, Megatron
   GPT layers of hidden 4096 at seq 1024, fp16; give the directory with
   ``--metis DIR``). Each tp1 file's transformer-layer forward+backward time
   beside what ``cost_models.compute`` prices for that layer on the catalog's
   A100s in float16 (``cost_models.metis_profile.priced_layer_ms``), and the
   FLOP rate it reached (24*b*s*h^2 + 4*b*s^2*h forward, twice that backward).
   Goal: within 30%. ``--metis-only`` runs just this row and updates its key of
   the results file.

Run: ``python benchmarks/cost_model.py [--quick] [--metis DIR [--metis-only]]``. Prints tables and writes
``benchmarks/results/cost_model.json`` (``--quick``: a smoke run, both protocols and the memory case on tiny models,
2 rounds of 1 repeat, nothing written unless ``-o``). Timings are noisy on a shared machine.
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
from cost_models.devices import (
    CATALOG,  # noqa: E402
    DeviceSpec,  # noqa: E402
)
from cost_models.measured import BlockSample, fit_calibration  # noqa: E402
from cost_models.memory import in_flight_microbatches, stage_memory  # noqa: E402
from cost_models.metis_profile import (  # noqa: E402
    GPTLayerShape,
    calibrate_from_metis,
    layer_tflops,
    priced_layer_ms,
    read_metis_profiles,
)
from cost_models.training import TrainingConfig  # noqa: E402
from models.registry import build_model  # noqa: E402
from planner.profiling.profile import model_chain, pair_samples  # noqa: E402
from planner.profiling.throughput import measure_matmul_flops, measure_memory_bandwidth  # noqa: E402
from planner.profiling.units import UnitTiming, time_units  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "cost_model.json"
# (model, batch, seq). Evaluation: gpt-small at a short shape and llama-tiny. Cross-shape
# calibration: what `stagewise profile --quick` and a smaller gpt-small shape would see.
EVALUATION = (("gpt-small", 2, 64), ("llama-tiny", 4, 32))
CROSS_CALIBRATION = (("gpt-small", 1, 32), ("gpt-tiny", 2, 32))
MEMORY_STAGE = ("gpt-small", 1, 6)  # (model, first block, last block): its layers.0..layers.5
# --quick: the same protocols on tiny models (seconds, not minutes)
QUICK = {"evaluation": (("gpt-tiny", 2, 32), ("llama-tiny", 4, 32)), "cross": (("gpt-tiny", 1, 16),),
         "memory_stage": ("gpt-tiny", 1, 2), "memory_shape": (1, 32)}
TIME_GOAL, MEMORY_GOAL = 0.15, 0.20
# Metis's GPT "1.5B" (scripts/cost_het_cluster.sh): the shape its A100 profiles were taken at, in fp16.
METIS_SHAPE, METIS_DTYPE, METIS_GOAL = GPTLayerShape(hidden_size=4096, seq_len=1024), "float16", 0.30
# Process CPU time with one torch thread: the other jobs on this shared 2-core machine would
# otherwise inflate wall times by up to 2-3x, at random, between and within rounds.
CLOCK = "cpu"


def _measure_rounds(rounds: int, repeats: int, console: Console, configs: tuple) -> tuple[dict, list[dict]]:
    """Every configuration timed once per round, rounds interleaved so drifting load from other
    processes hits all of them alike. Returns the chains and, per round, {(config, block): (fwd, bwd)}."""
    cpu = torch.device("cpu")
    modules = {m: build_model(m, batch=max(c[1] for c in configs if c[0] == m),
                              seq=max(c[2] for c in configs if c[0] == m), device="cpu") for m, _, _ in configs}
    chains = {c: model_chain(c[0], batch=c[1], seq=c[2]) for c in configs}
    per_round = []
    for r in range(rounds):
        console.log(f"timing round {r + 1}/{rounds}")
        found: dict = {"peak": measure_matmul_flops("float32", size=1024, repeats=repeats, device=cpu, clock=CLOCK),
                       "bw": measure_memory_bandwidth(nbytes=64 << 20, repeats=repeats, device=cpu, clock=CLOCK)}
        for c in configs:
            bundle = modules[c[0]]
            idx = bundle.example_inputs[0][: c[1], : c[2]]  # the shape of this configuration
            # Tiny models' blocks take a millisecond: many more repeats cost nothing and steady them.
            reps = repeats if c[0] == "gpt-small" else 8 * repeats
            for t in time_units(bundle.module, (idx,), repeats=reps, device=cpu, clock=CLOCK):
                found[(c, t.name)] = (t.fwd_ms, t.bwd_ms)
        per_round.append(found)
    return chains, per_round


def _best(per_round: list[dict], rounds: range) -> dict:
    """Fastest time per block over the given rounds."""
    out: dict = {}
    for r in rounds:
        for key, value in per_round[r].items():
            if isinstance(key, tuple):
                old = out.get(key)
                out[key] = value if old is None else (min(old[0], value[0]), min(old[1], value[1]))
    return out


def _samples(chains: dict, best: dict, configs) -> list[BlockSample]:
    samples = []
    for c in configs:
        timings = [UnitTiming(name=b.name, fwd_ms=best[(c, b.name)][0], bwd_ms=best[(c, b.name)][1])
                   for b in chains[c].blocks if (c, b.name) in best]
        samples += pair_samples(chains[c], timings)
    return samples


def _calibrated_spec(samples, peak: float, bw: float) -> DeviceSpec:
    """The device the fit describes: as ``stagewise profile`` writes it, the peak raised by ``peak_scale``
    where the blocks ran faster than the measured peak allows (the efficiency is then 1)."""
    cal = fit_calibration(samples, peak_flops=peak, mem_bw_bytes_per_s=bw)
    return DeviceSpec(name="this-cpu", kind="cpu", peak_flops=(("float32", peak * cal.peak_scale),),
                      mem_bytes=1 << 34, mem_bw_bytes_per_s=bw, efficiency=cal.efficiency, op_overhead_ms=cal.op_overhead_ms,
                      measured=True)


def _errors(spec: DeviceSpec, chains: dict, best: dict, evaluation: tuple) -> list[dict]:
    out = []
    for c in evaluation:
        rows = []
        for b in chains[c].blocks:
            fwd, bwd = best[(c, b.name)]
            pf, pb = block_fwd_ms(b, spec), block_bwd_ms(b, spec)
            rows.append({"block": b.name, "measured_fwd_ms": fwd, "measured_bwd_ms": bwd, "predicted_fwd_ms": pf,
                         "predicted_bwd_ms": pb, "rel_err": (pf + pb - fwd - bwd) / (fwd + bwd)})
        med = statistics.median(abs(r["rel_err"]) for r in rows)
        out.append({"model": c[0], "batch": c[1], "seq": c[2], "median_abs_rel_err": med,
                    "max_abs_rel_err": max(abs(r["rel_err"]) for r in rows), "blocks": rows})
    return out


def evaluate_time(rounds: int, repeats: int, console: Console, evaluation: tuple = EVALUATION,
                  cross: tuple = CROSS_CALIBRATION) -> dict:
    """Two protocols over the same measurements.

    ``calibrated``: efficiency and op overhead fitted on the evaluation models' blocks from the
    even rounds, predictions checked against the odd rounds (held-out measurements); the goal
    applies here. ``cross_shape``: fitted on other shapes/models only (gpt-small 1x32, gpt-tiny),
    checked against the same odd rounds: how far one calibration carries. (``evaluation``, ``cross``: the
    (model, batch, seq) of each protocol.)
    """
    chains, per_round = _measure_rounds(rounds, repeats, console, evaluation + cross)
    peak = max(r["peak"] for r in per_round)
    bw = max(r["bw"] for r in per_round)
    fit_rounds, test_rounds = range(0, rounds, 2), range(1, rounds, 2)
    test = _best(per_round, test_rounds)
    result: dict = {"matmul_fp32_flops_per_s": peak, "copy_bytes_per_s": bw, "rounds": rounds, "repeats": repeats}
    for name, configs, rounds_used in (("calibrated", evaluation, fit_rounds),
                                       ("cross_shape", cross, range(rounds))):
        spec = _calibrated_spec(_samples(chains, _best(per_round, rounds_used), configs), peak, bw)
        models = _errors(spec, chains, test, evaluation)
        for m in models:
            m["meets_goal"] = m["median_abs_rel_err"] <= TIME_GOAL
        result[name] = {"calibrated_on": [list(c) for c in configs], "efficiency": spec.efficiency,
                        "op_overhead_ms": spec.op_overhead_ms, "models": models}
    return result


def evaluate_metis(directory: Path) -> dict:
    """Catalog (and, for information, in-sample Metis-calibrated) A100 fp16 layer times vs Metis's tp1 files."""
    profiles = [p for p in read_metis_profiles(directory) if p.tp == 1]
    rows = []
    for name in ("A100-40GB", "A100-80GB"):
        catalog = CATALOG[name]
        calibrated, cal = calibrate_from_metis(catalog, profiles, METIS_SHAPE, METIS_DTYPE)
        for prof in sorted(profiles, key=lambda q: q.batch_size):
            layers = list(prof.transformer_layers)
            measured = statistics.mean(prof.layer_compute_ms[i] for i in layers)
            predicted = priced_layer_ms(catalog, METIS_SHAPE, prof.batch_size, METIS_DTYPE)
            err = predicted / measured - 1
            rows.append({"device": name, "file": Path(prof.path).name, "batch": prof.batch_size,
                         "measured_ms": measured, "measured_tflops": layer_tflops(prof, METIS_SHAPE, layers[0]),
                         "catalog_efficiency": catalog.efficiency_for(METIS_DTYPE), "catalog_ms": predicted,
                         "rel_err": err, "meets_goal": abs(err) <= METIS_GOAL,
                         "fp32_efficiency_ms": priced_layer_ms(catalog.with_efficiency(catalog.efficiency),
                                                              METIS_SHAPE, prof.batch_size, METIS_DTYPE),
                         "calibrated_efficiency": calibrated.efficiency_for(METIS_DTYPE),
                         "calibrated_op_overhead_ms": cal.op_overhead_ms,
                         "calibrated_ms": priced_layer_ms(calibrated, METIS_SHAPE, prof.batch_size, METIS_DTYPE)})
    return {"source": str(directory), "shape": {"hidden_size": METIS_SHAPE.hidden_size, "seq_len": METIS_SHAPE.seq_len},
            "dtype": METIS_DTYPE, "goal": METIS_GOAL, "rows": rows}


def _metis_table(metis: dict) -> Table:
    t = Table(title="one GPT layer (h 4096, s 1024) fwd+bwd on A100 fp16: catalog vs Metis's measurement")
    for col in ("device", "batch", "measured ms", "TFLOP/s", "catalog ms (eff)", "error",
                f"goal <= {METIS_GOAL:.0%}", "at fp32's eff", "calibrated ms (eff)"):
        t.add_column(col)
    for r in metis["rows"]:
        t.add_row(r["device"], str(r["batch"]), f"{r['measured_ms']:.1f}", f"{r['measured_tflops']:.1f}",
                  f"{r['catalog_ms']:.1f} ({r['catalog_efficiency']:.2f})", f"{r['rel_err']:+.1%}",
                  "yes" if r["meets_goal"] else "NO", f"{r['fp32_efficiency_ms']:.1f}",
                  f"{r['calibrated_ms']:.1f} ({r['calibrated_efficiency']:.3f})")
    return t


def _write_results(out: Path, doc: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, out)


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


def evaluate_memory(console: Console, *, batch: int, seq: int, stage: tuple[str, int, int] = MEMORY_STAGE) -> dict:
    (model, lo, hi), num_stages, stage_idx, m = stage, 3, 1, 4
    console.log(f"memory: stage {stage_idx} of {num_stages} ({model} blocks {lo}..{hi}), 1F1B, M={m}")
    chain = model_chain(model, batch=batch, seq=seq)
    config = TrainingConfig(global_batch=m * batch, microbatch_size=batch, schedule="1f1b", optimizer="adam")
    in_flight = in_flight_microbatches("1f1b", num_stages, stage_idx, m)
    predicted = stage_memory(chain, lo, hi, config, in_flight)

    rss0 = psutil.Process().memory_info().rss
    bundle = build_model(model, batch=batch, seq=seq, device="meta")
    layers = [bundle.module.layers[i] for i in range(lo - 1, hi)]
    module = torch.nn.Sequential(*layers).to_empty(device="cpu")
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.02)
    opt = torch.optim.Adam(module.parameters(), lr=1e-4)
    d_model = bundle.module.config.d_model
    tracker = LiveStorageBytes()
    tracker.track(list(module.parameters()) + list(module.buffers()))
    gen = torch.Generator().manual_seed(0)
    with tracker:
        for step in range(2):
            if step == 1:
                tracker.reset_peak()
            inflight: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            for op, mb in _one_f_one_b(num_stages, stage_idx, m):
                if op == "F":
                    x = torch.randn(batch, seq, d_model, generator=gen).requires_grad_(True)  # received activation
                    inflight[mb] = (x, module(x))
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
    ap.add_argument("--rounds", type=int, default=4, help="interleaved timing rounds (even: fit, odd: test)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: tiny models, 2 rounds of 1 repeat; "
                    "nothing written unless -o")
    ap.add_argument("--metis", type=Path, help="Metis's profile_data_samples/ directory (row 4)")
    ap.add_argument("--metis-only", action="store_true", help="only row 4; update its key of the results file")
    ap.add_argument("-o", "--output", default=None, help="default benchmarks/results/cost_model.json (--quick: none)")
    args = ap.parse_args(argv)
    console = Console(width=110)  # wide enough for the tables when piped
    output = args.output or (None if args.quick else str(RESULTS))
    metis = evaluate_metis(args.metis) if args.metis else None  # a bad directory fails before any timing
    if metis is not None:
        console.print(_metis_table(metis))
    if args.metis_only:
        if metis is None:
            ap.error("--metis-only needs --metis DIR")
        if output is None:
            return 0
        out = Path(output)
        doc = json.loads(out.read_text()) if out.is_file() else {"benchmark": "cost_model"}
        _write_results(out, {**doc, "metis": metis})
        console.print(f"updated {out} (metis)")
        return 0
    torch.set_num_threads(1)  # the cpu clock needs one thread
    repeats = 1 if args.quick else args.repeats
    t0 = time.perf_counter()
    if args.quick:
        timing = evaluate_time(2, repeats, console, QUICK["evaluation"], QUICK["cross"])
        batch, seq = QUICK["memory_shape"]
        memory = evaluate_memory(console, batch=batch, seq=seq, stage=QUICK["memory_stage"])
    else:
        timing = evaluate_time(args.rounds, repeats, console)
        memory = evaluate_memory(console, batch=2, seq=128)

    table = Table(title="per-block fwd+bwd time on this CPU, predicted vs measured (held-out rounds)")
    for col in ("fit on", "eff", "op us", "model", "batch x seq", "median |err|", "max |err|",
                f"goal <= {TIME_GOAL:.0%}"):
        table.add_column(col)
    for proto in ("calibrated", "cross_shape"):
        t = timing[proto]
        label = "same models" if proto == "calibrated" else "other shapes"
        for r in t["models"]:
            table.add_row(label, f"{t['efficiency']:.3f}", f"{t['op_overhead_ms'] * 1e3:.1f}", r["model"],
                          f"{r['batch']} x {r['seq']}", f"{r['median_abs_rel_err']:.1%}", f"{r['max_abs_rel_err']:.1%}",
                          ("yes" if r["meets_goal"] else "NO") if proto == "calibrated" else "(info)")
    console.print(table)
    mt = Table(title="peak memory of one stage's training step")
    for col in ("stage", "predicted MB", "measured MB", "error", f"goal <= {MEMORY_GOAL:.0%}", "RSS delta MB"):
        mt.add_column(col)
    mt.add_row(f"{memory['model']} blocks {memory['blocks'][0]}..{memory['blocks'][1]}, "
               f"{memory['in_flight']} in flight", f"{memory['predicted']['total_bytes'] / 1e6:,.1f}",
               f"{memory['measured_peak_live_bytes'] / 1e6:,.1f}", f"{memory['rel_err']:+.1%}",
               "yes" if memory["meets_goal"] else "NO", f"{memory['rss_delta_bytes_reference'] / 1e6:,.1f}")
    console.print(mt)

    doc = {"benchmark": "cost_model", "torch": torch.__version__, "threads": 1, "clock": CLOCK, "repeats": repeats,
           "cpu_count": os.cpu_count(), "elapsed_s": time.perf_counter() - t0, "time": timing, "memory": memory,
           "note": "measured on a shared 2-core machine while other jobs ran: timings are noisy"}
    if metis is not None:
        doc["metis"] = metis
    if output is None:
        console.print("quick run: nothing written")
        return 0
    out = Path(output)
    _write_results(out, doc)
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
