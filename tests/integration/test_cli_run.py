"""`stagewise run` end to end: a short run with metrics and report, and one-line errors for bad input
and for a rank that dies."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

from planner.rehearsal import LocalTimes, predict_rehearsal
from tests.dist.plans import make_plan
from tests.unit.test_rehearsal import PROFILE

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "120"}


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "planner", "run", *args], check=False, capture_output=True, text=True,
                          env=ENV, timeout=300)


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    return make_plan("mlp-tiny", microbatch=2, num_microbatches=2, stages=[(0, 2), (3, 5)])


@pytest.fixture(scope="module")
def plan_path(plan, tmp_path_factory):
    return plan.save(tmp_path_factory.mktemp("plan") / "plan.json")


def _one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stagewise run: error: "), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    return lines[0]


def test_run_prints_predicted_vs_measured_and_writes_metrics_and_report(plan_path, tmp_path):
    metrics, report = tmp_path / "m.jsonl", tmp_path / "r.json"
    proc = cli(str(plan_path), "--steps", "3", "--timeout", "60", "--metrics", str(metrics), "--report", str(report))
    assert proc.returncode == 0, proc.stderr
    assert "predicted step" in proc.stdout and "measured step" in proc.stdout and "final loss" in proc.stdout
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert sorted((r["step"], r["rank"]) for r in rows) == [(s, r) for s in range(3) for r in range(2)]
    assert all(r["step_ms"] > 0 and r["compute_ms"] > 0 for r in rows)
    data = json.loads(report.read_text())
    assert data["steps"] == 3 and len(data["losses"]) == 3 and data["measured_step_ms"] > 0
    assert data["predicted_step_ms"] == pytest.approx(json.loads(plan_path.read_text())["predicted"]["step_ms"])


def test_missing_plan_is_one_line(cli_here, tmp_path):
    line = _one_line_error(cli_here("run", str(tmp_path / "nope.json")))
    assert "does not exist" in line


def test_bad_attack_spec_is_one_line(cli_here, plan_path):
    line = _one_line_error(cli_here("run", str(plan_path), "--attack", "rank=9,kind=zeros"))
    assert "rank" in line


def test_plan_for_another_model_is_one_line(cli_here, plan, tmp_path):
    other = dataclasses.replace(plan, model=dataclasses.replace(plan.model, fingerprint="0" * 64))
    line = _one_line_error(cli_here("run", str(other.save(tmp_path / "other.json")), "--steps", "1"))
    assert "does not match" in line


def test_dead_rank_is_one_line_naming_it(plan_path):
    line = _one_line_error(cli(str(plan_path), "--steps", "3", "--timeout", "10", "--fault", "1:die:1"))
    assert line.startswith("stagewise run: error: rank 1 died")



@pytest.mark.parametrize("args,needle", [(("--emulate-slowdown", "2"), "--emulate-speed as well"),
                                         (("--emulate-speed", "--emulate-slowdown", "0.5"), "factor >= 1")])
def test_bad_emulated_slowdown_is_one_line(cli_here, plan_path, args, needle):
    assert needle in _one_line_error(cli_here("run", str(plan_path), *args))


def test_emulated_slowdown_pads_every_rank(plan_path, tmp_path):
    """--emulate-slowdown 3 on a homogeneous plan: each rank's passes last 3x their CPU time."""
    report = tmp_path / "r.json"
    proc = cli(str(plan_path), "--steps", "2", "--emulate-speed", "--emulate-slowdown", "3", "--report", str(report))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(report.read_text())
    assert data["emulated"] and data["emulate_slowdown"] == 3.0
    assert [(r["fwd_factor"], r["bwd_factor"]) for r in data["ranks"]] == [(3.0, 3.0), (3.0, 3.0)]


def test_run_with_a_profile_prints_the_simulated_run_here(plan, plan_path, tmp_path):
    report = tmp_path / "report.json"
    proc = cli(str(plan_path), "--steps", "2", "--emulate-speed", "--emulate-slowdown", "2", "--profile", str(PROFILE),
               "--report", str(report))
    assert proc.returncode == 0, proc.stderr
    here = json.loads(report.read_text())["predicted_here"]
    assert here["plan"] == str(plan_path) and here["timed"] and here["step_ms"] > 2 * plan.predicted.step_ms
    row = next(line for line in proc.stdout.splitlines() if "predicted step here" in line)
    assert f"profile {here['profile']}, {here['cores']} cores" in row
    # The prediction times the plan's stages here (planner.profiling.rehearsal_times): the simulator on the
    # times the report keeps gives the printed step again.
    local = LocalTimes.from_json(here["timed_here"])
    assert len(local.fwd_ms) == plan.num_stages and all(ms > 0 for ms in local.fwd_ms + local.bwd_ms)
    again = predict_rehearsal(plan, PROFILE, emulate=True, slowdown=2.0, local=local).result.step_ms
    assert again == pytest.approx(here["step_ms"], rel=1e-9)
    printed = float(re.search(r"([0-9.]+) ms", row.split("│")[-2]).group(1))
    assert printed == pytest.approx(again, abs=0.0051)
    assert "measured / predicted here" in proc.stdout


def test_a_bad_profile_is_one_line_before_any_rank_starts(cli_here, plan_path, tmp_path):
    line = _one_line_error(cli_here("run", str(plan_path), "--steps", "1", "--profile", str(tmp_path / "none.json")))
    assert "an existing profile JSON file" in line
