"""Compute padding for rehearsing heterogeneous plans (planner.runtime.rank.emulate)."""
from __future__ import annotations

import time

import pytest

from cost_models.devices import get_device_spec
from planner.errors import InvalidInputError
from planner.plan import Plan
from planner.runtime.rank.emulate import Emulation, emulation_for, stage_ms
from tests.dist.plans import make_plan


@pytest.fixture(scope="module")
def hetero_plan():
    return make_plan("mlp-tiny", microbatch=2, num_microbatches=2, stages=[(0, 2), (3, 5)],
                     device_types=["A100-80GB", "T4"])


def test_fastest_planned_device_runs_unpadded_and_slower_ones_by_their_roofline_ratio(hetero_plan):
    fast, slow = emulation_for(hetero_plan, 0), emulation_for(hetero_plan, 1)
    assert (fast.fwd_factor, fast.bwd_factor) == (1.0, 1.0) and not fast.active
    stage = hetero_plan.stages[1]
    t4 = stage_ms(stage, get_device_spec("T4"), "float32")
    a100 = stage_ms(stage, get_device_spec("A100-80GB"), "float32")
    assert slow.fwd_factor == pytest.approx(t4[0] / a100[0])
    assert slow.bwd_factor == pytest.approx(t4[1] / a100[1])
    assert slow.fwd_factor > 1.5 and slow.reference_device == hetero_plan.ranks[0].device
    assert (fast.device_type, slow.device_type) == ("A100-80GB", "T4")


def test_devices_of_one_type_name_with_different_speeds_are_told_apart():
    """One device listed twice under one name (as profiles of one machine are), once 3x slower."""
    base = make_plan("mlp-tiny", microbatch=2, num_microbatches=2, stages=[(0, 2), (3, 5)])
    doc = base.to_dict()
    cpu = get_device_spec("CPU")
    slow_spec = {**cpu.to_dict(), "peak_flops": {k: v / 3 for k, v in cpu.peak_flops},
                 "mem_bw_bytes_per_s": cpu.mem_bw_bytes_per_s / 3}
    doc["cluster"]["hosts"][1]["devices"][0] = {"type": "CPU", "count": 1, "spec": slow_spec}
    plan = Plan.from_dict(doc)
    assert plan.ranks[0].device_type == plan.ranks[1].device_type == "CPU"
    fast, slow = emulation_for(plan, 0), emulation_for(plan, 1)
    assert not fast.active and slow.reference_device == plan.ranks[0].device
    assert slow.fwd_factor == pytest.approx(3.0) and slow.bwd_factor == pytest.approx(3.0)


def test_a_slowdown_pads_every_stage_rank_by_it_on_top_of_its_ratio(hetero_plan):
    """--emulate-slowdown K: even the fastest planned device runs K times slower than this machine,
    so its core idles while it "computes", as a GPU's host CPU does."""
    plain = [emulation_for(hetero_plan, r) for r in range(2)]
    slowed = [emulation_for(hetero_plan, r, slowdown=4.0) for r in range(2)]
    for p, s in zip(plain, slowed):
        assert s.active and s.fwd_factor == pytest.approx(4.0 * p.fwd_factor)
        assert s.bwd_factor == pytest.approx(4.0 * p.bwd_factor)


def test_homogeneous_plan_is_not_padded():
    plan = make_plan("mlp-tiny", microbatch=2, num_microbatches=2, stages=[(0, 2), (3, 5)])
    assert not any(emulation_for(plan, r).active for r in range(plan.num_ranks))


def test_pad_sleeps_the_missing_time():
    emu = Emulation(fwd_factor=3.0, bwd_factor=1.0)
    t0 = time.perf_counter()
    slept = emu.pad("F", 0.02)
    assert slept == pytest.approx(0.04) and time.perf_counter() - t0 >= 0.039
    assert emu.pad("B", 0.02) == 0.0


def test_pad_scales_the_cpu_time_not_the_time_spent_descheduled():
    emu = Emulation(fwd_factor=3.0, bwd_factor=2.0)
    # 10 ms of CPU work that took 25 ms on a busy machine lasts 3 x 10 ms in all: 5 ms more.
    assert emu.pad("F", 0.025, 0.010) == pytest.approx(0.005)
    # contention already made it longer than the emulated device would take: no padding
    assert emu.pad("B", 0.025, 0.010) == 0.0


def test_speed_up_factors_are_refused():
    with pytest.raises(InvalidInputError):
        Emulation(fwd_factor=0.5)
