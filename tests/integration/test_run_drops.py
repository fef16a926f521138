"""A verified 3-stage run names every dropped microbatch in its report, from the lead verifier's verdicts,
prints one line on them, and exits 3 when more than 1% of its microbatches were dropped; a clean run of the
HF Llama case drops at most 0.1% of them."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from models.registry import build_model
from planner.api import make_plan
from planner.runtime.wire.control import trusted_ranks
from tests.conftest import REPO_ROOT

SPEC = ("hf:llama?hidden_size=64,num_hidden_layers=4,num_attention_heads=4,num_key_value_heads=2,"
        "intermediate_size=128,vocab_size=256,max_position_embeddings=64")
STEPS = 13
CLEAN_STEPS = 40


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory):
    bundle = build_model(SPEC, batch=4, seq=32)
    plan = make_plan(bundle.module, bundle.example_inputs, "default", spec=SPEC, name=bundle.name, stages=3,
                     global_batch=12, microbatch_size=4, time_limit_s=2)
    assert plan.num_microbatches == 3 and plan.verifiers
    assert plan.stage_ranks(1)[0] not in trusted_ranks(plan)   # an untrusted middle stage, verified
    return plan.save(tmp_path_factory.mktemp("drops") / "plan.json")


def _run(plan_path, report, steps: int, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    return subprocess.run([sys.executable, "-m", "planner", "run", str(plan_path), "--steps", str(steps),
                           "--timeout", "120", "--report", str(report), *extra],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)


def test_an_attackers_dropped_microbatches_are_reported_and_exit_3(plan_path, tmp_path):
    report = tmp_path / "report.json"
    # the untrusted middle stage sends random activations for about half its microbatches of the last 3 steps:
    # some are dropped, too few steps to ban it, no step loses all its microbatches
    proc = _run(plan_path, report, STEPS, "--attack", "rank=1,kind=random,start=10,p=0.5")
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


@pytest.mark.slow
def test_a_clean_hf_llama_run_keeps_its_data(plan_path, tmp_path):
    # An honest gradient whose first token's row (the attention sink) held 1144x the median row's energy once
    # failed the size, spectral and label tests at boundary 0 together and was dropped (1 of 120); the
    # summaries cap a row's energy (``summaries.ROW_ENERGY_CAP``)
    report = tmp_path / "report.json"
    proc = _run(plan_path, report, CLEAN_STEPS)
    result = json.loads(report.read_text())
    assert proc.returncode in (0, 3) and result["banned"] == [], proc.stdout + proc.stderr
    assert result["microbatches"] == 3 * CLEAN_STEPS
    assert result["drops_total"] <= 0.001 * result["microbatches"], result["drops"]
