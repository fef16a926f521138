"""Fine-tuning an hf:DIR model: a tiny GPT-2 trained 3 steps and saved (--save-weights), then planned as
hf:DIR on 2 stages. Its first loss is the saved model's loss on that batch (transformers' from_pretrained,
computed here), not the random-init loss, which --init random gives; a resumed run takes its checkpoint
(the folder is not even read); --save-weights of the fine-tuned run loads again; weights that do not fit
the config are one line, exit 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")

from models.registry import build_model
from planner.api import make_plan
from planner.runtime.data import make_source, resolve_loss
from tests.conftest import REPO_ROOT

# No dropout, so a training step's loss is the model's plain loss on the batch.
SPEC = ("hf:gpt2?n_layer=2,n_embd=32,n_head=2,vocab_size=256,n_positions=32,"
        "resid_pdrop=0,embd_pdrop=0,attn_pdrop=0")
BATCH, MICRO, SEQ = 8, 4, 16


def _plan(spec: str, path) -> str:
    bundle = build_model(spec, batch=MICRO, seq=SEQ)
    plan = make_plan(bundle.module, bundle.example_inputs, "default", spec=spec, name=bundle.name, stages=2,
                     global_batch=BATCH, microbatch_size=MICRO, time_limit_s=2, dtype="fp32")
    assert plan.num_stages == 2 and plan.config.dtype == "float32"
    return str(plan.save(path))


def _start(plan: str, *args: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    return subprocess.Popen([sys.executable, "-m", "planner", "run", plan, "--timeout", "90", *args],
                            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _losses(proc: subprocess.Popen, report) -> list[float]:
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, out + err
    return json.loads(report.read_text())["losses"]


def _reference_loss(folder) -> float:
    """The saved model's loss on the run's first global batch, by the library alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)
    bundle = build_model(f"hf:{folder}", batch=MICRO, seq=SEQ)
    inputs, targets = make_source(bundle, kind="auto", seq=SEQ, seed=0).batch(0, BATCH)
    with torch.no_grad():
        return float(resolve_loss(bundle)(model(input_ids=inputs[0]).logits, targets))


def test_fine_tuning_starts_from_the_saved_weights(cli_here, tmp_path):
    saved, tuned, ckpt = tmp_path / "saved", tmp_path / "tuned", tmp_path / "ckpt"
    first = _losses(_start(_plan(SPEC, tmp_path / "p1.json"), "--steps", "3", "--lr", "1e-2",
                           "--save-weights", str(saved), "--report", str(tmp_path / "r1.json")), tmp_path / "r1.json")
    plan = _plan(f"hf:{saved}", tmp_path / "p2.json")
    pretrained = _start(plan, "--steps", "2", "--report", str(tmp_path / "pre.json"), "--checkpoint-dir", str(ckpt),
                        "--checkpoint-every", "1", "--save-weights", str(tuned))
    random = _start(plan, "--steps", "1", "--init", "random", "--report", str(tmp_path / "rand.json"))
    from_saved = _losses(pretrained, tmp_path / "pre.json")
    from_random = _losses(random, tmp_path / "rand.json")
    expected = _reference_loss(saved)
    assert from_saved[0] == pytest.approx(expected, abs=1e-4), (from_saved, expected)
    # --init random: the config's seeded weights, the very ones the first run started from
    assert from_random[0] == pytest.approx(first[0], abs=1e-5) and abs(from_random[0] - expected) > 0.5
    assert _reference_loss(tuned) < from_saved[0]  # the fine-tuned weights saved again, and trained further

    # weights that do not fit the config: refused before any rank starts, one line, exit 2
    state = load_file(str(saved / "model.safetensors"))
    state["transformer.h.1.mlp.c_fc.weight"] = torch.zeros(32, 64)
    save_file(state, str(saved / "model.safetensors"), metadata={"format": "pt"})
    bad = cli_here("run", plan, "--timeout", "90", "--steps", "1")  # main, in this process
    out, err = bad.stdout, bad.stderr
    lines = [line for line in err.splitlines() if line.strip()]
    assert bad.returncode == 2 and len(lines) == 1 and "Traceback" not in err, out + err
    assert "'transformer.h.1.mlp.c_fc.weight' of shape (32, 128)" in lines[0] and "(32, 64)" in lines[0], lines[0]

    # a resumed run loads its checkpoint: the folder (now unusable) is not read, and it trains on from step 2
    resumed = _losses(_start(plan, "--steps", "3", "--resume", "--checkpoint-dir", str(ckpt),
                             "--report", str(tmp_path / "res.json")), tmp_path / "res.json")
    assert len(resumed) >= 1 and resumed[-1] < from_saved[0]
