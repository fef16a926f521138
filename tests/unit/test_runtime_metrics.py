"""Per-step metrics: tensor round trip, step summaries, JSON lines (planner.runtime.rank.metrics)."""
from __future__ import annotations

import json
import math

import pytest

from planner.errors import InvalidInputError
from planner.runtime.rank.metrics import (
    MetricsWriter,
    StepMetrics,
    measured_step_ms,
    read_metrics,
    summarize_step,
)


def _row(step, rank, step_ms, **kw):
    return StepMetrics(step=step, rank=rank, step_ms=step_ms, **kw)


def test_tensor_round_trip_keeps_every_field():
    m = _row(7, 2, 12.5, cpu_ms=9.0, compute_ms=3.25, compute_cpu_ms=3.0, pad_ms=0.5, wait_ms=1.5, loss_sum=4.0,
             loss_count=2, dropped=1, flagged=3)
    assert StepMetrics.from_tensor(m.to_tensor()) == m
    assert m.to_tensor().numel() == StepMetrics.numel()


def test_summary_loss_is_the_mean_over_kept_microbatches_of_all_last_stage_replicas():
    rows = [_row(0, 0, 10.0), _row(0, 1, 12.0, loss_sum=6.0, loss_count=2),
            _row(0, 2, 11.0, loss_sum=2.0, loss_count=2, dropped=1)]
    s = summarize_step(rows)
    assert s.loss == pytest.approx(2.0) and s.step_ms == 12.0 and s.dropped == 1 and s.cpu_ms == 0.0
    assert math.isnan(summarize_step([_row(1, 0, 1.0)]).loss)


def test_measured_step_is_the_median_after_warmup():
    steps = [summarize_step([_row(i, 0, ms)]) for i, ms in enumerate([100.0, 10.0, 30.0, 20.0])]
    assert measured_step_ms(steps) == 20.0
    assert measured_step_ms(steps[:1]) == 100.0
    with pytest.raises(InvalidInputError):
        measured_step_ms([])


def test_json_lines_round_trip(tmp_path):
    rows = [_row(0, r, 5.0 + r, loss_sum=float(r), loss_count=r) for r in range(3)]
    w = MetricsWriter(tmp_path / "m.jsonl")
    w.write(rows)
    w.close()
    assert read_metrics(tmp_path / "m.jsonl") == rows
    MetricsWriter(None).write(rows)  # no file: nothing to do


def test_negative_figures_are_refused():
    with pytest.raises(InvalidInputError):
        _row(0, 0, -1.0)


def test_own_cpu_is_the_executor_threads_cpu_outside_passes_waits_verification_and_the_optimizer():
    m = _row(3, 1, 50.0, compute_cpu_ms=30.0, thread_cpu_ms=41.0, wait_cpu_ms=1.0, verify_cpu_ms=2.0,
             optim_cpu_ms=4.5, comm_cpu_ms=2.5)
    assert m.own_cpu_ms == pytest.approx(3.5)  # 2.5 of it posting messages, 1.0 the rest of its bookkeeping
    assert StepMetrics.from_tensor(m.to_tensor()) == m
    assert _row(0, 0, 1.0).own_cpu_ms == 0.0  # rows without the thread clocks (older files) leave nothing


def test_a_diverged_loss_is_written_as_null_and_a_run_without_steps_keeps_the_old_file(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("earlier run\n")
    w = MetricsWriter(path)
    w.close()                                                   # failed before its first step
    assert path.read_text() == "earlier run\n"
    w = MetricsWriter(path)
    w.write([_row(0, 0, 1.0, loss_sum=float("nan"), loss_count=1)])
    w.close()
    assert json.loads(path.read_text())["loss_sum"] is None
    assert math.isnan(read_metrics(path)[0].loss_sum)           # and read back as NaN


def test_a_rerun_never_truncates_the_file_a_resumed_run_appends_and_a_fresh_one_moves_the_old_aside(tmp_path):
    path = tmp_path / "m.jsonl"
    first = [_row(0, 0, 1.0), _row(1, 0, 1.0)]
    w = MetricsWriter(path)
    w.write(first)
    w.close()
    w = MetricsWriter(path, append=True)                         # --resume: the rows of the steps after
    w.write([_row(2, 0, 1.0)])
    w.close()
    assert [r.step for r in read_metrics(path)] == [0, 1, 2]
    w = MetricsWriter(path)                                      # a fresh run over it
    w.write([_row(0, 0, 2.0)])
    w.close()
    assert w.moved_to == tmp_path / "m.jsonl.1"
    assert [r.step for r in read_metrics(tmp_path / "m.jsonl.1")] == [0, 1, 2]
    assert [r.step_ms for r in read_metrics(path)] == [2.0]
