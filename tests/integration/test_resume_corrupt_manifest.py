"""`stagewise run --resume` from a folder whose only checkpoint has a corrupt MANIFEST: one line, exit 2."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT
from tests.dist.plans import make_plan

MANIFESTS = {"not-json": b'{"step": 1, "files": {', "binary": b"garbage\x00\xff", "a-list": b"[]"}


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    return subprocess.run([sys.executable, "-m", "planner", *args], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=300, check=False)


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
    """A 2-stage mlp-tiny plan and the MANIFEST of the one checkpoint its 1-step run wrote."""
    folder = tmp_path_factory.mktemp("resume")
    plan_path = make_plan("mlp-tiny", microbatch=2, num_microbatches=2, stages=[(0, 2), (3, 5)]).save(
        folder / "plan.json")
    proc = _cli("run", str(plan_path), "--steps", "1", "--checkpoint-dir", str(folder / "ckpt"))
    assert proc.returncode == 0, proc.stderr
    manifests = sorted((folder / "ckpt").glob("*/MANIFEST.json"))
    assert len(manifests) == 1, manifests
    return plan_path, manifests[0]


@pytest.mark.parametrize("content", list(MANIFESTS.values()), ids=list(MANIFESTS))
def test_a_corrupt_manifest_is_one_line_and_exit_2(cli_here, checkpointed, content):
    plan_path, manifest = checkpointed
    manifest.write_bytes(content)
    proc = cli_here("run", str(plan_path), "--steps", "2", "--resume", "--checkpoint-dir", str(manifest.parent.parent))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(lines) == 1, proc.stderr
    assert "manifest" in lines[0].lower()
