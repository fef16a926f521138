"""``stagewise export-onnx --plan`` on ``hf:`` plans: GPT-2 (whose position lookup the ONNX export folds into
weights-only nodes, so its ``transformer.wpe`` block holds no node there) and Llama, each stage file chained
gives the model's logits."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from onnx.reference import ReferenceEvaluator

pytest.importorskip("transformers")

from models.registry import build_model

SPECS = {
    "gpt2": "hf:gpt2?n_layer=2,n_embd=32,n_head=2,n_positions=16,vocab_size=64",
    "llama": "hf:llama?hidden_size=32,intermediate_size=64,num_hidden_layers=2,num_attention_heads=2,"
             "num_key_value_heads=2,vocab_size=64,max_position_embeddings=16",
}


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_export_onnx_plan_of_an_hf_model_chains_to_its_logits(run_cli, tmp_path, kind):
    spec = SPECS[kind]
    plan = tmp_path / "plan.json"
    proc = run_cli("plan", spec, "--stages", "2", "--dtype", "fp32", "--global-batch", "2", "--microbatches", "2",
                   "--time-limit", "5", "-o", str(plan))
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "stages"
    proc = run_cli("export-onnx", "--plan", str(plan), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((out / "stages.json").read_text())
    assert len(manifest["stages"]) == 2
    seq = json.loads(plan.read_text())["model"]["seq"]
    model = build_model(spec, batch=1, seq=seq, device="cpu", seed=0)  # the export's weights: seed 0
    ids = model.example_inputs[0]
    model.module.eval()  # GPT-2's dropout: the export is of the eval graph
    with torch.no_grad():
        whole = model.module(ids).numpy()
    values = {manifest["inputs"][0]["name"]: ids.numpy()}
    for stage in manifest["stages"]:
        outs = ReferenceEvaluator(str(out / stage["file"])).run(
            None, {t["name"]: values[t["name"]] for t in stage["inputs"]})
        values.update(zip((t["name"] for t in stage["outputs"]), outs))
    np.testing.assert_allclose(values[manifest["outputs"][0]["name"]], whole, rtol=1e-4, atol=1e-4)
