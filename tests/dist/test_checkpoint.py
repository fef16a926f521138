"""Checkpoints and --resume: a run stopped and resumed ends with the weights of one that never stopped,
on the same stage layout and on another one (gloo, one process per rank, one thread each)."""
from __future__ import annotations

import pytest
import torch

from planner.errors import InvalidInputError
from planner.runtime.launcher.launch import launch
from planner.runtime.options import RunOptions
from planner.runtime.recovery import checkpoint
from tests.dist.plans import load_dumps, make_plan

torch.set_num_threads(1)
STEPS = 4


def _params(folder, num_ranks) -> dict[str, torch.Tensor]:
    out = {}
    for d in load_dumps(folder, num_ranks):
        out.update(d["params"])
    return out


def _plan(tmp_path, name, stages):
    plan = make_plan("gpt-tiny", microbatch=2, num_microbatches=2, seq=16, stages=stages, optimizer="adam")
    return plan, plan.save(tmp_path / f"{name}.json")


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The run that never stops: 2 stages, STEPS steps."""
    tmp = tmp_path_factory.mktemp("straight")
    plan, path = _plan(tmp, "two", [(0, 2), (3, 5)])
    launch(RunOptions(plan=str(path), steps=STEPS, timeout_s=60, dump=str(tmp / "dump")))
    return _params(tmp / "dump", plan.num_ranks)


@pytest.mark.parametrize("layout", [[(0, 2), (3, 5)], [(0, 1), (2, 3), (4, 5)]], ids=["same", "resharded"])
def test_a_resumed_run_ends_where_an_unbroken_one_does(straight, tmp_path, layout):
    ckpt = tmp_path / "ckpt"
    _, first = _plan(tmp_path, "first", [(0, 2), (3, 5)])
    launch(RunOptions(plan=str(first), steps=2, timeout_s=60, checkpoint_dir=str(ckpt), checkpoint_every=1))
    assert checkpoint.complete_steps(ckpt) == [0, 1]            # both kept (KEEP = 2), each with its manifest
    plan, again = _plan(tmp_path, "again", layout)
    result = launch(RunOptions(plan=str(again), steps=STEPS, timeout_s=60, checkpoint_dir=str(ckpt), resume=True,
                               dump=str(tmp_path / "dump")))
    assert result["steps"] == STEPS - 2                          # steps 2 and 3 only
    resumed = _params(tmp_path / "dump", plan.num_ranks)
    assert set(resumed) == set(straight)
    for name, p in resumed.items():
        torch.testing.assert_close(p, straight[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert checkpoint.complete_steps(ckpt) == [1, 3]             # the last step written, step 0 pruned


def test_resume_without_a_complete_checkpoint_is_refused_before_any_rank_starts(tmp_path):
    _, path = _plan(tmp_path, "p", [(0, 2), (3, 5)])
    (tmp_path / "ckpt" / "step-00000003").mkdir(parents=True)   # a step folder without its manifest
    with pytest.raises(InvalidInputError, match="complete checkpoint"):
        launch(RunOptions(plan=str(path), steps=4, checkpoint_dir=str(tmp_path / "ckpt"), resume=True))
    with pytest.raises(InvalidInputError, match="--checkpoint-dir"):
        RunOptions(plan=str(path), resume=True)


def test_a_fresh_run_does_not_write_into_another_runs_checkpoints(tmp_path):
    _, path = _plan(tmp_path, "p", [(0, 2), (3, 5)])
    ckpt = tmp_path / "ckpt"
    launch(RunOptions(plan=str(path), steps=1, timeout_s=60, checkpoint_dir=str(ckpt)))
    with pytest.raises(InvalidInputError, match="checkpoints of an earlier run"):
        launch(RunOptions(plan=str(path), steps=2, checkpoint_dir=str(ckpt)))
    with pytest.raises(InvalidInputError, match="raise --steps above 1"):
        launch(RunOptions(plan=str(path), steps=1, checkpoint_dir=str(ckpt), resume=True))
