"""A rank that dies or hangs stops the run within the timeout with one error naming it; a plan for
another model is refused before any process starts."""
from __future__ import annotations

import dataclasses
import json

import pytest

from planner.errors import PlanMismatchError, RankFailureError
from planner.runtime.launcher.launch import launch
from planner.runtime.options import FaultSpec, RunOptions
from tests.dist.plans import make_plan

TIMEOUT_S = 6.0


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory):
    plan = make_plan("mlp-tiny", microbatch=2, num_microbatches=3, stages=[(0, 1), (2, 3), (4, 5)])
    return plan.save(tmp_path_factory.mktemp("plan") / "plan.json")


@pytest.mark.parametrize("kind,expected", [("hang", "rank 1 hung"), ("die", "rank 1 died (exited with code 17")])
def test_failed_rank_is_named_and_the_others_stop(plan_path, tmp_path, kind, expected):
    logs = tmp_path / "logs"
    opts = RunOptions(plan=str(plan_path), steps=3, timeout_s=TIMEOUT_S, fault=FaultSpec(rank=1, kind=kind, step=1))
    with pytest.raises(RankFailureError) as info:
        launch(opts, log_dir=logs)
    message = str(info.value)
    assert message.startswith(expected) and "\n" not in message
    records = {p.name: json.loads(p.read_text()) for p in logs.glob("rank*.json")}
    # ranks 0 and 2 both lost rank 1 (directly) and said so; a hang is noticed through the timeout
    assert {r["peer"] for r in records.values()} == {1}
    assert set(records) == {"rank0.json", "rank2.json"}
    if kind == "hang":
        assert any("did not answer within the timeout" in r["error"] for r in records.values())


def test_a_failed_run_leaves_a_report_with_the_steps_it_finished(plan_path, tmp_path):
    """Rank 0 rewrites --report as the run goes: a rank dying at step 3 leaves one with the steps rank 0
    had published, beside the error."""
    report = tmp_path / "report.json"
    opts = RunOptions(plan=str(plan_path), steps=5, timeout_s=TIMEOUT_S, report=str(report),
                      fault=FaultSpec(rank=1, kind="die", step=3))
    with pytest.raises(RankFailureError):
        launch(opts)
    data = json.loads(report.read_text())
    assert data["failed"] and "rank 1 died" in data["error"] and "in_progress" not in data
    assert 1 <= data["steps"] <= 3 and len(data["losses"]) == data["steps"]
    assert all(loss is not None for loss in data["losses"])


def test_plan_for_another_model_is_refused_before_any_process_starts(tmp_path):
    plan = make_plan("gpt-tiny", microbatch=2, num_microbatches=2, seq=16, stages=[(0, 2), (3, 5)])
    changed = dataclasses.replace(plan, model=dataclasses.replace(plan.model, seq=8))  # the model now sees T=8
    path = changed.save(tmp_path / "plan.json")
    logs = tmp_path / "logs"
    with pytest.raises(PlanMismatchError, match="does not match"):
        launch(RunOptions(plan=str(path), steps=1), log_dir=logs)
    assert not logs.exists()  # refused before a single rank was started
