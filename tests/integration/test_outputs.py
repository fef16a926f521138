"""Output paths are checked before long work; writes are atomic; read-only files are not replaced;
a plan with a non-finite figure is refused."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from planner.errors import InvalidInputError
from planner.outputs import check_writable, write_atomic
from planner.plan_load import load_plan
from tests.unit.plan_fixtures import GOLDEN_PATH

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "120"}


def _stagewise(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "planner", *args], check=False, capture_output=True, text=True, env=ENV,
                          cwd=cwd, timeout=300)


def test_an_output_path_that_is_a_folder_fails_before_the_solve(cli_here, tmp_path):
    proc = cli_here("plan", "gpt-tiny", "-o", str(tmp_path), "--time-limit", "60")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "is a folder" in proc.stderr
    assert "solving" not in proc.stdout


def test_an_output_under_a_file_fails_before_profiling(cli_here, tmp_path):
    (tmp_path / "f").write_text("x")
    proc = cli_here("profile", "--quick", "-o", str(tmp_path / "f" / "profile.json"))
    assert proc.returncode == 2 and "cannot be written" in proc.stderr and proc.stderr.count("\n") == 1


def test_run_checks_report_and_metrics_paths_before_any_rank_starts(cli_here, tmp_path):
    proc = cli_here("run", str(GOLDEN_PATH), "--report", str(tmp_path))
    assert proc.returncode == 2 and "--report" in proc.stderr and "is a folder" in proc.stderr


def test_a_read_only_output_is_not_replaced(tmp_path):
    target = tmp_path / "plan.json"
    target.write_text("keep me")
    target.chmod(0o444)
    with pytest.raises(InvalidInputError, match="read-only"):
        check_writable(target, what="-o")
    with pytest.raises(InvalidInputError, match="read-only"):
        write_atomic(target, "replaced")
    assert target.read_text() == "keep me"


def test_atomic_writes_leave_no_temporary_file(tmp_path):
    write_atomic(tmp_path / "sub" / "a.json", "{}\n")
    assert (tmp_path / "sub" / "a.json").read_text() == "{}\n"
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["a.json"]


def test_a_plan_with_a_non_finite_figure_is_refused(tmp_path):
    data = json.loads(GOLDEN_PATH.read_text())
    text = json.dumps(data).replace('"step_ms": ', '"step_ms": NaN, "_": ', 1)
    path = tmp_path / "nan.json"
    path.write_text(text)
    with pytest.raises(InvalidInputError, match="non-finite number NaN"):
        load_plan(path)


@pytest.mark.parametrize("args", [("plan", "gpt-tiny", "--dtype", "fp8"), ("plan", "gpt-tiny", "--recompute", "maybe"),
                                  ("run",), ()])
def test_a_usage_error_is_one_line(cli_here, args):
    """argparse would print the whole usage first: a usage error is one line and exit 2 like any other."""
    proc = cli_here(*args)  # main, in this process
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and ": error: " in lines[0] and "--help" in lines[0], proc.stderr
