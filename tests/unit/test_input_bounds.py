"""Bounds on what a command accepts: microbatch counts the runtime can number, output folders that can be written."""
from __future__ import annotations

import pytest

from planner.errors import InvalidInputError
from planner.outputs import check_writable
from planner.runtime.wire import comm
from planner.solver.api import MAX_MICROBATCHES, microbatch_candidates


def test_the_solver_and_the_runtime_agree_on_the_microbatch_limit():
    assert MAX_MICROBATCHES == comm.MAX_MICROBATCHES


@pytest.mark.parametrize(("batch", "expected"), [(1, (1,)), (7, (1, 7)), (16, (1, 2, 4, 8, 16)),
                                                 (1000, (1, 5, 20, 50, 200, 1000))])
def test_small_batches_try_their_divisors_spread_from_1(batch, expected):
    assert microbatch_candidates(batch) == expected


@pytest.mark.parametrize("batch", [2**20, 10**12, 2**61 - 1])
def test_huge_batches_try_only_sizes_the_runtime_can_run(batch):
    sizes = microbatch_candidates(batch)
    assert sizes[-1] == batch
    assert all(batch % s == 0 and batch // s <= MAX_MICROBATCHES for s in sizes)


def test_an_output_under_proc_is_refused_before_any_work():
    with pytest.raises(InvalidInputError, match="cannot be written"):
        check_writable("/proc/x/plan.json", what="plan output")


def test_an_output_in_a_missing_folder_of_a_writable_one_passes_and_leaves_nothing(tmp_path):
    check_writable(tmp_path / "a" / "b" / "plan.json", what="plan output")
    assert list(tmp_path.iterdir()) == []
