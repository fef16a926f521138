"""Tracing PyTorch models into the graph IR: FLOPs, parameters, names, views, fallbacks, errors."""
from __future__ import annotations

import operator

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import sdpa_flop_count

from models.gpt import GPT, GPTConfig
from models.registry import PRESETS, build_model
from planner.coarsen import coarsen
from planner.errors import InvalidInputError, TraceError
from planner.flops import ATTN_SCORE_FLOPS_PER_ELEMENT, measure_op, meta_tensor
from planner.trace import clean_module_path, trace
from tests.fixtures.trace_models import GateNet


def _gpt_matmul_flops(cfg, b: int, t: int) -> int:
    """Analytic forward FLOPs of a GPT: linear layers (2 per multiply-add) + attention's two matmuls."""
    d, f = cfg.d_model, cfg.ffn_dim
    per_layer = 2 * b * t * (d * 3 * d + d * d + d * f + f * d) + 2 * 2 * b * t * t * d
    return cfg.n_layers * per_layer + 2 * b * t * d * cfg.vocab_size


def _llama_matmul_flops(cfg, b: int, t: int) -> int:
    d, hd = cfg.d_model, cfg.head_dim
    kv = cfg.n_kv_heads * hd
    linears = d * d + 2 * d * kv + d * d + 3 * d * cfg.d_ff
    per_layer = 2 * b * t * linears + 2 * 2 * b * t * t * d  # K/V are repeated to all query heads
    return cfg.n_layers * per_layer + 2 * b * t * d * cfg.vocab_size


@pytest.mark.parametrize("spec, analytic", [("gpt-small", _gpt_matmul_flops), ("llama-small", _llama_matmul_flops)])
def test_preset_flops_match_analytic_count(spec, analytic):
    batch, seq = 2, 64
    bundle = build_model(spec, batch=batch, seq=seq)  # meta device: no weight memory
    graph = trace(bundle.module, bundle.example_inputs, name=spec)
    expected = analytic(PRESETS[spec].config, batch, seq)
    assert graph.fwd_flops == pytest.approx(expected, rel=0.02)
    assert graph.fwd_flops >= expected  # elementwise work only adds
    # Backward ~ 2x forward: fwd + bwd ~ 3x fwd (NOTES.md).
    assert (graph.fwd_flops + graph.bwd_flops) / graph.fwd_flops == pytest.approx(3.0, abs=0.05)
    assert graph.param_count == sum(p.numel() for p in bundle.module.parameters())


def test_node_names_are_the_exported_names_and_params_resolve_to_fqns():
    cfg = GPTConfig(vocab_size=64, max_seq=16, n_layers=2, d_model=32, n_heads=2)
    with torch.device("meta"):
        model = GPT(cfg)
    idx = torch.zeros(2, 16, dtype=torch.long, device="meta")
    graph = trace(model, (idx,), name="gpt2l")
    exported = torch.export.export(model, (idx,), strict=False)
    sig = exported.graph_signature
    lifted = set(sig.inputs_to_parameters) | set(sig.inputs_to_buffers)
    names = [n.name for n in exported.graph.nodes if n.name not in lifted and n.op != "get_attr"]
    assert list(graph.order) == names
    assert [n.kind for n in graph.inputs()] == ["input"] and graph.inputs()[0].name == "idx"
    assert graph.nodes()[-1].kind == "output" and graph.nodes()[-1].inputs
    assert set(graph.params) == {name for name, _ in model.named_parameters()}
    qkv = [n for n in graph.nodes() if n.module_path == "layers.1.attn.qkv"]
    assert len(qkv) == 1 and qkv[0].param_names == ("layers.1.attn.qkv.weight", "layers.1.attn.qkv.bias")
    assert qkv[0].fwd_flops == 2 * 2 * 16 * 32 * 96
    assert qkv[0].bwd_flops == 2 * qkv[0].fwd_flops  # input grad + weight grad
    assert not any(p in graph.order for p in graph.params)  # parameters are not nodes


def test_views_and_copies():
    graph = _tiny_gpt_graph()
    by_op: dict[str, list] = {}
    for n in graph.nodes():
        by_op.setdefault(n.op, []).append(n)
    assert all(n.is_view and n.fwd_flops == 0 for n in by_op["aten.transpose.int"] + by_op["aten.view.default"])
    assert all(n.is_view for n in by_op["getitem"] + by_op["aten.split.Tensor"])
    # y.transpose(1, 2).reshape(...) must copy: the reshape is not a view.
    assert not any(n.is_view for n in by_op["aten.reshape.default"])
    assert all(not n.is_view and n.fwd_flops > 0 for n in by_op["aten.layer_norm.default"])


def _tiny_gpt_graph():
    bundle = build_model("gpt-tiny", batch=2, seq=8)
    return trace(bundle.module, bundle.example_inputs, name="gpt-tiny")


def test_buffers_are_params_that_do_not_train_and_rotary_tables_resolve():
    bundle = build_model("llama-tiny", batch=1, seq=16)
    graph = trace(bundle.module, bundle.example_inputs, name="llama-tiny")
    buffers = {n for n, p in graph.params.items() if not p.trainable}
    assert "layers.0.attn.rotary.cos" in buffers and "layers.3.attn.rotary.sin" in buffers
    readers = [n for n in graph.nodes() if "layers.2.attn.rotary.cos" in n.param_names]
    assert readers and all(n.module_path == "layers.2.attn.rotary" for n in readers)
    assert graph.param_count == sum(p.numel() for p in bundle.module.parameters())


def test_first_layer_without_input_grad_has_weight_grad_only():
    bundle = build_model("mlp-tiny", batch=4)
    graph = trace(bundle.module, bundle.example_inputs, name="mlp-tiny")
    linears = [n for n in graph.nodes() if n.op == "aten.linear.default"]
    first, rest = linears[0], linears[1:]
    assert first.module_path == "embed"
    assert first.bwd_flops == first.fwd_flops          # no gradient for the data input
    assert all(n.bwd_flops == 2 * n.fwd_flops for n in rest)


def test_sdpa_on_cpu_fake_tensors_is_counted_through_the_custom_mapping():
    # On CPU (fake) tensors SDPA dispatches to the CPU flash kernel, which has no flop formula.
    with FakeTensorMode():
        q, k, v = (torch.empty(2, 4, 32, 16, requires_grad=True) for _ in range(3))
        cost, _ = measure_op(torch.ops.aten.scaled_dot_product_attention.default, (q, k, v, None, 0.0, True), {},
                             target=torch.ops.aten.scaled_dot_product_attention.default)
    matmul = sdpa_flop_count((2, 4, 32, 16), (2, 4, 32, 16), (2, 4, 32, 16))
    assert cost.fwd_flops == matmul + ATTN_SCORE_FLOPS_PER_ELEMENT * 2 * 4 * 32 * 32
    assert cost.bwd_flops > 2 * matmul
    # The meta path (math attention, decomposed) agrees within a few percent.
    args = tuple(meta_tensor((2, 4, 32, 16), torch.float32, requires_grad=True) for _ in range(3))
    meta_cost, _ = measure_op(torch.ops.aten.scaled_dot_product_attention.default, (*args, None, 0.0, True), {},
                              target=torch.ops.aten.scaled_dot_product_attention.default)
    assert meta_cost.fwd_flops == pytest.approx(cost.fwd_flops, rel=0.05)


def test_getitem_and_python_operators_count_as_expected():
    x = meta_tensor((4, 6), torch.float32, requires_grad=True)
    cost, _ = measure_op(operator.add, (x, x), {}, target=operator.add)
    assert cost.fwd_flops == 24 and cost.bwd_flops == 24 and not cost.is_view
    cost, _ = measure_op(torch.Tensor.view, (x, 24), {}, target="view")
    assert cost.is_view and cost.fwd_flops == 0


def test_fx_fallback_when_export_fails(monkeypatch):
    reference = _tiny_gpt_graph()

    def refuse(*args, **kwargs):
        raise RuntimeError("export unavailable in this test")

    monkeypatch.setattr(torch.export, "export", refuse)
    graph = _tiny_gpt_graph()
    assert graph.source == "torch.fx" and reference.source == "torch.export"
    assert graph.param_count == reference.param_count
    assert set(graph.params) == set(reference.params)
    assert graph.fwd_flops == pytest.approx(reference.fwd_flops, rel=0.01)
    assert graph.bwd_flops == pytest.approx(reference.bwd_flops, rel=0.01)
    assert [b.name for b in coarsen(graph).blocks] == [b.name for b in coarsen(reference).blocks]


def test_untraceable_model_raises_one_trace_error_naming_module_and_line():
    with pytest.raises(TraceError) as err:
        trace(GateNet(), torch.randn(2, 4), name="gatenet")
    message = str(err.value)
    assert "layers.0 (Gate)" in message and "if y.sum() > 0:" in message
    assert "aten.item" in message and "fix:" in message and "\n" not in message


def test_failed_export_prints_nothing(capfd):
    with pytest.raises(TraceError):
        trace(GateNet(), torch.randn(2, 4))
    assert capfd.readouterr().err == ""


def test_bad_arguments():
    with pytest.raises(InvalidInputError, match="torch.nn.Module"):
        trace("gpt-tiny", torch.zeros(1))
    with pytest.raises(InvalidInputError, match="tuple of tensors"):
        trace(nn.Linear(2, 2), ([1.0, 2.0],))


def test_real_weights_model_traces_like_meta_and_mutated_buffers_stay_inside():
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))  # train mode
    graph = trace(model, torch.randn(4, 6), name="bn")
    with torch.device("meta"):
        meta_model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    assert trace(meta_model, torch.randn(4, 6, device="meta"), name="bn").fingerprint() == graph.fingerprint()
    out = graph.outputs()[0]
    assert len(out.inputs) == 1  # the running-stat updates are not model outputs
    assert not graph.params["1.running_mean"].trainable
    assert graph.param_count == sum(p.numel() for p in model.parameters())


def test_clean_module_path():
    assert clean_module_path("layers.3.attn") == "layers.3.attn"
    assert clean_module_path("L['self'].layers[3].attn") == "layers.3.attn"
    assert clean_module_path("L['self']._modules['head']") == "head"


class _NoGradRegion(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.no_grad():
            scale = (h @ h.t()).mean()
        return self.b(h) * scale


def test_no_grad_region_is_measured_and_grad_mode_survives():
    graph = trace(_NoGradRegion(), torch.randn(2, 8))
    region = [n for n in graph.nodes() if "set_grad_enabled" in n.op]
    assert len(region) == 1 and region[0].fwd_flops >= 2 * 2 * 8 * 2 and region[0].bwd_flops == 0
    second = [n for n in graph.nodes() if n.module_path == "b"][0]
    assert second.bwd_flops == 2 * second.fwd_flops  # the region did not switch autograd off for later ops
    assert torch.is_grad_enabled()
