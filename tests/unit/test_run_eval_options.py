"""Validation, accumulation and logging options (planner.runtime.options), the step's loss columns of the
metrics file (planner.runtime.rank.metrics), the passes' batches (planner.runtime.data) and the
TensorBoard writer's missing-package error (planner.runtime.outputs.tensorboard)."""
from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from planner.errors import InvalidInputError
from planner.runtime.data import PassBatches, PlanBatches
from planner.runtime.options import RunOptions, check_accumulate
from planner.runtime.outputs import tensorboard
from planner.runtime.rank.metrics import MetricsWriter, StepMetrics, read_metrics, summarize_step


@pytest.mark.parametrize(("kw", "says"), [
    ({"eval_data": "synthetic", "eval_every": 0}, "--eval-every"),
    ({"eval_every": 3}, "--eval-data SPEC as well"),
    ({"accumulate": 0}, "--accumulate"),
])
def test_bad_eval_and_accumulate_options_are_refused(kw, says):
    with pytest.raises(InvalidInputError, match=says):
        RunOptions(plan="p.json", **kw)


def test_validation_runs_every_n_steps_and_after_the_last():
    opts = RunOptions(plan="p.json", steps=7, eval_data="synthetic", eval_every=3)
    assert [s for s in range(7) if opts.evaluates_after(s)] == [2, 5, 6]
    assert [s for s in range(7) if RunOptions(plan="p.json", steps=7, eval_data="x").evaluates_after(s)] == [6]
    assert not any(RunOptions(plan="p.json", steps=7).evaluates_after(s) for s in range(7))


def test_the_new_options_survive_the_worker_command_line():
    from planner.runtime.run_args import parse_worker_args

    opts = RunOptions(plan="p.json", eval_data="tokens:v.npy", eval_every=4, tensorboard="tb", accumulate=3)
    assert parse_worker_args(opts.worker_argv()) == opts


def test_accumulation_is_refused_with_verification_only():
    check_accumulate(RunOptions(plan="p.json", accumulate=2), verifying=False)
    check_accumulate(RunOptions(plan="p.json"), verifying=True)
    with pytest.raises(InvalidInputError, match="--no-verify"):
        check_accumulate(RunOptions(plan="p.json", accumulate=2), verifying=True)


def _row(step: int, rank: int, **kw) -> StepMetrics:
    return StepMetrics(step=step, rank=rank, step_ms=1.0, **kw)


def test_metrics_rows_carry_the_steps_mean_loss_and_its_validation_loss(tmp_path):
    rows = [_row(0, 0, lr=0.5), _row(0, 1, loss_sum=3.0, loss_count=2, eval_loss_sum=1.0, eval_loss_count=4),
            _row(0, 2, loss_sum=1.0, loss_count=2, eval_loss_sum=1.0, eval_loss_count=4),
            _row(1, 0), _row(1, 1, loss_sum=2.0, loss_count=2)]
    s = summarize_step(rows[:3])
    assert (s.loss, s.eval_loss, s.lr) == (1.0, 0.25, 0.5)
    assert summarize_step(rows[3:]).eval_loss is None
    w = MetricsWriter(tmp_path / "m.jsonl")
    w.write(rows)  # two steps in one write: each row gets its own step's figures
    w.close()
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in lines] == [1.0, 1.0, 1.0, 1.0, 1.0]
    assert [r.get("eval_loss") for r in lines] == [0.25, 0.25, 0.25, None, None]
    assert read_metrics(tmp_path / "m.jsonl") == rows  # the step's columns are not read back as fields


def test_a_step_with_every_microbatch_dropped_has_a_null_loss(tmp_path):
    w = MetricsWriter(tmp_path / "m.jsonl")
    w.write([_row(0, 0)])
    w.close()
    assert json.loads((tmp_path / "m.jsonl").read_text())["loss"] is None
    assert math.isnan(summarize_step(read_metrics(tmp_path / "m.jsonl")).loss)


class _Counting:
    def batch(self, step: int, size: int):
        return (torch.full((size, 1), step),), torch.arange(size)


def test_each_accumulated_pass_reads_its_own_batch():
    passes = PassBatches(PlanBatches(_Counting(), global_batch=4, microbatch_size=2), accumulate=3)
    seen = []
    for k in range(3):
        passes.pass_index = k
        seen.append(int(passes.microbatch(5, 1)[0][0][0, 0]))
    assert seen == [15, 16, 17]


def test_tensorboard_missing_is_one_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    with pytest.raises(InvalidInputError, match="pip install tensorboard"):
        tensorboard.Board("tb")
    assert tensorboard.Board(None).writer is None  # ranks other than 0 never import it
