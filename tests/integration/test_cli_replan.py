"""`stagewise replan`: a signed plan solved again without a host, written signed, then with the host
re-admitted (the history says so, `show` prints it); bad exclusions, bad re-admissions and a plan edited
since signing are one line and exit 2, with no file written."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from planner.plan_load import load_plan
from tests.conftest import REPO_ROOT

CLUSTER = """name: three
hosts:
  - {name: h0, region: lab, trust: operator, trusted: true, devices: [{type: T4, count: 1}]}
  - {name: h1, region: lab, trust: operator, trusted: true, devices: [{type: T4, count: 1}]}
  - {name: h2, region: lab, trust: rig, devices: [{type: T4, count: 1}]}
links:
  default: {bandwidth_gbps: 10, latency_ms: 0.1}
"""


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> Path:
    """The signed plan, planned once for the module (``stagewise plan`` takes seconds)."""
    folder = tmp_path_factory.mktemp("planned")
    (folder / "three.yaml").write_text(CLUSTER)
    out = folder / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "planner", "plan", "gpt-tiny", "--cluster", str(folder / "three.yaml"),
                           "--stages", "3", "--no-verify", "--time-limit", "3", "-o", str(out)], check=False,
                          cwd=REPO_ROOT, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT)),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return folder


@pytest.fixture
def plan_path(planned, tmp_path):
    """A copy of the module's plan (and its cluster file) a test may edit."""
    for name in ("three.yaml", "plan.json"):
        shutil.copy(planned / name, tmp_path / name)
    return tmp_path / "plan.json"


def test_replan_without_a_host(run_cli, plan_path, tmp_path):
    new = tmp_path / "new.json"
    proc = run_cli("replan", str(plan_path), "--exclude", "h2", "--why", "rank 2 died", "--time-limit", "3",
                   "-o", str(new))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(new.read_text())
    assert "signature" in data and all(r["host"] != "h2" for r in data["ranks"])
    assert data["report"]["notes"][0].startswith("replanned without h2: rank 2 died")
    assert "replanned without h2" in proc.stdout


def test_exclude_then_readmit_puts_the_host_back_with_its_history(run_cli, plan_path, tmp_path):
    without, back = tmp_path / "without.json", tmp_path / "back.json"
    proc = run_cli("replan", str(plan_path), "--exclude", "h2", "--why", "rig banned", "--time-limit", "3",
                   "-o", str(without))
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("replan", str(without), "--readmit", "h2", "--why", "banned by mistake", "--time-limit", "3",
                   "-o", str(back))
    assert proc.returncode == 0, proc.stderr
    assert load_plan(without).excluded_hosts == ("h2",)
    plan = load_plan(back)
    assert plan.excluded_hosts == () and "h2" in {h.name for h in plan.effective_cluster().hosts}
    assert [(e.event, e.excluded_hosts, e.readmitted_hosts, e.reason) for e in plan.history][1:] == [
        ("manual", ("h2",), (), "rig banned"), ("readmit", (), ("h2",), "banned by mistake")]
    assert plan.history[0].event == "planned" and plan.history[2].previous_ranks == load_plan(without).num_ranks
    proc = run_cli("show", str(back), "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    at = lines.index("history (3):")
    assert [line.split()[:3:2] for line in lines[at + 1:at + 4]] == [["1.", "planned:"], ["2.", "manual:"],
                                                                   ["3.", "readmit:"]]
    assert "re-admitted h2; banned by mistake (was " in lines[at + 3]


@pytest.mark.parametrize("extra,message", [(("--exclude", "h9"), "exclude host 'h9'"),
                                           (("--exclude-domain", "nobody"), "exclude trust domain 'nobody'"),
                                           (("--readmit", "h1"), "readmit host 'h1'"),
                                           (("--readmit", "h9"), "readmit host 'h9'"),
                                           ((), "at least one host")])
def test_bad_exclusions_are_one_line(cli_here, plan_path, tmp_path, extra, message):
    new = tmp_path / "new.json"
    proc = cli_here("replan", str(plan_path), *extra, "-o", str(new))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr
    assert not new.exists()


def test_a_plan_edited_after_signing_is_not_replanned(cli_here, plan_path, tmp_path):
    data = json.loads(plan_path.read_text())
    data["config"]["optimizer"] = "sgd"
    plan_path.write_text(json.dumps(data))
    new = tmp_path / "new.json"
    proc = cli_here("replan", str(plan_path), "--exclude", "h2", "-o", str(new))
    assert proc.returncode == 2 and "does not match its signature" in proc.stderr and not new.exists()
