"""An hf: model folder's safetensors weights read into a built model (models.hf_weights): one file or shards,
tied weights, a base model's keys; only the named tensors; mismatches and unread formats named."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

pytest.importorskip("transformers")

from models.hf_weights import INDEX_FILE, check_weights, find_weights, load_weights  # noqa: E402
from models.registry import build_model  # noqa: E402
from planner.errors import InvalidInputError  # noqa: E402

GPT2 = "hf:gpt2?n_layer=2,n_embd=32,n_head=2,vocab_size=256,n_positions=32"


def _model(spec: str = GPT2, seed: int = 0, device: str = "cpu") -> torch.nn.Module:
    return build_model(spec, batch=2, seq=16, device=device, seed=seed).module


def _saved(tmp_path, **kwargs):
    folder = tmp_path / "saved"
    model = _model(seed=0)
    model.save_pretrained(folder, **kwargs)
    return model, folder


@pytest.mark.parametrize("shard", [None, "20KB"])
def test_the_saved_weights_load_into_a_fresh_model_whole_or_sharded(tmp_path, shard):
    saved, folder = _saved(tmp_path, **({"max_shard_size": shard} if shard else {}))
    assert (folder / INDEX_FILE).is_file() == (shard is not None)
    fresh = _model(seed=1)
    assert not torch.equal(fresh.transformer.h[0].attn.c_attn.weight, saved.transformer.h[0].attn.c_attn.weight)
    names = [n for n, _ in fresh.named_parameters()]
    weights = find_weights(folder)
    assert load_weights(fresh, weights, names, what="test") == len(names)
    for (name, a), b in zip(saved.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    assert fresh.lm_head.weight is fresh.transformer.wte.weight  # still tied: copied in place


def test_only_the_named_tensors_are_loaded_and_a_tied_weight_under_either_name(tmp_path):
    saved, folder = _saved(tmp_path)
    fresh = _model(seed=1)
    before = fresh.transformer.h[1].mlp.c_fc.weight.detach().clone()
    # the head's name: the file holds the tied weight once, under the embedding's name
    load_weights(fresh, find_weights(folder), ["lm_head.weight", "transformer.h.0.ln_1.weight"], what="test")
    assert torch.equal(fresh.lm_head.weight, saved.transformer.wte.weight)
    assert torch.equal(fresh.transformer.h[0].ln_1.weight, saved.transformer.h[0].ln_1.weight)
    assert torch.equal(fresh.transformer.h[1].mlp.c_fc.weight, before)


def test_a_base_models_keys_load_into_the_head_model(tmp_path):
    saved = _model(seed=0)
    folder = tmp_path / "base"
    saved.transformer.save_pretrained(folder)  # keys without the "transformer." prefix
    fresh = _model(seed=1)
    load_weights(fresh, find_weights(folder), ["transformer.h.1.attn.c_proj.weight"], what="test")
    assert torch.equal(fresh.transformer.h[1].attn.c_proj.weight, saved.transformer.h[1].attn.c_proj.weight)


def test_weights_of_another_config_name_the_first_mismatch(tmp_path):
    _, folder = _saved(tmp_path)
    wider = _model(GPT2.replace("n_embd=32", "n_embd=64"), device="meta")
    with pytest.raises(InvalidInputError) as err:
        check_weights(wider, find_weights(folder), what="--init pretrained")
    text = str(err.value)
    assert "'transformer.wte.weight' of shape (256, 64)" in text and "(256, 32)" in text
    assert "--init random" in text and "\n" not in text
    deeper = _model(GPT2.replace("n_layer=2", "n_layer=3"), device="meta")
    with pytest.raises(InvalidInputError, match=r"parameter 'transformer.h.2.ln_1.weight' .*no such tensor"):
        check_weights(deeper, find_weights(folder), what="--init pretrained")


def test_a_missing_tensor_is_named(tmp_path):
    saved = _model(seed=0)
    state = {k: v for k, v in saved.state_dict().items() if k not in ("lm_head.weight", "transformer.ln_f.bias")}
    (tmp_path / "m").mkdir()
    save_file(state, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(InvalidInputError, match="parameter 'transformer.ln_f.bias' of shape \\(32,\\); found no"):
        check_weights(_model(device="meta"), find_weights(tmp_path / "m"), what="x")


def test_no_weights_pickles_and_bad_indexes(tmp_path):
    assert find_weights(tmp_path) is None  # a config alone: nothing to load
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(InvalidInputError, match="found only pytorch_model.bin"):
        find_weights(tmp_path)
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": {"a": "../outside.safetensors"}}))
    with pytest.raises(InvalidInputError, match="expected a file name in the same folder; found a path"):
        find_weights(tmp_path)
    (tmp_path / INDEX_FILE).write_text("[1, 2]")
    with pytest.raises(InvalidInputError, match="'weight_map'"):
        find_weights(tmp_path)
    (tmp_path / INDEX_FILE).unlink()
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(InvalidInputError, match="expected a safetensors file"):
        find_weights(tmp_path)


def test_init_reaches_the_ranks_and_a_resumed_run_reads_no_folder(tmp_path):
    from planner.runtime.options import RunOptions
    from planner.runtime.rank.rank_setup import pretrained_weights
    from planner.runtime.run_args import parse_worker_args

    _, folder = _saved(tmp_path)
    for init in ("pretrained", "random"):
        assert parse_worker_args(RunOptions(plan="p.json", init=init).worker_argv()).init == init
    with pytest.raises(InvalidInputError, match="--init"):
        RunOptions(plan="p.json", init="zeros")
    spec = f"hf:{folder}"
    assert pretrained_weights(spec, RunOptions(plan="p.json")).folder == folder
    assert pretrained_weights(f"{spec}/config.json", RunOptions(plan="p.json")).folder == folder
    assert pretrained_weights(spec, RunOptions(plan="p.json", init="random")) is None
    assert pretrained_weights(spec, RunOptions(plan="p.json", resume=True, checkpoint_dir=str(tmp_path))) is None
    assert pretrained_weights(GPT2, RunOptions(plan="p.json")) is None  # a model type: no folder
