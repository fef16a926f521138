"""Device catalog and DeviceSpec: datasheet figures load, lookups and profiles behave."""
from __future__ import annotations

import json

import pytest

from cost_models.devices import CATALOG, PROFILE_SCHEMA, DeviceSpec, get_device_spec
from planner.errors import InvalidInputError

NAMES = ("T4", "V100-16GB", "V100-32GB", "A10G", "L4", "A100-40GB", "A100-80GB", "H100-80GB",
         "RTX3090", "RTX4090", "CPU")


def test_catalog_has_every_contract_name_with_sane_figures() -> None:
    assert set(NAMES) <= set(CATALOG)
    for name in NAMES:
        spec = get_device_spec(name)
        assert spec.name == name
        assert spec.source, f"{name} needs a datasheet source"
        assert 0 < spec.efficiency <= 1
        assert 1e12 <= spec.flops_per_s("float32") <= 1e14
        assert spec.mem_bytes >= 16 * 2**30
        assert spec.kind == ("cpu" if name == "CPU" else "gpu")


def test_datasheet_figures() -> None:
    a100 = CATALOG["A100-80GB"]
    assert a100.flops_per_s("bfloat16") == pytest.approx(312e12)
    assert a100.flops_per_s("float32") == pytest.approx(19.5e12)
    assert a100.mem_bw_bytes_per_s == pytest.approx(2039e9)
    assert a100.mem_bytes == 80 * 2**30
    assert CATALOG["H100-80GB"].flops_per_s("float16") == pytest.approx(989.5e12)
    assert CATALOG["T4"].flops_per_s("float16") == pytest.approx(65e12)
    # Newer parts are faster in half precision
    assert CATALOG["H100-80GB"].flops_per_s("bfloat16") > a100.flops_per_s("bfloat16") > \
        CATALOG["V100-32GB"].flops_per_s("float16") > CATALOG["T4"].flops_per_s("float16")


def test_bfloat16_without_hardware_support_runs_at_fp32_rate() -> None:
    t4 = CATALOG["T4"]
    assert t4.flops_per_s("bfloat16") == t4.flops_per_s("float32")
    assert t4.flops_per_s("torch.float32") == t4.flops_per_s("float32")
    with pytest.raises(InvalidInputError, match="dtype"):
        t4.flops_per_s("int4")


def test_effective_flops_and_with_efficiency() -> None:
    spec = CATALOG["L4"].with_efficiency(0.25)
    assert spec.effective_flops_per_s("bfloat16") == pytest.approx(121e12 * 0.25)
    assert CATALOG["L4"].efficiency != 0.25  # the catalog entry is untouched


def test_unknown_name_suggests_close_catalog_names() -> None:
    with pytest.raises(InvalidInputError) as info:
        get_device_spec("a100-80gb ")
    assert "A100-80GB" in str(info.value)
    with pytest.raises(InvalidInputError, match="did you mean RTX3090"):
        get_device_spec("RTX-3090")


@pytest.mark.parametrize("bad", [
    {"peak_flops": ()},
    {"peak_flops": (("bfloat16", 1e12),)},
    {"peak_flops": (("float32", -1.0),)},
    {"mem_bytes": 0},
    {"mem_bw_bytes_per_s": 0.0},
    {"efficiency": 1.5},
    {"efficiency": 0.0},
    {"kind": "tpu"},
    {"op_overhead_ms": -0.1},
    {"optim_op_ms": float("nan")},
    {"optim_op_ms": -1e-3},
])
def test_spec_validation(bad: dict) -> None:
    base = dict(name="X", peak_flops=(("float32", 1e12),), mem_bytes=1 << 30, mem_bw_bytes_per_s=1e11)
    base.update(bad)
    with pytest.raises(InvalidInputError):
        DeviceSpec(**base)


def test_spec_dict_round_trip_and_profile_loading(tmp_path) -> None:
    spec = DeviceSpec(name="local-cpu", kind="cpu", peak_flops=(("float32", 1.2e11), ("bfloat16", 3e10)),
                      mem_bytes=8 << 30, mem_bw_bytes_per_s=1.5e10, efficiency=0.6, op_overhead_ms=0.01,
                      optim_op_ms=0.004, measured=True, p2p_bandwidth_gbps=20.0, p2p_latency_ms=0.05)
    assert DeviceSpec.from_dict(spec.to_dict()) == spec
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"schema": PROFILE_SCHEMA, "device": spec.to_dict()}))
    assert get_device_spec(str(path)) == spec
    assert get_device_spec(path) == spec
    path.write_text(json.dumps({"schema": "other", "device": {}}))
    with pytest.raises(InvalidInputError, match="schema"):
        get_device_spec(str(path))
    with pytest.raises(InvalidInputError, match="no such file"):
        get_device_spec(str(tmp_path / "missing.json"))


def test_catalog_entries_are_checked() -> None:
    from cost_models.devices import _catalog_entry

    spec = _catalog_entry("X", {"tflops": {"float32": 2.0}, "mem_gib": 1, "bw_gbs": 10, "source": "test"})
    assert spec.flops_per_s("float32") == pytest.approx(2e12) and spec.mem_bytes == 2**30
    assert spec.mem_bw_bytes_per_s == pytest.approx(10e9) and spec.kind == "gpu" and spec.efficiency == 0.5
    with pytest.raises(InvalidInputError, match="devices.yaml: X"):
        _catalog_entry("X", {"tflops": {"float32": 2.0}, "mem_gib": 1})  # no bandwidth
    with pytest.raises(InvalidInputError, match="numbers for the figures"):
        _catalog_entry("X", {"tflops": {"float32": "fast"}, "mem_gib": 1, "bw_gbs": 10})


def test_half_precision_has_its_own_efficiency_and_fp32_is_unchanged() -> None:
    a100 = CATALOG["A100-80GB"]
    assert a100.efficiency == 0.5 and a100.effective_flops_per_s("float32") == pytest.approx(0.5 * 19.5e12)
    assert a100.efficiency_for("float16") == 0.15
    assert a100.effective_flops_per_s("torch.bfloat16") == pytest.approx(0.15 * 312e12)
    t4 = CATALOG["T4"]  # no bfloat16 peak: the float32 rate and efficiency, as before
    assert t4.effective_flops_per_s("bfloat16") == t4.effective_flops_per_s("float32")
    # A cluster file's scalar efficiency still means every dtype
    assert a100.with_efficiency(0.4).effective_flops_per_s("float16") == pytest.approx(0.4 * 312e12)
    one = a100.with_dtype_efficiency("float16", 0.2)
    assert one.efficiency_for("float16") == 0.2 and one.efficiency_for("bfloat16") == 0.15
    assert a100.with_dtype_efficiency("float32", 0.3).efficiency == 0.3


@pytest.mark.parametrize("name", [n for n in NAMES if n != "CPU"])
def test_half_precision_is_never_priced_slower_than_fp32(name: str) -> None:
    spec = CATALOG[name]
    for dtype in ("float16", "bfloat16"):
        assert spec.effective_flops_per_s(dtype) >= spec.effective_flops_per_s("float32"), dtype


def test_dtype_efficiency_round_trips_and_old_dicts_load() -> None:
    spec = CATALOG["A100-40GB"]
    d = spec.to_dict()
    assert d["efficiency"] == 0.5 and d["dtype_efficiency"]["float16"] == 0.15
    assert DeviceSpec.from_dict(d) == spec
    old = {k: v for k, v in d.items() if k != "dtype_efficiency"}  # a profile written before per-dtype figures
    assert DeviceSpec.from_dict(old).effective_flops_per_s("float16") == pytest.approx(0.5 * 312e12)
    assert "dtype_efficiency" not in CATALOG["CPU"].to_dict()


@pytest.mark.parametrize("bad", [
    (("float32", 0.2),),                     # float32 is the plain efficiency
    (("bfloat16", 0.2),),                    # no bfloat16 peak: it runs at the float32 rate
    (("float16", 1.5),),
    (("float16", 0.2), ("float16", 0.3)),
])
def test_dtype_efficiency_validation(bad: tuple) -> None:
    with pytest.raises(InvalidInputError, match="efficiency"):
        DeviceSpec(name="X", peak_flops=(("float32", 1e12), ("float16", 8e12)), mem_bytes=1 << 30,
                   mem_bw_bytes_per_s=1e11, dtype_efficiency=bad)


def test_catalog_efficiency_scalar_or_mapping() -> None:
    from cost_models.devices import _catalog_entry

    base = {"tflops": {"float32": 2.0, "float16": 16.0}, "mem_gib": 1, "bw_gbs": 10}
    scalar = _catalog_entry("X", {**base, "efficiency": 0.4})
    assert scalar.effective_flops_per_s("float16") == pytest.approx(0.4 * 16e12)
    mapped = _catalog_entry("X", {**base, "efficiency": {"float32": 0.4, "float16": 0.1}})
    assert mapped.efficiency == 0.4 and mapped.effective_flops_per_s("float16") == pytest.approx(0.1 * 16e12)
    with pytest.raises(InvalidInputError, match="float32 entry"):
        _catalog_entry("X", {**base, "efficiency": {"float16": 0.1}})
