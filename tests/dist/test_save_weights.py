"""`--save-weights`: a pipelined run's trained weights, merged from its ranks into one safetensors state
dict, load strictly into a freshly built unsplit model and equal the single-process reference after the
same steps (gloo, one process per rank, one thread each)."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, load_model
from torch import nn

from models.registry import build_model
from planner.errors import InvalidInputError
from planner.runtime.launcher.weights_out import launch_saving_weights
from planner.runtime.options import RunOptions
from planner.runtime.recovery import checkpoint
from tests.dist.plans import make_plan, reference_run

torch.set_num_threads(1)


def _fresh(plan):
    return build_model(plan.model.spec, batch=plan.config.microbatch_size, seq=plan.model.seq, device="cpu",
                       seed=123).module  # another seed: every weight must come from the file


def _assert_equals_reference(model: nn.Module, params: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(p.detach(), params[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_saved_weights_load_strictly_and_equal_the_reference(tmp_path):
    plan = make_plan("gpt-tiny", microbatch=2, num_microbatches=2, seq=16, stages=[(0, 2), (3, 5)], optimizer="adam")
    path = plan.save(tmp_path / "plan.json")
    out = tmp_path / "weights" / "gpt.safetensors"  # its folder does not exist yet
    result = launch_saving_weights(RunOptions(plan=str(path), steps=3, timeout_s=60), out)
    assert result["steps"] == 3 and result["weights"] == str(out)
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # the ranks' hidden checkpoint is gone
    _, _, params = reference_run(plan, steps=3)
    model = _fresh(plan)
    state = load_file(out)
    assert set(state) == set(model.state_dict())  # the model's own names, nothing else
    model.load_state_dict(state, strict=True)
    _assert_equals_reference(model, params)
    with safe_open(str(out), framework="pt") as f:
        assert f.metadata()["stagewise_step"] == "2" and f.metadata()["stagewise_model"] == "gpt-tiny"


def test_a_tied_weight_is_saved_once_and_an_own_checkpoint_folder_is_kept(tmp_path):
    spec = "tests.dist.plans:tied_gpt"
    plan = make_plan(spec, microbatch=2, num_microbatches=2, seq=16, stages=[(0, 1), (2, 3)], optimizer="adam")
    path = plan.save(tmp_path / "plan.json")
    out, ckpt = tmp_path / "tied.safetensors", tmp_path / "ckpt"
    launch_saving_weights(RunOptions(plan=str(path), steps=2, timeout_s=60, model=spec, checkpoint_dir=str(ckpt),
                                     checkpoint_every=1), out)
    assert checkpoint.complete_steps(ckpt) == [0, 1]  # the user's checkpoints stay
    state = load_file(out)
    assert "embed.tok.weight" in state and "head.proj.weight" not in state  # once, under the kept name
    _, _, params = reference_run(plan, steps=2)
    model = _fresh(plan)
    assert model.head.proj.weight is model.embed.tok.weight
    load_model(model, out, strict=True)
    _assert_equals_reference(model, params)


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
        self.register_buffer("scale", torch.ones(8))  # in the state dict, but no rank checkpoints it

    def forward(self, x):
        return self.layers(x * self.scale)


def scaled():
    return _Scaled(), torch.randn(2, 8)


def test_what_cannot_be_saved_is_refused_before_any_rank_starts(tmp_path):
    plan = make_plan("gpt-tiny", microbatch=2, num_microbatches=2, seq=16, stages=[(0, 2), (3, 5)])
    path = plan.save(tmp_path / "plan.json")
    (tmp_path / "folder").mkdir()
    with pytest.raises(InvalidInputError, match="is a folder"):
        launch_saving_weights(RunOptions(plan=str(path), steps=1), tmp_path / "folder")
    spec = "tests.dist.test_save_weights:scaled"
    buffered = make_plan(spec, microbatch=2, num_microbatches=1, stages=[(0, 2)])
    path = buffered.save(tmp_path / "buffered.json")
    with pytest.raises(InvalidInputError, match=r"buffers \['scale'\]"):
        launch_saving_weights(RunOptions(plan=str(path), steps=1, model=spec), tmp_path / "w.safetensors")
    assert not (tmp_path / "w.safetensors").exists()


def test_an_hf_models_weights_come_out_as_a_save_pretrained_folder(tmp_path):
    transformers = pytest.importorskip("transformers")
    # no dropout: the reference draws other random numbers than the ranks do
    spec = "hf:gpt2?n_layer=2,n_embd=32,n_head=2,vocab_size=256,n_positions=32,resid_pdrop=0,embd_pdrop=0,attn_pdrop=0"
    plan = make_plan(spec, microbatch=2, num_microbatches=2, seq=16, stages=[(0, 2), (3, 5)], optimizer="adam")
    path = plan.save(tmp_path / "plan.json")
    (tmp_path / "not-empty").mkdir()
    (tmp_path / "not-empty" / "x").write_text("x")
    with pytest.raises(InvalidInputError, match="a new or empty folder"):
        launch_saving_weights(RunOptions(plan=str(path), steps=2, timeout_s=60), tmp_path / "not-empty")
    out = tmp_path / "trained"
    launch_saving_weights(RunOptions(plan=str(path), steps=2, timeout_s=60), out)
    assert {"config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    _, _, params = reference_run(plan, steps=2)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)  # the stock class
    _assert_equals_reference(loaded, params)
