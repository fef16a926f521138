"""A plan file is data: `stagewise run` never imports the factory a plan names unless the user names it too,
and its ranks get no implicit current folder on their path."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

from tests.dist.plans import make_plan

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "120"}
EVIL = '''import pathlib
pathlib.Path("{marker}").write_text("imported")


def factory():
    raise RuntimeError("not a model")
'''


def _plan_beside_a_module(tmp_path):
    """A hand-edited plan whose spec names ``evilmod:factory``, a module next to it that leaves a marker."""
    marker = tmp_path / "MARKER"
    (tmp_path / "evilmod.py").write_text(EVIL.format(marker=marker))
    plan = make_plan("mlp-tiny", microbatch=2, num_microbatches=2, stages=[(0, 2), (3, 5)])
    plan = dataclasses.replace(plan, model=dataclasses.replace(plan.model, spec="evilmod:factory"))
    return plan.save(tmp_path / "plan.json"), marker


def _run(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "planner", "run", "plan.json", "--steps", "1", *args],
                          capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=300)


def test_a_plan_naming_a_module_beside_it_never_imports_it(tmp_path):
    _, marker = _plan_beside_a_module(tmp_path)
    proc = _run(tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = proc.stderr.strip()
    assert line.startswith("stagewise run: error: the plan's model is the factory 'evilmod:factory'")
    assert "--model evilmod:factory" in line and "Traceback" not in proc.stderr
    assert not marker.exists()
    other = _run(tmp_path, "--model", "othermod:factory")  # naming another factory allows nothing
    assert other.returncode == 2 and "found --model othermod:factory" in other.stderr
    assert not marker.exists()


def test_the_factory_the_user_names_is_imported_and_then_checked(tmp_path):
    _, marker = _plan_beside_a_module(tmp_path)
    proc = _run(tmp_path, "--model", "evilmod:factory")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert marker.exists()  # the user's word: imported, and the factory's failure is one line
