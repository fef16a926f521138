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
# A pipe's environment, as in CI, whoever started pytest: xdist's workers are given COLUMNS=80, which would
# narrow the CLI's tables (its own default for piped output is wider); tests that want a width set it.
for _name in ("COLUMNS", "LINES"):
    os.environ.pop(_name, None)


@pytest.fixture
def run_cli():
    """Run ``python -m planner ARGS`` from the repo root; returns the CompletedProcess (text)."""

    def run(*args: str, timeout: float = 300, cwd: Path | None = None) -> subprocess.CompletedProcess:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
        return subprocess.run([sys.executable, "-m", "planner", *args], check=False, cwd=cwd or REPO_ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout)

    return run


@pytest.fixture
def cli_here(capfd, monkeypatch):
    """Run ``stagewise ARGS`` through ``planner.cli.main`` in this process, for input refused before any long work
    and short commands whose process is not what is tested (a ``python -m planner`` process spends seconds
    importing torch); returns a CompletedProcess as ``run_cli`` does: the exit code, and stdout and stderr as
    captured at the file descriptors. ``env``: variables set for the call. An exception ``main`` does not turn
    into an exit code fails the test, as its traceback would."""
    from planner.cli import main

    def run(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        environ = dict(os.environ)  # main sets the piped-output variables, as a process would for its own
        os.environ.update(env or {})
        if cwd is not None:
            monkeypatch.chdir(cwd)
        capfd.readouterr()
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
            if isinstance(exc.code, str):
                print(exc.code, file=sys.stderr)
        finally:
            os.environ.clear()
            os.environ.update(environ)
        out, err = capfd.readouterr()
        return subprocess.CompletedProcess(["stagewise", *args], code, out, err)

    return run
