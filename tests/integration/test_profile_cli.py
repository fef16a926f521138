"""`stagewise profile --quick` end to end: a profile JSON that a cluster file can name as a device type."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cost_models.cluster_file import load_cluster
from cost_models.devices import PROFILE_SCHEMA, get_device_spec
from cost_models.measured import load_message_cost

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _stagewise(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "planner", *args], check=False, cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=240)


def test_profile_quick_writes_a_usable_profile(tmp_path: Path) -> None:
    res = _stagewise("profile", "--quick", "--threads", "1", "-o", "prof/me.json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    doc = json.loads((tmp_path / "prof" / "me.json").read_text())
    assert doc["schema"] == PROFILE_SCHEMA
    assert {b["name"] for b in doc["blocks"]} >= {"embed", "layers.0", "head"}
    assert doc["p2p"]["bandwidth_gbps"] > 0 and doc["p2p"]["latency_ms"] >= 0
    messages = load_message_cost(doc)  # the CPU time a message costs each end, fitted over the probe's sizes
    assert messages is not None and messages.send_cpu_ms(1 << 20) > 0 and messages.recv_cpu_ms(1 << 20) > 0
    assert len(doc["p2p"]["posting"]) >= 2 and "CPU per message" in res.stdout
    spec = get_device_spec(str(tmp_path / "prof" / "me.json"))
    assert spec.measured and spec.kind == "cpu" and 0 < spec.efficiency <= 1
    assert spec.flops_per_s("float32") > 1e8 and spec.p2p_bandwidth_gbps == doc["p2p"]["bandwidth_gbps"]
    assert spec.optim_op_ms is not None and 0 < spec.optim_op_ms < 1.0  # ms per kernel
    assert "optimizer kernel" in res.stdout
    (tmp_path / "cluster.yaml").write_text(
        "hosts:\n  - {name: me, region: here, trust: me, trusted: true, devices: [{type: prof/me.json, count: 2}]}\n")
    cluster = load_cluster(tmp_path / "cluster.yaml")
    assert [d.spec for d in cluster.devices] == [spec, spec]


@pytest.mark.parametrize("args,phrase", [
    (("--model", "gpt-tinyy"), "unknown model 'gpt-tinyy'"),
    (("--clock", "cpu", "--threads", "2"), "one thread"),
    (("--batch", "0"), "--batch"),
    (("--threads", "0"), "--threads"),
])
def test_profile_bad_arguments_give_one_line(cli_here, tmp_path: Path, args: tuple[str, ...], phrase: str) -> None:
    res = cli_here("profile", "--quick", "--no-p2p", *args, "-o", "x.json", cwd=tmp_path)  # main, in this process
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and phrase in lines[0], res.stderr
    assert not (tmp_path / "x.json").exists()
