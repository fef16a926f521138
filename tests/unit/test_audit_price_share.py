"""The input gradient's share of an audited stage's backward, from the trace (issue 37): what an audit recomputing a
stage's input gradient alone runs (``runtime.rank.audit_copy.grads``), per op's backward FLOPs (``planner.flops``),
summed per block (``ir.Block.bwd_input_flops``), priced by ``audit_price.audited_backward_ms``."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from planner.coarsen import coarsen, input_grad_flops
from planner.errors import InvalidInputError
from planner.flops import onnx_bwd_flops, onnx_bwd_input_flops
from planner.ir import Block, Graph, Node
from planner.solver.audit_price import (
    INPUT_GRAD_SHARE,
    audited_backward_ms,
    input_grad_share,
)
from planner.trace import trace
from planner.trace_fx import FxInterpreter

D, BATCH = 32, 8


class _Units(nn.Module):
    """A chain of numbered units: a linear layer on the data, a GELU, a linear layer, a LayerNorm without weights,
    a linear layer without bias."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(D, D), nn.GELU(), nn.Linear(D, D),
                                     nn.LayerNorm(D, elementwise_affine=False), nn.Linear(D, D, bias=False)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _shares(graph: Graph, blocks: list[Block]) -> float:
    return input_grad_share([b.bwd_flops for b in blocks], [b.bwd_input_flops for b in blocks])


def _stages() -> tuple[Graph, dict[str, Block]]:
    graph = trace(_Units(), (torch.randn(BATCH, D),), name="units")
    chain = coarsen(graph)
    return graph, {b.name: b for b in chain.blocks}


def test_weightless_stage_audits_its_whole_backward_and_a_linear_stage_half():
    graph, blocks = _stages()
    assert {"layers.0", "layers.1", "layers.2", "layers.3", "layers.4"} <= set(blocks)
    bwd_ms = 12.0
    for name in ("layers.1", "layers.3"):    # GELU, LayerNorm without weights: no weight gradient to skip
        share = _shares(graph, [blocks[name]])
        assert blocks[name].bwd_flops > 0 and share == pytest.approx(1.0)
        assert audited_backward_ms(bwd_ms, every=4, replica_microbatches=(4,), contributions=False,
                                   share=share) == pytest.approx(bwd_ms)
    for name in ("layers.2", "layers.4"):    # dX = dY W^T of dX and dW = X^T dY: half (a bias's sum is no matmul)
        share = _shares(graph, [blocks[name]])
        assert share == pytest.approx(0.5)
        assert audited_backward_ms(bwd_ms, every=4, replica_microbatches=(4,), contributions=False,
                                   share=share) == pytest.approx(bwd_ms / 2)
    # the first layer's input is data: its whole backward is its weights'
    assert _shares(graph, [blocks["layers.0"]]) == pytest.approx(0.0)


def test_a_stage_weighs_its_blocks_by_their_backward_flops():
    graph, blocks = _stages()
    gelu, linear = blocks["layers.1"], blocks["layers.2"]
    expected = (gelu.bwd_flops + linear.bwd_flops / 2) / (gelu.bwd_flops + linear.bwd_flops)
    assert 0.5 < expected < 1.0
    assert _shares(graph, [gelu, linear]) == pytest.approx(expected)


def test_contribution_audits_add_the_weights_share_to_the_traced_one():
    graph, blocks = _stages()
    share = _shares(graph, [blocks["layers.1"], blocks["layers.2"]])
    got = audited_backward_ms(10.0, every=4, replica_microbatches=(2, 2), contributions=True, share=share)
    assert got == pytest.approx(10.0 * (share + (1 - share) * (2 * 2 * 4 ** -2) / (4 / 4)))


class _SharedShape(nn.Module):
    """Two matmuls of one signature but for their second operand: a parameter, then an activation."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.w = nn.Parameter(torch.randn(D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        z = torch.nn.functional.gelu(y)
        return (y @ self.w) + (y @ z)


@pytest.mark.parametrize("tracer", ["export", "fx"])
def test_a_weight_operand_and_an_activation_of_one_layout_split_apart(tracer):
    model, x = _SharedShape(), torch.randn(D, D)
    graph = trace(model, (x,), name="shared") if tracer == "export" else \
        FxInterpreter(torch.fx.symbolic_trace(model), "shared").run((x,))
    matmuls = [n for n in graph.nodes() if n.kind == "compute" and n.fwd_flops == 2 * D ** 3]
    splits = sorted(n.bwd_input_flops / n.bwd_flops for n in matmuls)
    assert splits == pytest.approx([0.0, 0.5, 1.0])   # the linear on data, y @ w, y @ z


def test_fallback_only_for_blocks_without_a_record():
    assert input_grad_share([100, 100], [None, None]) == INPUT_GRAD_SHARE
    assert input_grad_share([100, 300], [100, None]) == pytest.approx((100 + INPUT_GRAD_SHARE * 300) / 400)
    assert input_grad_share([0, 0], [0, None]) == 1.0   # recorded, nothing to split
    with pytest.raises(InvalidInputError):
        input_grad_share([100], [50, 50])
    with pytest.raises(InvalidInputError):
        audited_backward_ms(1.0, every=4, replica_microbatches=(4,), contributions=False, share=1.5)


def test_a_node_without_a_split_makes_its_block_unrecorded():
    nodes = [Node(name="x", op="input", kind="input"), Node(name="a", op="mm", inputs=("x",), bwd_flops=10),
             Node(name="b", op="relu", inputs=("a",), bwd_flops=2, bwd_input_flops=2)]
    graph = Graph(name="g", source="t", nodes=nodes)
    block = Block(index=0, name="b0", node_names=("a", "b"), module_paths=(), param_names=(), fwd_flops=0,
                  bwd_flops=12, param_count=0, param_bytes=0, saved_act_bytes=0, out_bytes=0, boundary_nodes=())
    assert input_grad_flops([graph.node(n) for n in block.node_names]) is None
    with pytest.raises(InvalidInputError):
        Node(name="c", op="mm", bwd_flops=4, bwd_input_flops=5)


def test_onnx_splits_by_operand():
    # MatMul of an activation by a weight, both needing a gradient: one forward's worth is the activation's
    assert onnx_bwd_flops("MatMul", 100, grad_inputs=[True, True]) == 200
    assert onnx_bwd_input_flops("MatMul", 100, grad_inputs=[True, True], weight_inputs=[False, True]) == 100
    assert onnx_bwd_input_flops("MatMul", 100, grad_inputs=[True, True], weight_inputs=[False, False]) == 200
    assert onnx_bwd_input_flops("Gemm", 100, grad_inputs=[False, True, True], weight_inputs=[False, True, True]) == 0
    assert onnx_bwd_input_flops("Relu", 100, grad_inputs=[True], weight_inputs=[False]) == 100
    assert onnx_bwd_input_flops("Add", 100, grad_inputs=[True, True], weight_inputs=[True, True]) == 0
