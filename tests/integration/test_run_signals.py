"""SIGTERM to `stagewise run` stops every rank and leaves a report saying so (no orphaned ranks)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil

from tests.dist.plans import make_plan

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "120"}


def _ranks(launcher: psutil.Process) -> list[psutil.Process]:
    return [p for p in launcher.children(recursive=True) if "planner.runtime.launcher.worker" in " ".join(p.cmdline())]


def test_sigterm_stops_every_rank_and_writes_the_report(tmp_path):
    plan = make_plan("mlp-tiny", microbatch=2, num_microbatches=2, stages=[(0, 2), (3, 5)])
    path = plan.save(tmp_path / "plan.json")
    report = tmp_path / "report.json"
    proc = subprocess.Popen([sys.executable, "-m", "planner", "run", str(path), "--steps", "100000",
                             "--report", str(report)], env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    launcher = psutil.Process(proc.pid)
    deadline = time.monotonic() + 120
    while len(ranks := _ranks(launcher)) < plan.num_ranks and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(ranks) == plan.num_ranks, "the ranks never started"
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err
    gone, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive, f"orphaned ranks {[p.pid for p in alive]}"
    data = json.loads(report.read_text())
    assert data["failed"] and "interrupted" in data["error"]
