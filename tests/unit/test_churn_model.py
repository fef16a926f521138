"""The churn benchmark's throughput model (``benchmarks/churn.py``), on cases worked by hand."""
from __future__ import annotations

import dataclasses

import pytest

from benchmarks.churn import ChurnCase, churn_row, restart_s, stagewise_s, steady_s

CASE = ChurnCase(steps=100, every=30, checkpoint_every=10, step_s=2.0, replanned_step_s=2.5, detect_s=5.0,
                 replan_s=3.0, reload_s=12.0, wait_s=60.0, samples_per_step=4)


def test_a_case_worked_by_hand():
    # Failures after steps 30, 60 and 90 (not after the last): 3, each redoing half of 10 steps.
    assert CASE.failures == 3 and CASE.redone_steps == 5
    # Stagewise: 30 steps at 2.0 s, 70 at 2.5 s, and per failure 5 + 3 + 12 s plus 5 steps at 2.5 s.
    assert stagewise_s(CASE, rejoin=False) == pytest.approx(60 + 175 + 3 * (20 + 12.5))  # 332.5
    # Planning the replacement back in would not pay: 32.5 s of recovery leave 27.5 s of the 60 s wait, 11
    # steps at 2.5 s, so 20 (the next checkpoint), then 3 + 12 s for 10 steps 0.5 s faster: 117.5 > 107.5 s.
    assert stagewise_s(CASE) == pytest.approx(332.5)
    # Checkpoint-restart: 100 steps at 2.0 s, and per failure 5 + 60 + 12 s plus 5 steps at 2.0 s.
    assert restart_s(CASE) == pytest.approx(200 + 3 * (77 + 10))  # 461
    assert steady_s(CASE) == pytest.approx(200)
    row = churn_row(CASE)
    assert row["stagewise_vs_restart"] == pytest.approx(461 / 332.5)
    assert row["stagewise_vs_no_failure"] == pytest.approx(200 / 332.5)
    assert row["stagewise_samples_per_s"] == pytest.approx(400 / 332.5)
    assert row["restart_samples_per_s"] == pytest.approx(400 / 461)
    assert row["no_failure_samples_per_s"] == pytest.approx(2.0)


def test_no_failure_within_the_run_costs_nothing():
    calm = ChurnCase(steps=10, every=10, checkpoint_every=5, step_s=1.0, replanned_step_s=9.0, detect_s=1.0,
                     replan_s=1.0, reload_s=1.0)
    assert calm.failures == 0
    assert stagewise_s(calm) == restart_s(calm) == steady_s(calm) == pytest.approx(10.0)


def test_the_replacement_is_planned_back_in_when_it_pays():
    slow = dataclasses.replace(CASE, replanned_step_s=4.0)
    # Per failure: 5 + 3 + 12 + 5 x 4 = 40 s; the wait's last 20 s are 5 steps, so 10 (a checkpoint) at 4 s,
    # then 3 + 12 s to plan the replacement in and 20 steps at 2 s: 135 s against 40 + 30 x 4 = 160 s staying.
    # The last failure is followed by 10 steps only, all before that checkpoint: 40 + 10 x 4 = 80 s.
    assert stagewise_s(slow) == pytest.approx(60 + 2 * 135 + 80)
    assert stagewise_s(slow, rejoin=False) == pytest.approx(60 + 2 * 160 + 80)
    assert churn_row(slow)["stagewise_no_rejoin_samples_per_s"] == pytest.approx(400 / 460)
