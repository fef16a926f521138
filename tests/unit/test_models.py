"""Reference models and the registry: shapes, parameter counts, meta builds, init, errors."""
from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import psutil
import pytest
import torch

from models.cnn import CNNConfig
from models.gpt import GPT, GPTConfig
from models.llama import Llama, LlamaConfig, Rotary
from models.mlp import MLPConfig
from models.registry import PRESETS, build_model, loss_fn
from planner.errors import InvalidInputError

torch.set_num_threads(1)
TINY = ("gpt-tiny", "llama-tiny", "mlp-tiny", "cnn-tiny")
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


# ------------------------------------------------------------------ parameter-count formulas

def gpt_params(c: GPTConfig) -> int:
    d, f = c.d_model, c.ffn_dim
    layer = 4 * d * d + 2 * d * f + 9 * d + f  # 2 LayerNorms, qkv+proj with biases, fc+proj with biases
    return c.vocab_size * d + c.max_seq * d + c.n_layers * layer + 2 * d + (0 if c.tie_weights else c.vocab_size * d)


def llama_params(c: LlamaConfig) -> int:
    d, kv = c.d_model, c.n_kv_heads * c.head_dim
    layer = 2 * d + 2 * d * d + 2 * d * kv + 3 * d * c.d_ff
    return c.vocab_size * d + c.n_layers * layer + d + (0 if c.tie_weights else c.vocab_size * d)


def mlp_params(c: MLPConfig) -> int:
    d, f = c.d_model, c.d_ff
    return c.d_in * d + d + c.n_layers * (2 * d + 2 * d * f + f + d) + 2 * d + d * c.n_classes + c.n_classes


def cnn_params(c: CNNConfig) -> int:
    total = c.in_channels * 9 * c.widths[0] + 2 * c.widths[0]
    c_in = c.widths[0]
    for stage, (w, n) in enumerate(zip(c.widths, c.blocks)):
        for i in range(n):
            total += c_in * 9 * w + 2 * w + w * 9 * w + 2 * w
            if (stage > 0 and i == 0) or c_in != w:
                total += c_in * w + 2 * w
            c_in = w
    return total + c_in * c.n_classes + c.n_classes


FORMULAS = {GPTConfig: gpt_params, LlamaConfig: llama_params, MLPConfig: mlp_params, CNNConfig: cnn_params}


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_builds_on_meta_with_formula_param_count(name):
    bundle = build_model(name)
    tensors = [*bundle.module.parameters(), *bundle.module.buffers(), *bundle.example_inputs]
    assert all(t.device.type == "meta" for t in tensors)
    assert count(bundle.module) == FORMULAS[type(PRESETS[name].config)](PRESETS[name].config)
    assert isinstance(bundle.module.layers, torch.nn.ModuleList) and len(bundle.module.layers) >= 2
    assert hasattr(bundle.module, "head") and (hasattr(bundle.module, "embed") or hasattr(bundle.module, "stem"))


def test_known_published_parameter_counts():
    tied = lambda n: dataclasses.replace(PRESETS[n].config, tie_weights=True)  # noqa: E731
    with torch.device("meta"):
        assert count(GPT(tied("gpt-small"))) == 124_439_808      # GPT-2 small
        assert count(GPT(tied("gpt-medium"))) == 354_823_168     # GPT-2 medium
    assert count(build_model("llama-7b").module) == 6_738_415_616  # Llama-2-7B
    assert count(build_model("cnn-small").module) == 11_173_962    # CIFAR ResNet-18


def test_llama_7b_meta_build_is_fast_and_allocates_nothing():
    rss0 = psutil.Process().memory_info().rss
    t0 = time.perf_counter()
    bundle = build_model("llama-7b", batch=2)
    elapsed = time.perf_counter() - t0
    assert elapsed < 10.0  # generous: about 0.5 s on an idle core; 27 GB of real weights would take minutes
    assert psutil.Process().memory_info().rss - rss0 < 300 * 2**20
    assert bundle.example_inputs[0].shape == (2, 4096) and bundle.example_inputs[0].dtype == torch.long
    assert bundle.vocab_or_classes == 32000 and bundle.family == "lm"


@pytest.mark.parametrize("name", TINY)
def test_tiny_presets_forward_shapes_and_layer_chain(name):
    bundle = build_model(name, batch=2, device="cpu", seed=1)
    m, (x,) = bundle.module, bundle.example_inputs
    out = m(x)
    lm = bundle.family == "lm"
    assert out.shape == ((2, x.shape[1], 256) if lm else (2, 10))
    assert torch.isfinite(out).all()
    # Every layer maps one tensor to one tensor: the pipeline cut contract.
    h = (m.embed if hasattr(m, "embed") else m.stem)(x)
    for layer in m.layers:
        h = layer(h)
        assert isinstance(h, torch.Tensor)
    torch.testing.assert_close(m.head(h), out)
    targets = torch.zeros(out.shape[:-1], dtype=torch.long)
    assert loss_fn(bundle)(out, targets).ndim == 0


def test_seed_determines_weights_and_stage_init_matches_full_model():
    a = build_model("llama-tiny", device="cpu", seed=3).module
    b = build_model("llama-tiny", device="cpu", seed=3).module
    c = build_model("llama-tiny", device="cpu", seed=4).module
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    assert not torch.equal(a.layers[0].attn.q.weight, c.layers[0].attn.q.weight)
    # A pipeline rank materialises only its layers and gets the same weights.
    stage = build_model("llama-tiny").module
    stage.layers[2].to_empty(device="cpu")
    stage.init_weights(seed=3)
    for (name, p), q in zip(stage.layers[2].named_parameters(), a.layers[2].parameters()):
        assert torch.equal(p, q), name
    assert stage.layers[1].attn.q.weight.is_meta


def test_init_scales():
    m = build_model("gpt-small", device="meta").module  # shapes only; check init on a small real model
    assert m.layers[0].attn.proj.weight.is_meta
    g = build_model("gpt-tiny", device="cpu").module
    assert g.layers[0].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert g.layers[0].attn.proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.15)
    assert torch.all(g.layers[0].ln1.weight == 1) and torch.all(g.layers[0].attn.qkv.bias == 0)


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_attention_is_causal(name):
    bundle = build_model(name, batch=1, device="cpu")
    x = bundle.example_inputs[0].clone()
    y = x.clone()
    y[:, 20:] = (y[:, 20:] + 1) % 256
    a, b = bundle.module(x), bundle.module(y)
    torch.testing.assert_close(a[:, :20], b[:, :20])
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_rotary_preserves_norms_and_depends_on_relative_position():
    rot = Rotary(head_dim=16, max_seq=12, theta=10000.0)
    x = torch.randn(2, 3, 12, 16)
    torch.testing.assert_close(rot(x).norm(dim=-1), x.norm(dim=-1))
    q, k = torch.randn(16), torch.randn(16)
    rq = rot(q.expand(1, 1, 12, 16))[0, 0]
    rk = rot(k.expand(1, 1, 12, 16))[0, 0]
    torch.testing.assert_close(rq[5] @ rk[2], rq[9] @ rk[6])  # both offset 3
    assert not torch.allclose(rq[5] @ rk[2], rq[5] @ rk[4])


def test_rotary_tables_are_non_persistent_and_rebuilt_after_materialising():
    m = build_model("llama-tiny", device="cpu").module
    assert not any("rotary" in k for k in m.state_dict())
    fresh = Rotary(head_dim=16, max_seq=32, theta=10000.0)
    torch.testing.assert_close(m.layers[3].attn.rotary.cos, fresh.cos)
    torch.testing.assert_close(m.layers[3].attn.rotary.sin, fresh.sin)


def test_grouped_query_attention_equals_mha_with_repeated_kv_heads():
    cfg = PRESETS["llama-tiny"].config
    assert cfg.n_kv_heads < cfg.n_heads
    gqa = build_model("llama-tiny", device="cpu").module
    mha = Llama(dataclasses.replace(cfg, n_kv_heads=cfg.n_heads))
    rep, hd = cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
    with torch.no_grad():
        for name, p in mha.named_parameters():
            src = dict(gqa.named_parameters())[name]
            if name.endswith((".attn.k.weight", ".attn.v.weight")):
                src = src.view(cfg.n_kv_heads, hd, -1).repeat_interleave(rep, dim=0).reshape(p.shape)
            p.copy_(src)
    x = build_model("llama-tiny", batch=2, device="cpu").example_inputs[0]
    torch.testing.assert_close(mha(x), gqa(x))


def test_weight_tying_shares_one_tensor_after_materialising(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))
    bundle = build_model("model_factories:tied_gpt", batch=2, seq=8, device="cpu")
    m = bundle.module
    assert m.head.proj.weight is m.embed.tok.weight
    assert bundle.example_inputs[0].shape == (2, 8) and bundle.family == "lm" and bundle.vocab_or_classes == 64
    # The preset path: meta build, to_empty (which unties), init_weights (which re-ties).
    tied = GPT(dataclasses.replace(PRESETS["gpt-tiny"].config, tie_weights=True))
    tied.to_empty(device="cpu")
    tied.init_weights(0)
    assert tied.head.proj.weight.data_ptr() == tied.embed.tok.weight.data_ptr()
    assert count(tied) == gpt_params(tied.config)
    assert build_model("gpt-tiny").module.head.proj.weight is not build_model("gpt-tiny").module.embed.tok.weight


def test_factories_infer_or_take_example_inputs(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))
    mlp = build_model("model_factories:mlp_only", batch=3)
    assert mlp.example_inputs[0].shape == (3, 12) and mlp.example_inputs[0].is_meta
    assert (mlp.family, mlp.vocab_or_classes, mlp.name) == ("classifier", 5, "mlp_only")
    assert next(mlp.module.parameters()).is_meta
    given = build_model("model_factories:with_inputs", device="cpu")
    assert given.example_inputs[0].shape == (2, 2, 3) and given.vocab_or_classes == 3
    a = build_model("model_factories:mlp_only", device="cpu", seed=5).module
    b = build_model("model_factories:mlp_only", device="cpu", seed=5).module
    assert torch.equal(a[0].weight, b[0].weight)


def test_seq_handling():
    assert build_model("gpt-tiny", seq=8).example_inputs[0].shape == (1, 8)
    long_llama = build_model("llama-tiny", seq=64)
    assert long_llama.module.layers[0].attn.rotary.cos.shape[0] == 64
    assert build_model("cnn-tiny", batch=2, seq=24).example_inputs[0].shape == (2, 3, 24, 24)


@pytest.mark.parametrize(("spec", "kwargs", "needle"), [
    ("gpt-smal", {}, "did you mean gpt-small"),
    ("resnet", {}, "gpt-tiny"),
    ("no_such_pkg_xyz.mod:f", {}, "cannot import 'no_such_pkg_xyz.mod'"),
    ("model_factories:tied_gtp", {}, "did you mean tied_gpt"),
    ("model_factories:NOT_CALLABLE", {}, "expected a callable"),
    ("model_factories:raises", {}, "raised ValueError; found bad hyper-parameter width=-1"),
    ("model_factories:returns_garbage", {}, "found dict"),
    ("model_factories:no_params", {}, "return (module, example_inputs)"),
    ("model_factories:wrong_output", {}, "expected logits"),
    ("model_factories:", {}, "expected package.module:factory"),
    ("model_factories_broken:f", {}, "raised RuntimeError; found this module needs a GPU driver"),
    ("gpt-tiny", {"seq": 33}, "at most 32"),
    ("mlp-tiny", {"seq": 4}, "omit --seq"),
    ("gpt-tiny", {"batch": 0}, "batch >= 1"),
    ("gpt-tiny", {"device": "nodevice"}, "a torch device"),
])
def test_bad_specs_raise_clear_errors(monkeypatch, spec, kwargs, needle):
    monkeypatch.syspath_prepend(str(FIXTURES))
    with pytest.raises(InvalidInputError) as info:
        build_model(spec, **kwargs)
    assert needle in str(info.value)


@pytest.mark.parametrize(("cls", "kwargs"), [
    (GPTConfig, dict(vocab_size=8, max_seq=8, n_layers=1, d_model=30, n_heads=4)),
    (LlamaConfig, dict(vocab_size=8, max_seq=8, n_layers=1, d_model=32, n_heads=4, n_kv_heads=3, d_ff=8)),
    (MLPConfig, dict(d_in=0, d_model=4, d_ff=4, n_layers=1, n_classes=2)),
    (CNNConfig, dict(widths=(12,), blocks=(1,), n_classes=2)),
])
def test_bad_configs_raise(cls, kwargs):
    with pytest.raises(InvalidInputError):
        cls(**kwargs)
