"""`stagewise show` and `stagewise simulate` end to end, on the golden plan and on broken copies of it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from planner.plan_json import SCHEMA_VERSION

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "golden_plan.json"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MPLBACKEND": "Agg", "COLUMNS": "120"}


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "planner", *args], check=False, capture_output=True, text=True, env=ENV,
                          cwd=cwd, timeout=120)


def test_simulate_prints_the_step(cli_here, tmp_path):
    proc = cli_here("simulate", str(GOLDEN), env=ENV)  # main, in this process
    assert proc.returncode == 0, proc.stderr
    predicted = json.loads(GOLDEN.read_text())["predicted"]["step_ms"]
    assert f"step {predicted:.3f} ms" in proc.stdout
    assert "verifier" in proc.stdout and "bubble" in proc.stdout


def test_show_writes_png_and_svg(cli_here, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(GOLDEN.read_text())
    out = tmp_path / "pictures"
    proc = cli_here("show", str(plan), "--out", str(out), env=ENV)
    assert proc.returncode == 0, proc.stderr
    assert "stages" in proc.stdout and "ranks" in proc.stdout
    png, svg = out / "plan-gantt.png", out / "plan-gantt.svg"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "<svg" in svg.read_text()[:2000]
    assert sorted(p.name for p in out.iterdir()) == ["plan-gantt.png", "plan-gantt.svg"]  # no temp files


def _broken(tmp_path: Path, how: str) -> Path:
    text = GOLDEN.read_text()
    data = json.loads(text)
    if how == "truncated":
        path = tmp_path / "plan.json"
        path.write_text(text[: len(text) * 2 // 3])
        return path
    if how == "version":
        data["schema_version"] = 99
    elif how == "no-program":
        data["programs"][1] = []
    elif how == "unmatched-send":
        data["programs"][1].remove("1RECV_F0<0")
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("how,message", [
    ("truncated", "is not valid JSON"),
    ("version", f"schema_version; expected {SCHEMA_VERSION}; found 99"),
    ("no-program", "rank 1 has no program"),
    ("unmatched-send", "invalid plan program: rank 0 instruction"),
    ("missing", "does not exist"),
])
def test_bad_plans_fail_with_one_line(cli_here, tmp_path, how, message):
    path = tmp_path / "absent.json" if how == "missing" else _broken(tmp_path, how)
    proc = cli_here("simulate", str(path))  # main, in this process
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stagewise simulate: error: ")
    assert message in lines[0]
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_show_rejects_a_bad_plan_before_drawing(cli_here, tmp_path):
    out = tmp_path / "out"
    proc = cli_here("show", str(_broken(tmp_path, "unmatched-send")), "--out", str(out))
    assert proc.returncode == 2 and "invalid plan program" in proc.stderr
    assert not out.exists()
