"""Profiling passes cold: an untimed cache sweep runs before every timed forward and backward, outside the
timed window, only when asked, and the setting is on by default and recorded in the profile document."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import planner.profiling.profile as prof
import planner.profiling.units as units
from cost_models.devices import DeviceSpec
from cost_models.measured import Calibration
from planner.errors import InvalidInputError
from planner.profiling.profile import EVICT_BYTES, ProfileSettings
from planner.profiling.units import time_units
from tests.unit.toy_models import ToyLM

torch.set_num_threads(1)


def _record(model: nn.Module, monkeypatch: pytest.MonkeyPatch, events: list[str]) -> list[int]:
    """Log sweeps, clock reads, and every unit's forward and the start of its backward into ``events``;
    returns the byte counts the sweeper was built with."""
    built: list[int] = []

    def sweeper(evict_bytes: int, device: torch.device):
        built.append(evict_bytes)
        return (lambda: events.append("sweep")) if evict_bytes > 0 else (lambda: None)

    ticks = iter(range(10**6))
    monkeypatch.setattr(units, "_sweeper", sweeper)
    monkeypatch.setattr(units, "clock_reader", lambda clock: lambda: events.append("tick") or float(next(ticks)))

    def on_forward(mod: nn.Module, args: tuple, out: torch.Tensor) -> None:
        events.append("fwd")
        if out.requires_grad:  # not in the untimed capture pass (no grad)
            out.register_hook(lambda grad: events.append("bwd"))

    for unit in [model.embed, *model.layers, model.head]:
        unit.register_forward_hook(on_forward)
    return built


def test_a_sweep_runs_before_each_timed_pass_and_outside_its_window(monkeypatch: pytest.MonkeyPatch) -> None:
    model, events = ToyLM(layers=2), []
    built = _record(model, monkeypatch, events)
    events.clear()  # the capture pass (no grad, untimed) is not of interest
    timings = time_units(model, (torch.randint(0, 16, (2, 4)),), repeats=2, device=torch.device("cpu"),
                         evict_bytes=1 << 20)
    assert built == [1 << 20]
    capture, timed = events[:4], events[4:]
    assert capture == ["fwd"] * 4  # the capture forward of every unit, before any sweep
    one_pass = ["sweep", "tick", "fwd", "tick", "sweep", "tick", "bwd", "tick"]
    assert timed == one_pass * (1 + 2) * 4  # warm-up + repeats, for each of the 4 units
    assert [t.name for t in timings] == ["embed", "layers.0", "layers.1", "head"]
    assert all(t.fwd_ms == pytest.approx(1e3) and t.bwd_ms == pytest.approx(1e3) for t in timings)


def test_no_sweep_when_evict_bytes_is_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    model, events = ToyLM(layers=2), []
    built = _record(model, monkeypatch, events)
    time_units(model, (torch.randint(0, 16, (2, 4)),), repeats=1, device=torch.device("cpu"))
    assert built == [0] and "sweep" not in events


def test_the_real_sweeper_sweeps_a_buffer_of_the_size_asked() -> None:
    allocated: list[int] = []
    real_ones = torch.ones

    def ones(*size, **kw):
        allocated.append(int(size[0]))
        return real_ones(*size, **kw)

    torch.ones, saved = ones, torch.ones
    try:
        sweep = units._sweeper(1 << 20, torch.device("cpu"))
        none = units._sweeper(0, torch.device("cpu"))
    finally:
        torch.ones = saved
    assert allocated == [(1 << 20) // 4]  # float32 elements; nothing for 0
    assert sweep() is None and none() is None
    timings = time_units(ToyLM(layers=2), (torch.randint(0, 16, (2, 4)),), repeats=1, device=torch.device("cpu"),
                         evict_bytes=1 << 20)
    assert all(t.fwd_ms > 0 and t.bwd_ms > 0 for t in timings)


def test_settings_default_to_cold_passes_and_round_trip_through_the_document() -> None:
    assert ProfileSettings().evict_bytes == EVICT_BYTES > 48 << 20  # past the dev host's last-level cache
    assert ProfileSettings.quick().evict_bytes == EVICT_BYTES
    for bad in (-1, True, 1.5):
        with pytest.raises(InvalidInputError, match="evict_bytes"):
            ProfileSettings(evict_bytes=bad)  # type: ignore[arg-type]
    spec = DeviceSpec(name="cpu", kind="cpu", peak_flops=(("float32", 1e10),), mem_bytes=1 << 30,
                      mem_bw_bytes_per_s=1e10, efficiency=0.5)
    calib = Calibration(efficiency=0.5, op_overhead_ms=0.01, median_abs_rel_err=0.1, max_abs_rel_err=0.2,
                        n_samples=2)
    for settings in (ProfileSettings(), ProfileSettings(evict_bytes=0, statistic="median", model="gpt-tiny")):
        doc = prof._profile_document(settings, torch.device("cpu"), spec, (), calib, None, 1e10)
        again = dataclasses.replace(ProfileSettings(), **doc["settings"])
        assert again == settings and doc["settings"]["evict_bytes"] == settings.evict_bytes


def test_profile_device_hands_the_setting_to_the_unit_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, object] = {}

    class Stop(Exception):
        pass

    def fake_time_units(*args, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(prof, "time_units", fake_time_units)
    monkeypatch.setattr(prof, "_measure_throughput", lambda settings, device, say: ({"float32": 1e10}, 1e10))
    settings = dataclasses.replace(ProfileSettings.quick(), p2p=False, evict_bytes=3 << 20)
    with pytest.raises(Stop):
        prof.profile_device(settings)
    assert seen["evict_bytes"] == 3 << 20
