"""A verified 3-stage run names every dropped microbatch in its report, from the lead verifier's verdicts,
prints one line on them, and exits 3 when more than 1% of its microbatches were dropped."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from models.registry import build_model
from planner.api import make_plan
from tests.conftest import REPO_ROOT

SPEC = ("hf:llama?hidden_size=64,num_hidden_layers=4,num_attention_heads=4,num_key_value_heads=2,"
        "intermediate_size=128,vocab_size=256,max_position_embeddings=64")
STEPS = 13


def test_an_attackers_dropped_microbatches_are_reported_and_exit_3(tmp_path):
    bundle = build_model(SPEC, batch=4, seq=32)
    plan = make_plan(bundle.module, bundle.example_inputs, "default", spec=SPEC, name=bundle.name, stages=3,
                     global_batch=12, microbatch_size=4, time_limit_s=2)
    assert plan.num_microbatches == 3 and plan.verifiers
    report = tmp_path / "report.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    # the untrusted middle stage sends random activations for about half its microbatches of the last 3 steps:
    # some are dropped, too few steps to ban it, no step loses all its microbatches
    proc = subprocess.run([sys.executable, "-m", "planner", "run", str(plan.save(tmp_path / "plan.json")),
                           "--steps", str(STEPS), "--timeout", "120", "--report", str(report),
                           "--attack", "rank=1,kind=random,start=10,p=0.5"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    result = json.loads(report.read_text())
    drops = result["drops"]
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert result["banned"] == [] and not result["untrained_steps"]
    assert drops and result["drops_total"] == len(drops) and result["microbatches"] == 3 * STEPS
    for d in drops:
        assert d["sender"] == 1 and d["step"] >= 10 and d["reason"].startswith("flagged: ")
        assert (d["boundary"], d["direction"]) == (1, "act") and 0 <= d["microbatch"] < 3
    assert f"dropped {len(drops)} of {3 * STEPS} microbatches" in proc.stdout
    assert "more than 1% of the microbatches were dropped" in proc.stdout and "Traceback" not in proc.stderr
