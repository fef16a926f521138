"""Every benchmark's ``--quick`` mode runs (exit 0) and writes nothing into ``benchmarks/results/``.

A benchmark that cannot run any more (a changed API, a flag its runs now need) fails here, not months later
when someone reruns it. Each benchmark is listed once: in ``QUICK`` with the arguments of its smoke run, or
in ``NO_QUICK_YET`` with why; a new benchmark file in neither fails the inventory test.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

BENCHMARKS = REPO_ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"

# file -> arguments of its smoke run (seconds on 2 shared cores)
QUICK: dict[str, tuple[str, ...]] = {
    "runtime.py": ("--quick",),  # section 1 on a light profile: executor vs Schedule1F1B, 3 steps
}
# file -> why it has no smoke run yet (each still to be given a --quick that writes nothing)
NO_QUICK_YET: dict[str, str] = {
    name: "no --quick mode that runs in seconds and writes nothing yet"
    for name in ("churn.py", "cost_model.py", "dtfm_cases.py", "dtfm_cost.py", "join.py", "link_tests.py",
                 "mixed_7b.py", "peers.py", "plan_compile.py", "plan_time.py", "solver.py",
                 "throttled_windows.py", "trace.py", "verification.py", "verification_clean.py",
                 "verification_dist.py", "verification_sweep.py", "warm_replan.py")
}


def _results_state() -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(RESULTS.iterdir()) if p.is_file()}


def test_every_benchmark_is_listed_once():
    files = {p.name for p in BENCHMARKS.glob("*.py")}
    assert files == set(QUICK) | set(NO_QUICK_YET)
    assert not set(QUICK) & set(NO_QUICK_YET)


@pytest.mark.parametrize("name", sorted(QUICK))
def test_quick_mode_runs_and_writes_no_results(name):
    before = _results_state()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT), COLUMNS="120")
    proc = subprocess.run([sys.executable, str(BENCHMARKS / name), *QUICK[name]], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert _results_state() == before
