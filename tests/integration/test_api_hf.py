"""The Python API on a stock transformers ``LlamaForCausalLM`` with real weights: make_plan adapts it,
load_plan accepts it built on the CPU or on meta (and a CLI plan of the same model), apply_plan builds
rank 0's stage, and ``planner.train`` runs 3 steps whose losses equal a plain single-process HF loop
(Adam, the same synthetic batches) to 1e-5."""
from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import planner  # noqa: E402
from models import hf  # noqa: E402
from models.registry import build_model  # noqa: E402
from planner.runtime.data import make_source  # noqa: E402
from tests.conftest import REPO_ROOT  # noqa: E402

BATCH, MICRO, SEQ, HIDDEN, VOCAB, STEPS, LR = 4, 2, 16, 32, 64, 3, 1e-3


def _config():
    return transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=2, vocab_size=VOCAB,
                                    max_position_embeddings=64)


def _model(device: str = "cpu"):
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(_config())


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    model = _model()
    inputs = torch.randint(0, VOCAB, (MICRO, SEQ), generator=torch.Generator().manual_seed(1))
    plan = planner.make_plan(model, inputs, "default", stages=2, global_batch=BATCH, microbatch_size=MICRO,
                             time_limit_s=2, dtype="fp32")
    path = plan.save(tmp_path_factory.mktemp("api") / "plan.json")
    return model, inputs, plan, path


def test_plan_loads_against_the_model_however_built(planned):
    model, _, plan, path = planned
    assert plan.num_stages == 2 and plan.model.seq == SEQ
    for other in (model, _model(), _model("meta")):  # the planned object, a fresh CPU build, a meta build
        assert planner.load_plan(path, model=other).model.fingerprint == plan.model.fingerprint


def test_cli_plan_of_the_saved_model_loads_against_a_cpu_build(planned, tmp_path):
    model, _, plan, _ = planned
    model.save_pretrained(tmp_path / "m")
    out = tmp_path / "cli.json"
    proc = subprocess.run([sys.executable, "-m", "planner", "plan", f"hf:{tmp_path / 'm'}", "--stages", "2",
                           "--seq", str(SEQ), "--global-batch", str(BATCH), "--microbatches", str(BATCH // MICRO),
                           "--dtype", "fp32", "--time-limit", "5", "-o", str(out)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert planner.load_plan(out, model=_model()).model.fingerprint == plan.model.fingerprint


def test_apply_plan_on_real_weights(planned):
    model, inputs, plan, _ = planned
    stage = planner.apply_plan(model, plan, plan.stage_ranks(0)[0], example_inputs=(inputs,))
    out = stage.module(inputs)
    assert out[0].shape == (MICRO, SEQ, HIDDEN) and out[0].device.type == "cpu"
    assert torch.isfinite(out[0]).all()


def test_train_equals_a_plain_hf_loop(planned, tmp_path):
    model, _, plan, _ = planned
    reference = copy.deepcopy(model)
    result = planner.train(plan, model, steps=STEPS, data="synthetic", lr=LR, seed=0)
    assert len(result.losses) == STEPS
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(_reference_losses(reference, tmp_path)),
                               rtol=0, atol=1e-5)


def _reference_losses(model, folder) -> list[float]:
    """Adam on the runtime's own synthetic batches (the same source, seed and global batch), one process."""
    model.save_pretrained(folder / "ref")  # only to describe the batches: the runtime's data source reads a bundle
    source = make_source(build_model(f"hf:{folder / 'ref'}", batch=MICRO, seq=SEQ), kind="synthetic", seq=SEQ)
    loss_fn = hf.adapt(model).loss
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    model.train()
    losses = []
    for step in range(STEPS):
        (ids,), targets = source.batch(step, BATCH)
        opt.zero_grad()
        loss = loss_fn(model(ids), targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
