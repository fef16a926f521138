"""The README's case end to end: a 3-stage gpt-tiny plan of 16 samples per microbatch (traced at one) recovers
from a lost host. `stagewise replan` then `stagewise run` runs; `run --replan-on-failure` re-plans around a
rank made to die and prints and reports every leg; SIGTERM in the second leg leaves a report that says it
was interrupted and still covers both legs, and no rank behind."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import yaml

from cost_models.cluster_file import parse_cluster
from planner.api import plan_chain
from planner.solver.policy import VerificationPolicy
from tests.conftest import REPO_ROOT
from tests.dist.plans import chain_for

CLUSTER = """name: three
hosts:
  - {name: h0, region: lab, trust: operator, trusted: true, devices: [{type: CPU, count: 1}]}
  - {name: h1, region: lab, trust: operator, trusted: true, devices: [{type: CPU, count: 1}]}
  - {name: h2, region: lab, trust: operator, trusted: true, devices: [{type: CPU, count: 1}]}
links:
  default: {bandwidth_gbps: 10, latency_ms: 0.1}
"""


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory):
    """As `stagewise plan gpt-tiny --stages 3` makes it when the solver picks 16 samples a microbatch: traced at
    one sample, signed with this machine's run secret."""
    chain = chain_for("gpt-tiny", batch=1, seq=None)
    plan = plan_chain(chain, parse_cluster(yaml.safe_load(CLUSTER)), spec="gpt-tiny", global_batch=32,
                      microbatch_size=16, policy=VerificationPolicy(enabled=False), time_limit_s=2, workers=1,
                      stages=3)
    assert (plan.model.batch, plan.config.microbatch_size, plan.num_ranks) == (1, 16, 3)
    return plan.save(tmp_path_factory.mktemp("plan") / "plan.json")


def _host_of(plan_path, rank: int) -> str:
    return json.loads(plan_path.read_text())["ranks"][rank]["host"]


def test_replan_then_run(run_cli, plan_path, tmp_path):
    new = tmp_path / "new.json"
    proc = run_cli("replan", str(plan_path), "--exclude", _host_of(plan_path, 1), "--time-limit", "3", "-o", str(new))
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("run", str(new), "--steps", "2")
    assert proc.returncode == 0 and "does not match" not in proc.stderr, proc.stderr


def test_run_replans_on_failure_and_reports_every_leg(run_cli, plan_path, tmp_path):
    report, ckpt = tmp_path / "report.json", tmp_path / "ckpt"
    proc = run_cli("run", str(plan_path), "--steps", "3", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1",
                   "--replan-on-failure", "1", "--fault", "1:die:1", "--report", str(report))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(report.read_text())
    (replanned,) = data["replans"]
    assert replanned["excluded"] == _host_of(plan_path, 1) and replanned["resumed_after_step"] == 0
    assert [(leg["ended"], leg["first_step"], leg["last_step"]) for leg in data["legs"]] == [
        ("failure", 0, 0), ("finished", 1, 2)]
    assert (data["steps_run"], data["steps_redone"], data["steps"]) == (3, 0, 2)
    out = " ".join(proc.stdout.split())  # the table, wrapped at any width
    assert "3 steps in 2 legs" in out and "ended: failure" in out and "ended: finished" in out
    assert "recovered: re-planned without host" in out


def test_sigterm_in_a_recovered_run_reports_both_legs_interrupted(plan_path, tmp_path):
    report, ckpt = tmp_path / "report.json", tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-m", "planner", "run", str(plan_path), "--steps", "100000",
                             "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1", "--replan-on-failure", "1",
                             "--fault", "1:die:1", "--report", str(report)], cwd=REPO_ROOT,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "COLUMNS": "120"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    second = str(ckpt / "plan-replan-1.json")
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:  # until rank 0 of the second leg reports a step
        try:
            if json.loads(report.read_text()).get("plan") == second:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before its second leg"
    ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err
    _, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive, f"orphaned ranks {[p.pid for p in alive]}"
    data = json.loads(report.read_text())
    assert data["failed"] and data["interrupted"] and "interrupted" in data["error"]
    assert [leg["ended"] for leg in data["legs"]] == ["failure", "interrupted"] and len(data["replans"]) == 1
    assert data["legs"][1]["plan"] == second and data["legs"][1]["steps"] >= 1
