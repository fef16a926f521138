"""`stagewise plan` end to end: a plan file that loads, and one clear line for each bad input."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TWO_BOXES = """
name: two-boxes
hosts:
  - {name: a, region: r, trust: op, trusted: true, devices: [{type: T4, count: 1}]}
  - {name: b, region: r, trust: op, trusted: true, devices: [{type: T4, count: 1}]}
  - {name: v, region: r, trust: vol, devices: [{type: RTX3090, count: 1}]}
links:
  default: {bandwidth_gbps: 10, latency_ms: 1}
"""


def _stagewise(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "planner", *args], check=False, cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=300)


def test_plan_writes_a_loadable_plan_on_the_default_cluster(tmp_path: Path) -> None:
    res = _stagewise("plan", "gpt-tiny", "--time-limit", "5", "--workers", "1", "-o", "out/plan.json",
                     cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "objective" in res.stdout and "bound" in res.stdout and "gap" in res.stdout
    doc = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert doc["report"]["method"] == "cpsat" and doc["report"]["bound_ms"] <= doc["report"]["objective_ms"]
    from planner.plan_load import load_plan
    plan = load_plan(tmp_path / "out" / "plan.json")
    assert plan.config.global_batch == 16 and plan.num_stages >= 1


def test_baseline_and_fixed_microbatches(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text(TWO_BOXES)
    res = _stagewise("plan", "gpt-tiny", "--cluster", "c.yaml", "--baseline", "uniform", "--global-batch", "8",
                     "--microbatches", "4", "--schedule", "gpipe", "-o", "p.json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["report"]["method"] == "baseline:uniform" and doc["config"]["schedule"] == "gpipe"
    assert doc["config"]["microbatch_size"] == 2


def test_ppdp_baseline_and_a_fixed_shape_are_honoured(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text(TWO_BOXES)
    res = _stagewise("plan", "gpt-tiny", "--cluster", "c.yaml", "--baseline", "ppdp", "-o", "grid.json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert json.loads((tmp_path / "grid.json").read_text())["report"]["method"] == "baseline:ppdp"
    res = _stagewise("plan", "gpt-tiny", "--cluster", "c.yaml", "--stages", "1", "--replicas", "2", "--time-limit",
                     "5", "--workers", "1", "--no-verify", "-o", "shape.json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "simulated step" in res.stdout and "objective" in res.stdout
    doc = json.loads((tmp_path / "shape.json").read_text())
    assert len(doc["stages"]) == 1 and sum(1 for r in doc["ranks"] if r["stage"] == 0) == 2


@pytest.mark.parametrize("args,phrase", [
    (("--stages", "9"), "--stages; expected 1..3 (the cluster's 3 stage devices"),
    (("--stages", "2", "--replicas", "2"), "--stages x --replicas; expected at most the cluster's 3 stage devices"),
    (("--stages", "0"), "--stages; expected a whole number >= 1"),
    (("--baseline", "ppdp", "--replicas", "2"), "--baseline with --stages/--replicas; expected one of them"),
    (("--global-batch", "16", "--microbatches", "3"), "--microbatches 3; expected a divisor of --global-batch 16"),
    (("--gap", "1.5"), "--gap; expected a relative gap in [0, 1)"),
    (("--audit-cost", "-1"), "fix: pass --audit-cost between 0 and 10"),
    (("--audit-within", "0"), "fix: pass --audit-within between 1 and 1000"),
    (("--link-tests-cost", "11"), "fix: pass --link-tests-cost between 0 and 10"),
    (("--cluster", "missing.yaml"), "cluster file 'missing.yaml'"),
    (("--cluster", "t4.yaml", "--global-batch", "2", "--microbatches", "1"),
     "the model needs 22.7 GB for weights, gradients and optimizer state; the cluster's usable memory is 15.5 GB"),
])
def test_bad_input_is_one_line_and_exit_2(cli_here, tmp_path: Path, args, phrase) -> None:
    (tmp_path / "t4.yaml").write_text(
        "hosts: [{name: a, region: r, trust: op, trusted: true, devices: [{type: T4, count: 1}]}]\n")
    if "--stages" in args or "--replicas" in args:
        (tmp_path / "c.yaml").write_text(TWO_BOXES)
        args = ("--cluster", "c.yaml", *args)
    model = "gpt-1.3b" if "t4.yaml" in args else "gpt-tiny"  # 1.3B parameters x 16 B of Adam state
    res = cli_here("plan", model, *args, "--time-limit", "5", "--no-verify", cwd=tmp_path)  # main, in this process
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("stagewise plan: error:"), res.stderr
    assert phrase in lines[0]
    assert not (tmp_path / "plan.json").exists()


ISSUE_37_SIX = """
name: issue37-six
hosts:
  - {name: t0, region: lab, trust: operator, trusted: true, devices: [{type: T4, count: 2}]}
  - {name: t1, region: lab, trust: operator, trusted: true, devices: [{type: T4, count: 2}]}
  - {name: v1, region: lab, trust: vol1, devices: [{type: T4, count: 1}]}
  - {name: v2, region: lab, trust: vol2, devices: [{type: T4, count: 1}]}
  - {name: v3, region: lab, trust: vol3, devices: [{type: T4, count: 1}]}
  - {name: cpu, region: lab, trust: operator, trusted: true, role: verifier, devices: [{type: CPU, count: 1}]}
links:
  default: {bandwidth_gbps: 10, latency_ms: 0.1}
"""


def test_audit_within_one_step_audits_every_microbatch_of_the_untrusted_replicas(cli_here, tmp_path: Path) -> None:
    """Issue 37's shape (two untrusted replicas of the middle stage, one microbatch each a step): ``--audit-within
    1`` turns the share to 1 in 1 where ``--audit-cost`` pays for it, priced into the objective, said in the notes."""
    (tmp_path / "six.yaml").write_text(ISSUE_37_SIX)
    res = cli_here("plan", "gpt-tiny", "--cluster", "six.yaml", "--stages", "3", "--replicas", "2", "--audit-within",
                   "1", "--audit-cost", "1", "--time-limit", "5", "--workers", "1", "-o", "p.json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    doc = json.loads((tmp_path / "p.json").read_text())
    assert [st["audit_every"] for st in doc["stages"]] == [0, 1, 0]
    assert doc["policy"]["audit_within_steps"] == 1
    # the stage after (t1) is trusted: it copies the auditor the gradients it sent (audits from copies see gradients)
    assert "stage 1: replicas audited by cpu/0, every microbatch (outputs and input gradients)" in \
        " ".join(res.stdout.split())
