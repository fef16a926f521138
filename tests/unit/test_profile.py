"""Profiling: the pure fits recover known figures; the timers run on a toy model; files round trip."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from cost_models.compute import block_bwd_ms, block_fwd_ms
from cost_models.devices import PROFILE_SCHEMA, DeviceSpec, get_device_spec
from cost_models.measured import BlockSample, fit_calibration, fit_p2p
from planner.errors import InvalidInputError
from planner.ir import Block
from planner.profiling.clocks import summarize_ms
from planner.profiling.profile import ProfileSettings, write_profile
from planner.profiling.throughput import (
    measure_matmul_flops,
    measure_memory_bandwidth,
    measure_optimizer_op_ms,
)
from planner.profiling.units import time_units
from tests.unit.toy_models import ToyLM

torch.set_num_threads(1)


def _samples_from(spec: DeviceSpec, rng: np.random.Generator, noise: float) -> list[BlockSample]:
    """Blocks of varied size, 'measured' with exactly the cost model plus multiplicative noise."""
    out = []
    for i in range(12):
        flops = int(10 ** rng.uniform(5, 10))
        block = Block(index=i, name=f"b{i}", node_names=tuple(f"n{j}" for j in range(int(rng.integers(3, 60)))),
                      module_paths=(), param_names=(), fwd_flops=flops, bwd_flops=2 * flops, param_count=0,
                      param_bytes=0, saved_act_bytes=0, out_bytes=0, boundary_nodes=(),
                      mem_traffic_bytes=int(10 ** rng.uniform(4, 8)))
        f = block_fwd_ms(block, spec) * (1 + rng.normal(0, noise))
        b = block_bwd_ms(block, spec) * (1 + rng.normal(0, noise))
        out.append(BlockSample(name=block.name, fwd_ms=f, bwd_ms=b, fwd_flops=block.fwd_flops,
                               bwd_flops=block.bwd_flops, mem_traffic_bytes=block.mem_traffic_bytes,
                               n_ops=len(block.node_names)))
    return out


@pytest.mark.parametrize("eff,ovh", [(0.4, 0.02), (0.08, 0.0), (0.9, 0.005)])
def test_fit_calibration_recovers_known_figures(eff: float, ovh: float) -> None:
    spec = DeviceSpec(name="cpu", kind="cpu", peak_flops=(("float32", 1e11),), mem_bytes=1 << 30,
                      mem_bw_bytes_per_s=2e10, efficiency=eff, op_overhead_ms=ovh)
    samples = _samples_from(spec, np.random.default_rng(0), noise=0.0)
    cal = fit_calibration(samples, peak_flops=1e11, mem_bw_bytes_per_s=2e10)
    assert cal.efficiency == pytest.approx(eff, rel=0.02)
    assert cal.op_overhead_ms == pytest.approx(ovh, rel=0.03, abs=2e-5)
    assert cal.median_abs_rel_err < 0.01 and cal.n_samples == 24


def test_fit_calibration_with_noise_and_bad_input() -> None:
    spec = DeviceSpec(name="cpu", kind="cpu", peak_flops=(("float32", 1e11),), mem_bytes=1 << 30,
                      mem_bw_bytes_per_s=2e10, efficiency=0.3, op_overhead_ms=0.01)
    cal = fit_calibration(_samples_from(spec, np.random.default_rng(1), noise=0.05), peak_flops=1e11,
                          mem_bw_bytes_per_s=2e10)
    assert cal.efficiency == pytest.approx(0.3, rel=0.15)
    assert cal.median_abs_rel_err < 0.1
    with pytest.raises(InvalidInputError):
        fit_calibration([], peak_flops=1e11, mem_bw_bytes_per_s=2e10)


def test_blocks_faster_than_the_measured_peak_raise_the_peak_not_clamp_the_efficiency() -> None:
    # The blocks ran at 60% of 1e11 FLOP/s, but the matmul (disturbed) measured only 4e10.
    spec = DeviceSpec(name="cpu", kind="cpu", peak_flops=(("float32", 1e11),), mem_bytes=1 << 30,
                      mem_bw_bytes_per_s=2e10, efficiency=0.6, op_overhead_ms=0.01)
    samples = _samples_from(spec, np.random.default_rng(2), noise=0.0)
    cal = fit_calibration(samples, peak_flops=4e10, mem_bw_bytes_per_s=2e10)
    assert cal.efficiency == 1.0
    assert cal.peak_scale == pytest.approx(1.5, rel=0.02)  # 4e10 * 1.5 = 6e10 = what the blocks reached
    assert cal.op_overhead_ms == pytest.approx(0.01, rel=0.03)
    assert cal.median_abs_rel_err < 0.01
    # an honest peak leaves it alone
    assert fit_calibration(samples, peak_flops=1e11, mem_bw_bytes_per_s=2e10).peak_scale == 1.0


def test_summarize_ms_min_or_median() -> None:
    times = [5.0, 1.0, 3.0, 9.0, 4.0]
    assert summarize_ms(times, "min") == 1.0
    assert summarize_ms(times, "median") == 4.0
    with pytest.raises(InvalidInputError):
        summarize_ms([], "min")
    with pytest.raises(InvalidInputError):
        summarize_ms(times, "mean")  # type: ignore[arg-type]


def test_fit_p2p() -> None:
    # 0.5 ms latency, 8 Gb/s = 1e9 B/s = 1e-6 ms per byte
    points = [(n, 0.5 + n * 1e-6) for n in (1 << 10, 1 << 16, 1 << 20, 1 << 22)]
    res = fit_p2p(points, "gloo")
    assert res.latency_ms == pytest.approx(0.5, rel=1e-6)
    assert res.bandwidth_gbps == pytest.approx(8.0, rel=1e-6)
    # noise that makes the line's intercept negative: latency pinned to the smallest message
    res = fit_p2p([(1000, 0.001), (2000, 0.0005), (10**6, 1.0)], "gloo")
    assert res.latency_ms >= 0 and res.bandwidth_gbps > 0
    # a quiet machine's points (1 KiB, 4 MiB, 16 MiB): the largest's noise no longer sets the latency
    # (an absolute-error line put it at 0.36 ms where the 1 KiB message took 0.048 ms)
    res = fit_p2p([(1024, 0.0484), (4 << 20, 1.8728), (16 << 20, 4.6520)], "gloo")
    assert 0.04 <= res.latency_ms <= 0.06
    with pytest.raises(InvalidInputError):
        fit_p2p([(1000, 1.0)], "gloo")


def test_time_units_on_a_toy_model() -> None:
    model = ToyLM()
    timings = time_units(model, (torch.randint(0, 16, (2, 4)),), repeats=2, device=torch.device("cpu"))
    assert [t.name for t in timings] == ["embed", "layers.0", "layers.1", "layers.2", "head"]
    assert all(t.fwd_ms > 0 and t.bwd_ms > 0 for t in timings)
    assert all(p.grad is None for p in model.parameters())  # nothing left behind


def test_raw_measurements_are_positive_and_plausible() -> None:
    cpu = torch.device("cpu")
    flops = measure_matmul_flops("float32", size=128, repeats=2, device=cpu)
    assert 1e8 < flops < 1e13
    bw = measure_memory_bandwidth(nbytes=4 << 20, repeats=2, device=cpu)
    assert 1e8 < bw < 1e13


def test_optimizer_probe_prices_one_adam_kernel() -> None:
    cpu = torch.device("cpu")
    op_ms = measure_optimizer_op_ms(repeats=3, device=cpu, tensors=32)
    # a kernel on a 64-float tensor: microseconds, not the model ops' tens of them nor nothing
    assert 1e-4 < op_ms < 0.1


def test_write_profile_is_atomic_and_loadable(tmp_path) -> None:
    spec = DeviceSpec(name="box-cpu", kind="cpu", peak_flops=(("float32", 9e10),), mem_bytes=8 << 30,
                      mem_bw_bytes_per_s=1e10, efficiency=0.5, measured=True)
    path = write_profile({"schema": PROFILE_SCHEMA, "device": spec.to_dict()}, tmp_path / "sub" / "p.json")
    assert get_device_spec(str(path)) == spec
    assert [p.name for p in path.parent.iterdir()] == ["p.json"]  # no temp file left
    assert json.loads(path.read_text())["schema"] == PROFILE_SCHEMA


def test_cpu_clock_needs_one_thread_and_measures() -> None:
    cpu = torch.device("cpu")
    assert measure_matmul_flops("float32", size=64, repeats=2, device=cpu, clock="cpu") > 1e7
    torch.set_num_threads(2)
    try:
        with pytest.raises(InvalidInputError, match="one thread"):
            measure_matmul_flops("float32", size=64, repeats=1, device=cpu, clock="cpu")
    finally:
        torch.set_num_threads(1)
    with pytest.raises(InvalidInputError, match="wall or cpu"):
        measure_matmul_flops("float32", size=64, repeats=1, device=cpu, clock="tsc")


def test_profile_settings_validation() -> None:
    assert ProfileSettings.quick().model == "gpt-tiny"
    with pytest.raises(InvalidInputError):
        ProfileSettings(repeats=0)
    with pytest.raises(InvalidInputError):
        ProfileSettings(clock="tsc")
    assert ProfileSettings().statistic == "min"
    with pytest.raises(InvalidInputError):
        ProfileSettings(statistic="mean")  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError):
        ProfileSettings(sharing_window_s=0.0)
    with pytest.raises(InvalidInputError):
        ProfileSettings(sharing_microbatches=0)
    with pytest.raises(InvalidInputError):
        ProfileSettings(p2p_posts=-1)


def test_the_cost_model_benchmark_prices_blocks_with_the_raised_peak() -> None:
    """benchmarks/cost_model.py's calibrated spec, like a profile, multiplies the peak by peak_scale: blocks
    that ran faster than the (disturbed) measured peak are priced as fast as they ran, not clamped."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "cost_model.py"
    module_spec = importlib.util.spec_from_file_location("bench_cost_model", path)
    bench = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(bench)
    truth = DeviceSpec(name="cpu", kind="cpu", peak_flops=(("float32", 1e11),), mem_bytes=1 << 30,
                       mem_bw_bytes_per_s=2e10, efficiency=0.6, op_overhead_ms=0.01)
    samples = _samples_from(truth, np.random.default_rng(2), noise=0.0)
    spec = bench._calibrated_spec(samples, 4e10, 2e10)
    # the blocks ran at 0.6 x 1e11 = 6e10 FLOP/s: that is the spec's throughput, at efficiency 1
    assert spec.flops_per_s("float32") * spec.efficiency == pytest.approx(6e10, rel=0.02)
    assert spec.efficiency == 1.0 and spec.op_overhead_ms == pytest.approx(0.01, rel=0.03)


def test_sharing_speeds_are_per_round_ratios_capped_and_non_increasing() -> None:
    from cost_models.measured import CoreSharing, sharing_speeds

    # two rounds on a 2-core machine: the second round's machine is 20% slower throughout
    rates = [[10.0, 8.0, 5.0, 3.8], [8.0, 6.6, 4.0, 3.1]]
    speeds = sharing_speeds(rates, [row[0] for row in rates])
    assert speeds == pytest.approx((1.0, (0.8 + 0.825) / 2, 0.5, (0.38 + 0.3875) / 2))
    # company never speeds a process up: ratios above 1 (noise) are capped, and k + 1 is never faster than k
    assert sharing_speeds([[10.0, 10.5, 6.0, 6.5]], [10.0]) == pytest.approx((1.0, 1.0, 0.6, 0.6))
    CoreSharing(cores=2, speed=speeds)  # a valid table
    with pytest.raises(InvalidInputError):
        sharing_speeds([[10.0, 8.0]], [0.0])


@pytest.mark.slow
def test_measure_core_sharing_runs_processes_at_once() -> None:
    from cost_models.measured import load_sharing
    from planner.profiling.sharing import measure_core_sharing

    table = measure_core_sharing(model="gpt-tiny", batch=1, seq=16, processes=2, window_s=0.3, rounds=1,
                                 microbatches=2)
    assert len(table.speed) == 2 and table.speed[0] == 1.0 and 0.0 < table.speed[1] <= 1.0
    assert table.rounds == 1 and table.window_s == 0.3 and table.microbatches == 2
    assert load_sharing({"sharing": table.to_dict()}) == table and load_sharing({"sharing": None}) is None


def test_fit_message_cost_recovers_a_line_per_side_and_clamps_noise() -> None:
    from cost_models.measured import MessageCost, fit_message_cost, load_message_cost

    sizes = [1 << 10, 1 << 17, 1 << 20, 1 << 22]
    posting = [{"bytes": b, "send_cpu_ms": 0.02 + 0.3 * b / 2**20, "recv_cpu_ms": 0.05 + 0.4 * b / 2**20}
               for b in sizes]
    cost = fit_message_cost(posting)
    assert cost.send_ms == pytest.approx(0.02) and cost.send_ms_per_mib == pytest.approx(0.3)
    assert cost.recv_ms == pytest.approx(0.05) and cost.recv_ms_per_mib == pytest.approx(0.4)
    assert cost.send_cpu_ms(2**20) == pytest.approx(0.32) and cost.recv_cpu_ms(0) == pytest.approx(0.05)
    # a falling line (noise) is no cost per byte: the mean of a flat one; a single size has no slope
    noisy = fit_message_cost([{"bytes": 1024, "send_cpu_ms": 0.3, "recv_cpu_ms": 0.1},
                              {"bytes": 2**20, "send_cpu_ms": 0.1, "recv_cpu_ms": 0.1}])
    assert noisy.send_ms == pytest.approx(0.2) and noisy.send_ms_per_mib == 0.0
    assert fit_message_cost(posting[:1]).send_ms_per_mib >= 0.0
    with pytest.raises(InvalidInputError):
        fit_message_cost([])
    with pytest.raises(InvalidInputError):
        MessageCost(send_ms=-0.1, recv_ms=0.0)
    assert MessageCost.from_dict(cost.to_dict()) == cost
    assert load_message_cost({"p2p": {"messages": cost.to_dict()}}) == cost
    assert load_message_cost({"p2p": None}) is None and load_message_cost({"p2p": {"latency_ms": 1.0}}) is None
