"""ONNX import/export: agreement with the PyTorch tracer, FLOP conventions, bad files."""
from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

from models.registry import build_model
from planner.coarsen import coarsen
from planner.errors import InvalidInputError
from planner.onnx_import import export_onnx, load_onnx
from planner.trace import trace


@pytest.fixture(scope="module")
def gpt_pair(tmp_path_factory):
    """gpt-tiny traced by torch and exported + re-imported through ONNX, same shapes."""
    bundle = build_model("gpt-tiny", batch=2, seq=16, device="cpu")
    folder = tmp_path_factory.mktemp("onnx")
    path = export_onnx(bundle.module, bundle.example_inputs, folder / "gpt-tiny.onnx")
    return trace(bundle.module, bundle.example_inputs, name="gpt-tiny"), load_onnx(path), folder


def test_torch_and_onnx_graphs_agree(gpt_pair):
    torch_graph, onnx_graph, _ = gpt_pair
    assert onnx_graph.source == "onnx"
    assert onnx_graph.param_count == torch_graph.param_count  # exactly
    assert set(onnx_graph.params) == set(torch_graph.params)
    assert onnx_graph.fwd_flops == pytest.approx(torch_graph.fwd_flops, rel=0.02)
    assert onnx_graph.bwd_flops == pytest.approx(torch_graph.bwd_flops, rel=0.02)
    t_chain, o_chain = coarsen(torch_graph), coarsen(onnx_graph)
    assert [b.name for b in o_chain.blocks] == [b.name for b in t_chain.blocks] == \
        ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]
    for t_block, o_block in zip(t_chain.blocks, o_chain.blocks):
        assert o_block.out_bytes == pytest.approx(t_block.out_bytes, rel=0.02), t_block.name
        assert o_block.param_count == t_block.param_count
        assert o_block.fwd_flops == pytest.approx(t_block.fwd_flops, rel=0.02, abs=1)


def test_module_paths_and_parameters_come_from_exporter_metadata(gpt_pair):
    _, graph, _ = gpt_pair
    matmuls = [n for n in graph.nodes() if n.op == "MatMul" and n.module_path == "layers.2.attn.qkv"]
    assert len(matmuls) == 1 and matmuls[0].param_names == ("layers.2.attn.qkv.weight",)
    assert matmuls[0].fwd_flops == 2 * 2 * 16 * 64 * 192
    assert not any(n.op in ("Constant", "Shape") for n in graph.nodes())  # static values are folded away
    assert [n.name for n in graph.inputs()] == ["idx"]


def test_export_writes_only_the_model_and_its_data(gpt_pair):
    _, _, folder = gpt_pair
    assert sorted(p.name for p in folder.iterdir()) == ["gpt-tiny.onnx", "gpt-tiny.onnx.data"]
    assert onnx.load(str(folder / "gpt-tiny.onnx"), load_external_data=False).graph.initializer[0].data_location \
        == TensorProto.EXTERNAL


def test_export_refuses_meta_models_and_missing_folders(tmp_path):
    meta = build_model("mlp-tiny", batch=1)
    with pytest.raises(InvalidInputError, match="meta"):
        export_onnx(meta.module, meta.example_inputs, tmp_path / "m.onnx")
    real = build_model("mlp-tiny", batch=1, device="cpu")
    with pytest.raises(InvalidInputError, match="existing folder"):
        export_onnx(real.module, real.example_inputs, tmp_path / "nope" / "m.onnx")


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(InvalidInputError, match="no such file"):
        load_onnx(tmp_path / "missing.onnx")
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x08\x07\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01 not protobuf")
    with pytest.raises(InvalidInputError, match="garbage.onnx"):
        load_onnx(garbage)
    text = tmp_path / "notes.onnx"
    text.write_text("this is a text file, not a model\n")
    with pytest.raises(InvalidInputError, match="notes.onnx"):
        load_onnx(text)


def _save(tmp_path, graph, name="m.onnx"):
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    path = tmp_path / name
    onnx.save(model, str(path))
    return path


def test_hand_built_mlp_flops_and_folding(tmp_path):
    """x[4,8] @ W1^T (transposed initializer: static) -> Relu -> Gemm(W2, b2): conventions by hand."""
    w1 = helper.make_tensor("fc1.weight", TensorProto.FLOAT, [16, 8], [0.0] * 128)
    w2 = helper.make_tensor("fc2.weight", TensorProto.FLOAT, [3, 16], [0.0] * 48)
    b2 = helper.make_tensor("fc2.bias", TensorProto.FLOAT, [3], [0.0] * 3)
    nodes = [
        helper.make_node("Transpose", ["fc1.weight"], ["w1t"], name="/fc1/Transpose", perm=[1, 0]),
        helper.make_node("MatMul", ["x", "w1t"], ["h"], name="/fc1/MatMul"),
        helper.make_node("Relu", ["h"], ["r"], name="/act/Relu"),
        helper.make_node("Gemm", ["r", "fc2.weight", "fc2.bias"], ["y"], name="/fc2/Gemm", transB=1),
    ]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 3])],
                              initializer=[w1, w2, b2])
    g = load_onnx(_save(tmp_path, graph))
    by_name = {n.name: n for n in g.nodes()}
    assert "/fc1/Transpose" not in by_name  # a function of a weight only: folded into its consumer
    mm, relu, gemm = by_name["/fc1/MatMul"], by_name["/act/Relu"], by_name["/fc2/Gemm"]
    assert mm.param_names == ("fc1.weight",) and mm.module_path == "fc1"
    assert mm.fwd_flops == 2 * 4 * 8 * 16 and mm.bwd_flops == mm.fwd_flops  # no grad for the input x
    assert relu.fwd_flops == 4 * 16 and relu.bwd_flops == relu.fwd_flops
    assert gemm.fwd_flops == 2 * 4 * 16 * 3 and gemm.bwd_flops == 2 * gemm.fwd_flops
    assert g.param_count == 16 * 8 + 3 * 16 + 3
    assert [b.name for b in coarsen(g).blocks] == ["fc1", "act", "fc2"]


def test_symbolic_shapes_are_refused(tmp_path):
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "dyn",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])])
    with pytest.raises(InvalidInputError, match="static shape"):
        load_onnx(_save(tmp_path, graph))


def test_sdpa_pieces_sum_like_the_fused_op(gpt_pair):
    torch_graph, onnx_graph, _ = gpt_pair
    t_attn = sum(n.fwd_flops for n in torch_graph.nodes() if n.module_path == "layers.0.attn"
                 and "scaled_dot_product" in n.op)
    o_attn = sum(n.fwd_flops for n in onnx_graph.nodes() if n.module_path == "layers.0.attn")
    assert o_attn == pytest.approx(t_attn, rel=0.05)
    assert t_attn > 0
