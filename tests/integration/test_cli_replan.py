"""`stagewise replan`: a signed plan solved again without a host, written signed; bad exclusions and a
plan edited since signing are one line and exit 2, with no file written."""
from __future__ import annotations

import json

import pytest

CLUSTER = """name: three
hosts:
  - {name: h0, region: lab, trust: operator, trusted: true, devices: [{type: T4, count: 1}]}
  - {name: h1, region: lab, trust: operator, trusted: true, devices: [{type: T4, count: 1}]}
  - {name: h2, region: lab, trust: rig, devices: [{type: T4, count: 1}]}
links:
  default: {bandwidth_gbps: 10, latency_ms: 0.1}
"""


@pytest.fixture
def plan_path(run_cli, tmp_path):
    (tmp_path / "three.yaml").write_text(CLUSTER)
    out = tmp_path / "plan.json"
    proc = run_cli("plan", "gpt-tiny", "--cluster", str(tmp_path / "three.yaml"), "--stages", "3", "--no-verify",
                   "--time-limit", "3", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    return out


def test_replan_without_a_host(run_cli, plan_path, tmp_path):
    new = tmp_path / "new.json"
    proc = run_cli("replan", str(plan_path), "--exclude", "h2", "--why", "rank 2 died", "--time-limit", "3",
                   "-o", str(new))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(new.read_text())
    assert "signature" in data and all(r["host"] != "h2" for r in data["ranks"])
    assert data["report"]["notes"][0].startswith("replanned without h2: rank 2 died")
    assert "replanned without h2" in proc.stdout


@pytest.mark.parametrize("extra,message", [(("--exclude", "h9"), "exclude host 'h9'"),
                                           (("--exclude-domain", "nobody"), "exclude trust domain 'nobody'"),
                                           ((), "at least one host")])
def test_bad_exclusions_are_one_line(run_cli, plan_path, tmp_path, extra, message):
    new = tmp_path / "new.json"
    proc = run_cli("replan", str(plan_path), *extra, "-o", str(new))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr
    assert not new.exists()


def test_a_plan_edited_after_signing_is_not_replanned(run_cli, plan_path, tmp_path):
    data = json.loads(plan_path.read_text())
    data["config"]["optimizer"] = "sgd"
    plan_path.write_text(json.dumps(data))
    new = tmp_path / "new.json"
    proc = run_cli("replan", str(plan_path), "--exclude", "h2", "-o", str(new))
    assert proc.returncode == 2 and "does not match its signature" in proc.stderr and not new.exists()
