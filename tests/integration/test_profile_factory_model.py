"""The profile's executor probe runs a factory model's plan: the operator named the factory (`--model`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO_ROOT


def test_the_executor_probe_runs_a_factory_model():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run([sys.executable, "-m", "planner.profiling.overhead_probe", "--model",
                           "tests.fixtures.model_factories:mlp_only", "--steps", "2", "--warmup", "1"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["model"] == "tests.fixtures.model_factories:mlp_only"
    assert report["messages"] > 0 and report["comm_cpu_per_message_ms"] >= 0
