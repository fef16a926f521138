"""Metis's per-layer profiles: read, reproduced by the catalog, calibrating a device, and refused when bad.

The fixture transcribes SamsungLabs/Metis ``profile_data_samples/DeviceType.A100_tp{1,2}_bs*.json`` at commit
4b24046fbef31ca6fec6ccfd772d709f16257320: Megatron's GPT of hidden 4096, sequence 1024, vocabulary 51200,
10 "layers" (embedding, 8 transformer layers, head; the shape is in Metis's scripts/cost_het_cluster.sh for
MODEL_SIZE=1.5B), fp16, on A100s.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from cost_models.cluster_file import load_cluster, parse_cluster
from cost_models.devices import CATALOG
from cost_models.metis_profile import (
    GPTLayerShape,
    calibrate_from_metis,
    gpt_layer_figures,
    layer_tflops,
    priced_layer_ms,
    read_metis_profile,
    read_metis_profiles,
)
from planner.errors import InvalidInputError

SHAPE = GPTLayerShape(hidden_size=4096, seq_len=1024)
PARAMS = [393216000] + [202383360] * 8 + [393220096]
# (tp, batch): embedding ms, transformer layer ms, head ms, layer memory MB (embedding, layer, head), optimizer ms
SAMPLES = {
    (1, 1): (0.2892017364501953, 29.507994651794434, 0.4100799560546875, (7820, 4146, 12132), 39.308977127075195),
    (1, 2): (0.6282329559326172, 58.86340141296387, 0.6556510925292969, (8078, 4838.5, 14554), 39.59686756134033),
    (1, 4): (1.0962486267089844, 116.56570434570312, 1.066446304321289, (9078, 6259, 26084), 39.47432041168213),
    (2, 1): (1.1625289916992188, 16.83783531188965, 0.3528594970703125, (4378, 2119.5, 6232), 20.2700138092041),
}


def metis_doc(tp: int, batch: int) -> dict:
    emb, layer, head, (m_emb, m_layer, m_head), optim = SAMPLES[(tp, batch)]
    return {"model": {"model_name": "GPT3", "num_layers": 10,
                      "parameters": {"total_parameters_bytes": sum(PARAMS), "parameters_per_layer_bytes": PARAMS}},
            "execution_time": {"optimizer_time_ms": optim, "layer_compute_total_ms": [emb] + [layer] * 8 + [head]},
            "execution_memory": {"total_memory": 53120, "layer_memory_total_mb": [m_emb] + [m_layer] * 8 + [m_head]}}


@pytest.fixture
def metis_dir(tmp_path: Path) -> Path:
    d = tmp_path / "metis"
    d.mkdir()
    for tp, batch in SAMPLES:
        (d / f"DeviceType.A100_tp{tp}_bs{batch}.json").write_text(json.dumps(metis_doc(tp, batch)))
    return d


def catalog_layer_ms(spec, batch: int, dtype: str = "float16") -> float:
    return priced_layer_ms(spec, SHAPE, batch, dtype)


def test_reads_the_files_of_a_directory(metis_dir: Path) -> None:
    profiles = read_metis_profiles(metis_dir)
    assert [(p.device, p.tp, p.batch_size) for p in profiles] == [("A100", 1, 1), ("A100", 1, 2), ("A100", 1, 4),
                                                                  ("A100", 2, 1)]
    one = profiles[0]
    assert one.model_name == "GPT3" and list(one.transformer_layers) == list(range(1, 9))
    assert one.layer_compute_ms[1] == pytest.approx(29.508, abs=1e-3) and one.layer_memory_mb[-1] == 12132
    assert one.optimizer_ms == pytest.approx(39.309, abs=1e-3)
    assert read_metis_profile(metis_dir / "DeviceType.A100_tp2_bs1.json").tp == 2


def test_the_published_layer_rate_is_44_tflops(metis_dir: Path) -> None:
    rates = {p.batch_size: layer_tflops(p, SHAPE, 1) for p in read_metis_profiles(metis_dir) if p.tp == 1}
    assert rates[1] == pytest.approx(43.7, abs=0.1)  # 3 * (24 b s h^2 + 4 b s^2 h) / 29.5 ms
    assert all(43 < r < 45 for r in rates.values())


@pytest.mark.parametrize("name", ["A100-40GB", "A100-80GB"])
@pytest.mark.parametrize("batch", [1, 2, 4])
def test_the_catalog_reproduces_metis_fp16_layer_times_within_30_percent(name: str, batch: int) -> None:
    measured = SAMPLES[(1, batch)][1]
    spec = CATALOG[name]
    assert abs(catalog_layer_ms(spec, batch) / measured - 1) <= 0.30
    assert abs(catalog_layer_ms(spec, batch, "bfloat16") / measured - 1) <= 0.30  # same tensor cores
    # FP32's 50% of peak on the tensor-core rate, as the catalog had it, prices the layer >3x too fast
    assert measured / catalog_layer_ms(spec.with_efficiency(0.5), batch) > 3.0


def test_layer_figures_are_what_our_tracer_counts() -> None:
    import torch

    from models.gpt import GPT, GPTConfig
    from planner.coarsen import coarsen
    from planner.trace import trace

    h, s, b = 256, 64, 2
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=128, max_seq=s, n_layers=2, d_model=h, n_heads=4))
    chain = coarsen(trace(model, (torch.zeros(b, s, dtype=torch.long, device="meta"),), name="gpt"))
    layer = next(blk for blk in chain.blocks if blk.name == "layers.0")
    ours = gpt_layer_figures(GPTLayerShape(hidden_size=h, seq_len=s), b, "float32")
    assert ours.fwd_flops == pytest.approx(layer.fwd_flops, rel=0.01)
    assert ours.bwd_flops == pytest.approx(layer.bwd_flops, rel=0.01)
    assert ours.mem_traffic_bytes == pytest.approx(layer.mem_traffic_bytes, rel=0.01)
    assert ours.n_ops == len(layer.node_names)


def test_calibrates_a_device_from_its_tp1_files(metis_dir: Path) -> None:
    base = CATALOG["A100-40GB"]
    spec, cal = calibrate_from_metis(base, read_metis_profiles(metis_dir), SHAPE, "float16")
    assert cal.n_samples == 3 * 8 * 2 and cal.median_abs_rel_err < 0.05  # tp1 only: forward and backward
    assert 0.13 < spec.efficiency_for("float16") < 0.16
    assert spec.efficiency_for("bfloat16") == spec.efficiency_for("float16")
    assert spec.effective_flops_per_s("float32") == base.effective_flops_per_s("float32")
    assert spec.measured and "Metis" in spec.source
    for batch in (1, 2, 4):
        assert catalog_layer_ms(spec, batch) == pytest.approx(SAMPLES[(1, batch)][1], rel=0.05)


def test_a_cluster_device_takes_a_metis_profile(metis_dir: Path) -> None:
    path = metis_dir.parent / "cluster.yaml"
    path.write_text("hosts:\n  - name: a\n    region: r\n    trust: t\n    devices:\n"
                    "      - type: A100-40GB\n        count: 2\n"
                    "        metis_profile: {path: metis, hidden_size: 4096, seq_len: 1024, dtype: float16}\n")
    cluster = load_cluster(path)
    spec = cluster.devices[0].spec
    assert 0.13 < spec.efficiency_for("float16") < 0.16 and len(cluster.devices) == 2
    again = parse_cluster(json.loads(json.dumps(cluster.to_dict())))  # a plan carries the calibrated spec inline
    assert again.devices[0].spec == spec


def _write(d: Path, name: str, doc) -> Path:
    p = d / name
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return p


def _without(doc: dict, *keys: str) -> dict:
    doc = copy.deepcopy(doc)
    parent = doc
    for k in keys[:-1]:
        parent = parent[k]
    del parent[keys[-1]]
    return doc


def _with(doc: dict, value, *keys: str) -> dict:
    doc = copy.deepcopy(doc)
    parent = doc
    for k in keys[:-1]:
        parent = parent[k]
    parent[keys[-1]] = value
    return doc


GOOD = metis_doc(1, 1)


@pytest.mark.parametrize("name, doc, match", [
    ("DeviceType.A100_tp1_bs1.json", "{not json", "a JSON file"),
    ("DeviceType.A100_tp1_bs1.json", [1, 2], "Metis's profile layout"),
    ("DeviceType.A100_tp1_bs1.json", _without(GOOD, "execution_time", "layer_compute_total_ms"),
     "layer_compute_total_ms"),
    ("DeviceType.A100_tp1_bs1.json", _with(GOOD, [1.0] * 9 + [0.0], "execution_time", "layer_compute_total_ms"),
     "execution_time.layer_compute_total_ms.9"),
    ("DeviceType.A100_tp1_bs1.json", _with(GOOD, [1.0] * 9, "execution_time", "layer_compute_total_ms"),
     "one value per layer"),
    ("DeviceType.A100_tp1_bs1.json", _with(GOOD, "ten", "model", "num_layers"), "model.num_layers"),
    ("DeviceType.A100_tp1_bs1.json", _with(GOOD, ["x"] * 10, "execution_memory", "layer_memory_total_mb"),
     "layer_memory_total_mb"),
    ("a100_batch1.json", GOOD, "file name"),
])
def test_bad_files_are_one_clear_error(tmp_path: Path, name: str, doc, match: str) -> None:
    path = _write(tmp_path, name, doc)
    with pytest.raises(InvalidInputError, match=match) as info:
        read_metis_profile(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_missing_file_and_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="no such file"):
        read_metis_profile(tmp_path / "DeviceType.A100_tp1_bs1.json")
    with pytest.raises(InvalidInputError, match="DeviceType"):
        read_metis_profiles(tmp_path)


def test_a_directory_of_several_devices_gives_each_its_own(metis_dir: Path) -> None:
    other = _with(metis_doc(1, 1), [1.0] + [10.0] * 8 + [1.0], "execution_time", "layer_compute_total_ms")
    _write(metis_dir, "DeviceType.H100_tp1_bs1.json", other)
    profiles = read_metis_profiles(metis_dir)
    a100, _ = calibrate_from_metis(CATALOG["A100-80GB"], profiles, SHAPE)
    h100, _ = calibrate_from_metis(CATALOG["H100-80GB"], profiles, SHAPE)
    assert 0.13 < a100.efficiency_for("float16") < 0.16
    assert priced_layer_ms(h100, SHAPE, 1, "float16") == pytest.approx(10.0, rel=0.05)


def test_calibration_refuses_what_does_not_fit(metis_dir: Path, tmp_path: Path) -> None:
    profiles = read_metis_profiles(metis_dir)
    with pytest.raises(InvalidInputError, match="files of that device type"):
        calibrate_from_metis(CATALOG["T4"], profiles, SHAPE)
    with pytest.raises(InvalidInputError, match="tp1 files"):
        calibrate_from_metis(CATALOG["A100-40GB"], [p for p in profiles if p.tp == 2], SHAPE)
    with pytest.raises(InvalidInputError, match="check hidden_size"):  # 4x the hidden size: faster than the peak
        calibrate_from_metis(CATALOG["A100-40GB"], profiles, GPTLayerShape(hidden_size=16384, seq_len=1024))
    with pytest.raises(InvalidInputError, match="dtype"):
        calibrate_from_metis(CATALOG["A100-40GB"], profiles, SHAPE, "int8")
    with pytest.raises(InvalidInputError, match="hidden_size"):
        GPTLayerShape(hidden_size=0, seq_len=1024)


@pytest.mark.parametrize("entry, match", [
    ("{path: metis, hidden_size: 4096, seq_len: 1024}\n        efficiency: 0.3", "metis_profile with efficiency"),
    ("{path: metis, seq_len: 1024}", "missing hidden_size"),
    ("{path: metis, hidden_size: 4096, seq_len: 1024, dtype: int8}", "bad dtype"),
    ("{path: nowhere.json, hidden_size: 4096, seq_len: 1024}", "no such file"),
    ("{path: metis, hidden_size: 4096, seq_len: 1024, batch: 2}", "unknown key"),
])
def test_bad_metis_entries_in_a_cluster_file(metis_dir: Path, entry: str, match: str) -> None:
    path = metis_dir.parent / "cluster.yaml"
    path.write_text("hosts:\n  - name: a\n    region: r\n    trust: t\n    devices:\n"
                    f"      - type: A100-40GB\n        metis_profile: {entry}\n")
    with pytest.raises(InvalidInputError, match=match) as info:
        load_cluster(path)
    assert "line " in str(info.value) and "metis_profile" in str(info.value)
