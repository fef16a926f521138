"""Cluster files: every example loads, links resolve by pair, bad files give one clear error."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from cost_models.cluster import DEFAULT_CLUSTER_PATH, PACKAGED_CLUSTERS_DIR, Link
from cost_models.cluster_file import load_cluster, parse_cluster
from cost_models.devices import CATALOG, PROFILE_SCHEMA
from planner.errors import InvalidInputError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(PACKAGED_CLUSTERS_DIR.glob("*.yaml"))
FIXTURES = ROOT / "tests" / "fixtures" / "clusters"


def test_packaged_clusters_exist_once() -> None:
    names = [p.stem for p in EXAMPLES]
    assert {"default", "swarm-t4", "dc-a100-v100", "box-8gpu"} <= set(names)
    assert EXAMPLES[0].parent == DEFAULT_CLUSTER_PATH.parent
    assert not list(ROOT.glob("examples/**/*.yaml")), "cluster files live once, in cost_models/clusters/"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_loads_and_round_trips(path: Path) -> None:
    cluster = load_cluster(path)
    assert cluster.devices
    assert parse_cluster(cluster.to_dict()) == cluster
    assert parse_cluster(json.loads(json.dumps(cluster.to_dict()))) == cluster
    for d in cluster.devices:
        assert cluster.device(d.id) is d
        assert d.id.startswith(d.host + "/")


def test_default_cluster_shape() -> None:
    c = load_cluster("default")  # a packaged name resolves
    assert c == load_cluster(DEFAULT_CLUSTER_PATH)
    assert 6 <= len(c.devices) <= 10
    assert len(c.region_names) == 2
    assert any(not d.trusted for d in c.devices) and any(d.trusted for d in c.devices)
    verifier = c.host("verifier")
    assert verifier.role == "verifier" and verifier.devices[0].cpu_only
    assert verifier.devices[0] not in c.stage_devices and verifier.devices[0] in c.trusted_devices
    assert [d.id for d in c.host("dc-a100").devices] == ["dc-a100/0", "dc-a100/1"]


def test_link_resolution_by_pair() -> None:
    c = load_cluster(DEFAULT_CLUSTER_PATH)
    assert c.link("dc-a100/0", "dc-a100/1") == Link(bandwidth_gbps=2400, latency_ms=0.005)  # host override
    assert c.link("cloud-t4/0", "cloud-t4/1") == Link(bandwidth_gbps=256, latency_ms=0.01)  # cluster intra
    assert c.link("dc-a100/0", "volunteer-1/0") == Link(bandwidth_gbps=1, latency_ms=15)  # host pair
    assert c.link("volunteer-1/0", "dc-a100/1") == c.link("dc-a100/0", "volunteer-1/0")  # symmetric
    assert c.link("volunteer-1/0", "cloud-t4/0") == Link(bandwidth_gbps=0.5, latency_ms=80)  # region pair
    assert c.link("cloud-t4/0", "lab-l4/0") == Link(bandwidth_gbps=10, latency_ms=1)  # default
    with pytest.raises(InvalidInputError, match="no device 'nope/0'"):
        c.link("nope/0", "dc-a100/0")


def test_link_units() -> None:
    assert Link(bandwidth_gbps=8, latency_ms=0).bytes_per_s == pytest.approx(1e9)
    with pytest.raises(InvalidInputError):
        Link(bandwidth_gbps=0, latency_ms=1)
    with pytest.raises(InvalidInputError):
        Link(bandwidth_gbps=1, latency_ms=-1)


# fixture file -> (field path in the message, 1-based line, a phrase)
BAD = {
    "unknown_device.yaml": ("hosts[0].devices[0].type", 6, "did you mean A100-80GB"),
    "zero_bandwidth.yaml": ("links.default.bandwidth_gbps", 8, "positive"),
    "negative_bandwidth.yaml": ("links.regions[0].bandwidth_gbps", 13, "found -5"),
    "undefined_region.yaml": ("links.regions[0].between", 9, "undefined region 'eu-wst'"),
    "undefined_host.yaml": ("links.hosts[0].between", 9, "undefined host 'ghost'"),
    "duplicate_host.yaml": ("hosts[1].name", 7, "duplicate host name 'a'"),
    "missing_trust.yaml": ("hosts[0].trust", 3, "missing trust domain"),
    "missing_profile.yaml": ("hosts[0].devices[0].type", 6, "does not exist"),
    "empty_cluster.yaml": ("hosts", 2, "empty cluster"),
    "untrusted_verifier.yaml": ("hosts[1].trusted", 7, "must be trusted"),
    "unknown_key.yaml": ("hosts[0].trsted", 6, "unknown key"),
}


def test_every_fixture_is_covered() -> None:
    assert {p.name for p in FIXTURES.glob("*.yaml")} == set(BAD)


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_cluster_gives_one_clear_error(name: str) -> None:
    field, line, phrase = BAD[name]
    with pytest.raises(InvalidInputError) as info:
        load_cluster(FIXTURES / name)
    msg = str(info.value)
    assert "\n" not in msg
    assert f"line {line}: {field}:" in msg, msg
    assert phrase in msg, msg


def test_yaml_syntax_error_and_duplicate_keys_give_lines(tmp_path: Path) -> None:
    bad = tmp_path / "c.yaml"
    bad.write_text("hosts:\n  - name: a\n    region: [r1\n")
    with pytest.raises(InvalidInputError, match="invalid YAML"):
        load_cluster(bad)
    bad.write_text("hosts:\n  - name: a\n    name: b\n    region: r\n    trust: t\n    devices: [{type: T4}]\n")
    with pytest.raises(InvalidInputError, match=r"line 3: hosts\[0\]\.name: duplicate key"):
        load_cluster(bad)
    with pytest.raises(InvalidInputError, match="no such file"):
        load_cluster(tmp_path / "missing.yaml")


def _cluster_dict(**host_extra) -> dict:
    host = {"name": "h", "region": "r", "trust": "t", "devices": [{"type": "T4", "count": 2}], **host_extra}
    return {"name": "x", "hosts": [host]}


def test_from_dict_defaults_and_errors_without_lines() -> None:
    c = parse_cluster(_cluster_dict())
    assert [d.id for d in c.devices] == ["h/0", "h/1"]
    assert not c.devices[0].trusted and c.devices[0].spec == CATALOG["T4"]
    with pytest.raises(InvalidInputError, match=r"^cluster: hosts\[0\]\.devices\[0\]\.count: bad count"):
        parse_cluster(_cluster_dict(devices=[{"type": "T4", "count": 0}]))
    with pytest.raises(InvalidInputError, match="verifier host is CPU-only"):
        parse_cluster(_cluster_dict(role="verifier", trusted=True))
    with pytest.raises(InvalidInputError, match="efficiency"):
        parse_cluster(_cluster_dict(devices=[{"type": "T4", "efficiency": 2}]))


def test_efficiency_override_and_profiled_device_round_trip(tmp_path: Path) -> None:
    profile = {"schema": PROFILE_SCHEMA, "device": {
        "name": "my-box", "kind": "cpu", "peak_flops": {"float32": 2e11}, "mem_bytes": 8 << 30,
        "mem_bw_bytes_per_s": 2e10, "efficiency": 0.7, "measured": True}}
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "box.json").write_text(json.dumps(profile))
    data = _cluster_dict(devices=[{"type": "T4", "efficiency": 0.2}, {"type": "profiles/box.json", "count": 1}])
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    c = load_cluster(path)  # the profile path is relative to the cluster file, not the cwd
    assert c.devices[0].spec.efficiency == 0.2
    assert c.devices[1].spec.name == "my-box" and c.devices[1].spec.measured and c.devices[1].cpu_only
    d = c.to_dict()
    assert d["hosts"][0]["devices"][0] == {"type": "T4", "efficiency": 0.2, "count": 1}
    assert d["hosts"][0]["devices"][1]["spec"]["name"] == "my-box"  # inlined: portable without the file
    assert parse_cluster(d) == c


def test_json_cluster_file(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps(load_cluster(DEFAULT_CLUSTER_PATH).to_dict()))
    assert load_cluster(path) == load_cluster(DEFAULT_CLUSTER_PATH)
    path.write_text("{bad json")
    with pytest.raises(InvalidInputError, match="invalid JSON"):
        load_cluster(path)


def test_pair_links_check_their_ends_and_keep_their_kind() -> None:
    from cost_models.cluster import HostLink, RegionLink

    link = Link(bandwidth_gbps=1.0, latency_ms=2.0)
    with pytest.raises(InvalidInputError, match="RegionLink.between"):
        RegionLink(between=("us-east",), link=link)
    with pytest.raises(InvalidInputError, match="HostLink.between"):
        HostLink(between=("a", ""), link=link)
    region, host = RegionLink(between=("a", "b"), link=link), HostLink(between=("a", "b"), link=link)
    assert region.to_dict() == host.to_dict() == {"between": ["a", "b"], "bandwidth_gbps": 1.0, "latency_ms": 2.0}
    assert region != host  # a region pair and a host pair are different things


def test_unknown_device_or_host_lookup_names_the_choices() -> None:
    cluster = load_cluster(DEFAULT_CLUSTER_PATH)
    with pytest.raises(InvalidInputError, match=r"no device 'dc-a100/9'.*expected one of dc-a100/0"):
        cluster.device("dc-a100/9")
    with pytest.raises(InvalidInputError, match=r"no host 'nowhere'.*found 'nowhere'"):
        cluster.host("nowhere")
