"""Hugging Face models end to end: plans for a tiny GPT-2 and Llama (`hf:` specs) on the default
cluster, then a 2-rank `stagewise run` of each on the byte-text data, whose loss falls; and a bad spec
as one line, exit 2, no file."""
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

SPECS = {
    "gpt2": "hf:gpt2?n_layer=2,n_embd=32,n_head=2,vocab_size=256,n_positions=32",
    "llama": "hf:llama?hidden_size=32,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2,"
             "intermediate_size=64,vocab_size=256,max_position_embeddings=32",
}
STEPS = 6


def _run(plan_path, spec: str, report) -> subprocess.Popen:
    # an hf: config is data (no user code): run needs no --model for it
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    return subprocess.Popen([sys.executable, "-m", "planner", "run", str(plan_path), "--steps", str(STEPS),
                             "--lr", "3e-3", "--timeout", "90", "--report", str(report)],
                            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_rank_runs_of_hf_gpt2_and_llama_lower_the_loss(tmp_path):
    runs = {}
    for family, spec in SPECS.items():
        bundle = build_model(spec, batch=4, seq=16)
        plan = make_plan(bundle.module, bundle.example_inputs, "default", spec=spec, name=bundle.name, stages=2,
                         global_batch=8, microbatch_size=4, time_limit_s=2)
        assert plan.num_stages == 2 and plan.num_ranks == 2
        assert plan.config.dtype == "float16"  # the default cluster has T4s: fp16 with loss scaling
        report = tmp_path / f"{family}.json"
        runs[family] = (_run(plan.save(tmp_path / f"{family}-plan.json"), spec, report), report)
    for family, (proc, report) in runs.items():  # both run at once: rank start-up dominates
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, f"{family}: {out}{err}"
        losses = json.loads(report.read_text())["losses"]
        assert len(losses) == STEPS and losses[0] > 5.0, losses  # about ln 256: bytes, untrained
        assert losses[-1] < losses[0] - 0.3, (family, losses)


def test_a_bad_hf_spec_is_one_line_exit_2_and_no_file(cli_here, tmp_path):
    out = tmp_path / "plan.json"
    proc = cli_here("plan", "hf:llama?hidden=", "--cluster", "default", "-o", str(out))
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "override 'hidden='" in lines[0] and not out.exists()
