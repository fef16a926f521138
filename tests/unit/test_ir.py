"""The graph IR's value types and invariants."""
import pytest

from planner.errors import InvalidInputError
from planner.ir import (
    Block,
    BlockChain,
    Graph,
    Node,
    ParamInfo,
    TensorMeta,
    dtype_bytes,
)


def _meta(*shape, dtype="float32"):
    return TensorMeta(shape=tuple(shape), dtype=dtype)


def _tiny_graph():
    w = ParamInfo(name="lin.weight", meta=_meta(4, 8))
    buf = ParamInfo(name="norm.running", meta=_meta(4), trainable=False)
    nodes = [
        Node(name="x", op="placeholder", kind="input", outputs=(_meta(2, 8),)),
        Node(name="mm", op="aten.mm", inputs=("x",), outputs=(_meta(2, 4),), param_names=("lin.weight",),
             fwd_flops=2 * 2 * 8 * 4, bwd_flops=2 * 2 * 2 * 8 * 4, module_path="lin"),
        Node(name="view", op="aten.view", inputs=("mm",), outputs=(_meta(8),), is_view=True),
        Node(name="out", op="output", kind="output", inputs=("view",)),
    ]
    return Graph(name="tiny", source="test", nodes=nodes, params=[w, buf])


def test_tensor_meta_bytes():
    assert _meta(2, 3).nbytes == 24
    assert _meta(2, 3, dtype="bfloat16").nbytes == 12
    assert dtype_bytes("torch.int64") == 8
    with pytest.raises(InvalidInputError, match="unknown dtype"):
        _meta(2, dtype="float7")
    with pytest.raises(InvalidInputError, match="tensor shape"):
        TensorMeta(shape=(-1,), dtype="float32")


def test_graph_totals_and_structure():
    g = _tiny_graph()
    assert len(g) == 4
    assert g.order == ("x", "mm", "view", "out")
    assert g.successors("mm") == ("view",)
    assert g.predecessors("mm") == ("x",)
    assert g.fwd_flops == 128 and g.bwd_flops == 256
    assert g.param_count == 32 and g.param_bytes == 128
    assert g.buffer_bytes == 16
    assert [n.name for n in g.inputs()] == ["x"]
    assert [n.name for n in g.outputs()] == ["out"]


def test_graph_rejects_bad_order_and_unknown_param():
    with pytest.raises(InvalidInputError, match="topological"):
        Graph(name="g", source="t", nodes=[Node(name="a", op="add", inputs=("b",)), Node(name="b", op="x")])
    with pytest.raises(InvalidInputError, match="unknown parameter"):
        Graph(name="g", source="t", nodes=[Node(name="a", op="mm", param_names=("w",))])
    with pytest.raises(InvalidInputError, match="duplicate"):
        Graph(name="g", source="t", nodes=[Node(name="a", op="x"), Node(name="a", op="y")])


def test_fingerprint_tracks_structure_and_shapes():
    a, b = _tiny_graph(), _tiny_graph()
    assert a.fingerprint() == b.fingerprint()
    other = Graph(name="tiny", source="test", nodes=[
        Node(name="x", op="placeholder", kind="input", outputs=(_meta(3, 8),))])
    assert other.fingerprint() != a.fingerprint()


def _block(i, **kw):
    base = dict(index=i, name=f"b{i}", node_names=(f"n{i}",), module_paths=(), param_names=(),
                fwd_flops=10, bwd_flops=20, param_count=1, param_bytes=4, saved_act_bytes=8,
                out_bytes=8, boundary_nodes=(f"n{i}",))
    base.update(kw)
    return Block(**base)


def test_block_chain_checks_and_totals():
    chain = BlockChain(model_name="m", fingerprint="f", blocks=(_block(0), _block(1)), input_bytes=8,
                       microbatch_size=1)
    assert chain.fwd_flops == 20 and chain.param_bytes == 8 and len(chain) == 2
    with pytest.raises(InvalidInputError, match="index"):
        BlockChain(model_name="m", fingerprint="f", blocks=(_block(1),), input_bytes=0, microbatch_size=1)
    with pytest.raises(InvalidInputError, match="at least one block"):
        BlockChain(model_name="m", fingerprint="f", blocks=(), input_bytes=0, microbatch_size=1)
    with pytest.raises(InvalidInputError, match="fwd_flops"):
        _block(0, fwd_flops=-1)
