"""Shared test setup: one thread per process (2 cores shared by the whole suite) and a CLI runner."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]

torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by CLI subprocesses


@pytest.fixture
def run_cli():
    """Run ``python -m planner ARGS`` from the repo root; returns the CompletedProcess (text)."""

    def run(*args: str, timeout: float = 300, cwd: Path | None = None) -> subprocess.CompletedProcess:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
        return subprocess.run([sys.executable, "-m", "planner", *args], cwd=cwd or REPO_ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout)

    return run
