"""`stagewise simulate --cores/--sharing/--emulated` and `stagewise profile --statistic/--sharing` end to end."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cost_models.measured import CoreSharing, MessageCost
from planner.plan_load import load_plan
from planner.rehearsal import predict_rehearsal
from planner.simulate import simulate
from tests.unit.test_rehearsal import PROFILE

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "golden_plan.json"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "COLUMNS": "120"}


def cli(*args: str, cwd: Path | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "planner", *args], check=False, capture_output=True, text=True, env=ENV,
                          cwd=cwd, timeout=timeout)


def _one_line_error(proc: subprocess.CompletedProcess, command: str, phrase: str) -> None:
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"stagewise {command}: error: ") and phrase in lines[0], proc.stderr


def test_simulate_with_shared_cores_prints_that_step(cli_here):
    plan = load_plan(GOLDEN)
    one_core = simulate(plan, cores=1).step_ms
    assert one_core > simulate(plan).step_ms  # the option changes the answer
    proc = cli_here("simulate", str(GOLDEN), "--cores", "1", env=ENV)  # main, in this process
    assert proc.returncode == 0, proc.stderr
    assert f"step {one_core:.3f} ms" in proc.stdout and "share 1 core(s), split evenly" in proc.stdout


def test_simulate_with_a_measured_sharing_table(cli_here, tmp_path):
    table = CoreSharing(cores=2, speed=(1.0, 0.7, 0.45, 0.33))
    profile = tmp_path / "cpu.json"
    profile.write_text(json.dumps({"sharing": table.to_dict()}))
    plan = load_plan(GOLDEN)
    expected = simulate(plan, cores=2, sharing=table, emulated=True).step_ms
    assert expected != simulate(plan, cores=2).step_ms
    proc = cli_here("simulate", str(GOLDEN), "--sharing", str(profile), "--emulated", env=ENV)  # --cores from the table
    assert proc.returncode == 0, proc.stderr
    assert f"step {expected:.3f} ms" in proc.stdout and "at the measured sharing speeds" in proc.stdout


def test_simulate_with_measured_message_costs(cli_here, tmp_path):
    cost = MessageCost(send_ms=0.4, recv_ms=0.3, send_ms_per_mib=0.5, recv_ms_per_mib=0.5)
    profile = tmp_path / "cpu.json"
    profile.write_text(json.dumps({"p2p": {"latency_ms": 0.1, "bandwidth_gbps": 10.0, "messages": cost.to_dict()}}))
    plan = load_plan(GOLDEN)
    expected = simulate(plan, cores=1, messages=cost).step_ms
    assert expected > simulate(plan, cores=1).step_ms
    proc = cli_here("simulate", str(GOLDEN), "--cores", "1", "--messages", str(profile), env=ENV)
    assert proc.returncode == 0, proc.stderr
    assert f"step {expected:.3f} ms" in proc.stdout and "messages cost their sender 0.400 ms" in proc.stdout


def test_simulate_rehearse_prints_the_run_on_the_profiled_machine():
    plan = load_plan(GOLDEN)
    here = predict_rehearsal(plan, PROFILE, emulate=True, slowdown=2.0, cores=3)
    proc = cli("simulate", str(GOLDEN), "--rehearse", str(PROFILE), "--emulate-slowdown", "2", "--cores", "3")
    assert proc.returncode == 0, proc.stderr
    assert f"step {here.result.step_ms:.3f} ms" in proc.stdout and f"{here.device}, 3 core(s)" in proc.stdout
    assert f"on the planned devices {plan.predicted.step_ms:.3f} ms" in proc.stdout


@pytest.mark.parametrize("args,phrase", [
    (("--rehearse", "missing.json"), "an existing profile JSON file"),
    (("--emulate-slowdown", "2"), "--rehearse PROFILE as well"),
    (("--rehearse", str(PROFILE), "--emulate-slowdown", "0.5"), "factor >= 1"),
    (("--rehearse", str(PROFILE), "--messages", str(PROFILE)), "--rehearse takes it from its profile"),
    (("--cores", "0"), "--cores; expected >= 1; found 0"),
    (("--sharing", "PROFILE"), "a profile with a core sharing table"),
    (("--sharing", "missing.json"), "a readable profile JSON"),
    (("--messages", "PROFILE"), "a profile with per-message CPU costs"),
    (("--messages", "missing.json"), "a readable profile JSON"),
])
def test_simulate_bad_options_give_one_line(cli_here, tmp_path, args, phrase):
    (tmp_path / "PROFILE").write_text(json.dumps({"sharing": None}))
    proc = cli_here("simulate", str(GOLDEN), *args, cwd=tmp_path)  # main, in this process
    _one_line_error(proc, "simulate", phrase)
    assert proc.stdout == ""


def test_profile_rejects_an_unknown_statistic(cli_here, tmp_path):
    proc = cli_here("profile", "--quick", "--no-p2p", "--statistic", "mean", "-o", "x.json", cwd=tmp_path)
    _one_line_error(proc, "profile", "--statistic; expected min or median; found 'mean'")
    assert not (tmp_path / "x.json").exists()


@pytest.mark.slow
def test_profile_with_the_median_and_core_sharing(tmp_path):
    proc = cli("profile", "--quick", "--no-p2p", "--threads", "1", "--statistic", "median", "--sharing",
               "-o", "me.json", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((tmp_path / "me.json").read_text())
    assert doc["settings"]["statistic"] == "median" and doc["settings"]["sharing"] is True
    table = CoreSharing.from_dict(doc["sharing"])
    assert table.cores == os.cpu_count() and len(table.speed) == 2 * table.cores
    assert "processes at once" in proc.stdout
