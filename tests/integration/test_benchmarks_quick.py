"""Every benchmark's ``--quick`` mode runs (exit 0) and writes nothing into ``benchmarks/results/``.

A benchmark that cannot run any more (a changed API, a flag its runs now need, a plan the loader now refuses)
fails here, not months later when someone reruns it. Each ``--quick`` runs the benchmark's own code path on
its smallest case (seconds on 2 shared cores; those that start ``stagewise run`` take longest) and prints its
tables; the results and the cluster files it reads stay as they were. Every ``benchmarks/*.py`` is listed in
``QUICK``: a new benchmark without an entry fails the inventory test.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

BENCHMARKS = REPO_ROOT / "benchmarks"
WATCHED = (BENCHMARKS / "results", BENCHMARKS / "clusters")  # what a benchmark reads or writes outside /tmp

# file -> arguments of its smoke run
QUICK: dict[str, tuple[str, ...]] = {
    name: ("--quick",)
    for name in ("audit_overhead.py", "bound_gaps.py", "calibrate_units.py", "churn.py", "codec_timing.py", "compression.py", "convergence.py", "cost_model.py", "dtfm_cases.py",
                 "dtfm_cost.py",
                 "join.py", "link_tests.py", "mixed_7b.py", "peers.py", "plan_compile.py", "plan_time.py", "pools.py",
                 "rehearsal_fidelity.py", "runtime.py", "solver.py", "throttled_windows.py", "trace.py",
                 "verification.py", "verification_clean.py", "verification_codecs.py", "verification_dist.py",
                 "verification_sweep.py",
                 "verification_twins.py", "warm_replan.py")
}
# a stored profile of this machine kind: the profile command's own runs are tested elsewhere (~25 s saved)
QUICK["rehearsal_fidelity.py"] += ("--profile", "tests/fixtures/profile_cpu.json")


def _state() -> dict[str, tuple[str, int]]:
    """Every watched file: its content's hash and its modification time."""
    return {str(p.relative_to(BENCHMARKS)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for folder in WATCHED for p in sorted(folder.rglob("*")) if p.is_file()}


def test_every_benchmark_is_listed():
    # ``_name.py`` files are a benchmark's parts, imported by it, not scripts
    assert {p.name for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_")} == set(QUICK)


@pytest.mark.parametrize("name", sorted(QUICK))
def test_quick_mode_runs_and_writes_no_results(name):
    before = _state()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT), COLUMNS="120")
    proc = subprocess.run([sys.executable, str(BENCHMARKS / name), *QUICK[name]], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    after = _state()
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"{name} --quick changed {changed}"
