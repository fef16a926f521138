"""Coarsening graphs into block chains: cut points, unit names, totals, skips, ties, JSON."""
from __future__ import annotations

import json

import pytest
import torch

from models.gpt import GPT, GPTConfig
from models.registry import build_model
from planner.coarsen import chain_from_dict, chain_to_dict, coarsen, module_units
from planner.errors import InvalidInputError
from planner.ir import Graph, Node, ParamInfo, TensorMeta
from planner.trace import trace
from tests.fixtures.trace_models import SkipNet


def _gpt_graph(n_layers: int = 12, *, tie: bool = False, batch: int = 2, seq: int = 16) -> Graph:
    cfg = GPTConfig(vocab_size=64, max_seq=seq, n_layers=n_layers, d_model=32, n_heads=2, tie_weights=tie)
    with torch.device("meta"):
        model = GPT(cfg)
    return trace(model, torch.zeros(batch, seq, dtype=torch.long, device="meta"), name=f"gpt{n_layers}")


@pytest.fixture(scope="module")
def gpt12() -> Graph:
    return _gpt_graph(12)


def _assert_sums_match(graph: Graph, chain) -> None:
    assert chain.fwd_flops == graph.fwd_flops and chain.bwd_flops == graph.bwd_flops
    assert chain.param_count == graph.param_count and chain.param_bytes == graph.param_bytes
    assert [n for b in chain.blocks for n in b.node_names] == list(graph.order)  # a partition, in order


def test_twelve_layer_gpt_gives_embed_layers_head(gpt12):
    chain = coarsen(gpt12)
    assert [b.name for b in chain.blocks] == ["embed", *(f"layers.{i}" for i in range(12)), "head"]
    _assert_sums_match(gpt12, chain)
    residual = 2 * 16 * 32 * 4  # [B, T, d] float32
    assert all(b.out_bytes == residual and len(b.boundary_nodes) == 1 for b in chain.blocks[:-1])
    assert chain.blocks[-1].out_bytes == 2 * 16 * 64 * 4  # the logits
    assert chain.input_bytes == 2 * 16 * 8 and chain.microbatch_size == 2
    layer = chain.blocks[1]
    assert layer.param_count == 4 * 32 * 32 + 2 * 4 * 32 * 32 + 3 * 32 + 32 + 4 * 32 + 32 + 4 * 32
    assert all(p.startswith("layers.0.") for p in layer.param_names)
    assert layer.saved_act_bytes > 4 * residual and layer.mem_traffic_bytes > layer.saved_act_bytes
    assert len({(b.fwd_flops, b.param_count, b.out_bytes) for b in chain.blocks[1:-1]}) == 1


def test_fine_cuts_are_a_superset_of_layer_cuts(gpt12):
    fine, layer = coarsen(gpt12, granularity="fine"), coarsen(gpt12, granularity="layer")
    _assert_sums_match(gpt12, fine)
    fine_edges = {b.node_names[-1] for b in fine.blocks}
    assert {b.node_names[-1] for b in layer.blocks} <= fine_edges
    assert len(fine) > len(layer)
    assert len({b.name for b in fine.blocks}) == len(fine)  # names stay unique
    assert dict(fine.meta)["granularity"] == "fine"


def test_skip_connection_across_layers_is_never_cut():
    graph = trace(SkipNet(), torch.zeros(4, 8), name="skipnet")
    for granularity in ("layer", "fine"):
        chain = coarsen(graph, granularity=granularity)
        _assert_sums_match(graph, chain)
        inside = {p for b in chain.blocks for p in b.module_paths if p.startswith(("layers.2", "layers.3", "layers.4"))}
        owners = {b.index for b in chain.blocks if set(b.module_paths) & inside}
        assert len(owners) == 1, f"{granularity}: the skip over layers 2-4 was cut"
    names = [b.name for b in coarsen(graph).blocks]
    assert names == ["embed", "layers.0", "layers.1", "layers.2..layers.4", "layers.5", "head"]


def test_tied_embedding_is_counted_once_and_listed():
    graph = _gpt_graph(2, tie=True)
    chain = coarsen(graph)
    _assert_sums_match(graph, chain)
    (tied,) = chain.tied_params  # torch.export names the shared tensor by one of its two FQNs
    assert tied.name in {"embed.tok.weight", "head.proj.weight"} and tied.name in graph.params
    assert tied.blocks == (0, len(chain) - 1) and tied.nbytes == 64 * 32 * 4
    assert tied.name in chain.blocks[0].param_names and tied.name in chain.blocks[-1].param_names
    assert chain.blocks[-1].param_count == 2 * 32  # only the final norm is counted there


def test_llama_rotary_tables_do_not_block_cuts():
    bundle = build_model("llama-tiny", batch=1, seq=16)
    graph = trace(bundle.module, bundle.example_inputs, name="llama-tiny")
    chain = coarsen(graph)
    assert [b.name for b in chain.blocks] == ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]
    _assert_sums_match(graph, chain)
    assert dict(chain.meta)["crossing_tensors_at_cuts"] == "1"


def test_json_round_trip(gpt12):
    chain = coarsen(gpt12)
    data = json.loads(json.dumps(chain_to_dict(chain)))
    assert chain_from_dict(data) == chain
    del data["blocks"][0]["node_names"]
    with pytest.raises(InvalidInputError, match="chain_to_dict"):
        chain_from_dict(data)
    with pytest.raises(InvalidInputError, match="format_version"):
        chain_from_dict({**chain_to_dict(chain), "format_version": 99})


def test_bad_granularity(gpt12):
    with pytest.raises(InvalidInputError, match="granularity"):
        coarsen(gpt12, granularity="stage")


def test_module_units():
    units = module_units(["transformer.wte", "transformer.h.0.attn", "transformer.h.11.mlp.c_fc",
                          "transformer.ln_f", "lm_head", "transformer"])
    assert units == {"transformer.wte": "transformer.wte", "transformer.h.0.attn": "transformer.h.0",
                     "transformer.h.11.mlp.c_fc": "transformer.h.11", "transformer.ln_f": "transformer.ln_f",
                     "lm_head": "lm_head", "transformer": ""}
    # Deeper numbering (an nn.Sequential inside the stem or a layer) is not a unit of its own.
    assert module_units(["stem.conv.0", "stem", "layers.0.conv1.0", "head.proj"]) == {
        "stem.conv.0": "stem", "stem": "stem", "layers.0.conv1.0": "layers.0", "head.proj": "head"}
    assert module_units(["0", "1", "2.fc"]) == {"0": "0", "1": "1", "2.fc": "2"}


def _meta(*shape):
    return TensorMeta(shape=shape, dtype="float32")


def test_views_count_once_and_constants_do_not_count():
    """x -> a -> (a, view(a), const) -> b: one storage crosses every gap, constants are free."""
    nodes = [
        Node(name="x", op="input", kind="input", outputs=(_meta(4, 8),)),
        Node(name="a", op="mm", inputs=("x",), outputs=(_meta(4, 8),), param_names=("w",), module_path="l.0",
             fwd_flops=10),
        Node(name="const", op="arange", outputs=(_meta(8),), module_path="l.1"),
        Node(name="v", op="view", inputs=("a",), outputs=(_meta(32),), is_view=True, module_path="l.1"),
        Node(name="b", op="add", inputs=("a", "v", "const"), outputs=(_meta(4, 8),), module_path="l.1",
             fwd_flops=32),
        Node(name="out", op="output", kind="output", inputs=("b",)),
    ]
    graph = Graph(name="toy", source="test", nodes=nodes, params=[ParamInfo(name="w", meta=_meta(8, 8))])
    chain = coarsen(graph, granularity="fine")
    assert [b.node_names for b in chain.blocks] == [("x", "a"), ("const", "v", "b", "out")]
    assert chain.blocks[0].out_bytes == 4 * 8 * 4 and chain.blocks[0].boundary_nodes == ("a",)
    assert chain.blocks[1].saved_act_bytes == (8 + 32) * 4  # const and b; the view adds nothing


def test_gather_traffic_counts_the_selected_rows_not_the_table():
    """An embedding lookup reads B*T rows of its table, not all V rows (ONNX and fx spellings too)."""
    vocab, d, tokens = 1000, 16, 6
    table = ParamInfo(name="tok.weight", meta=_meta(vocab, d))
    for op in ("aten.embedding.default", "Gather", "_VariableFunctionsClass.index_select"):
        nodes = [
            Node(name="idx", op="input", kind="input", outputs=(TensorMeta(shape=(tokens,), dtype="int64"),)),
            Node(name="emb", op=op, inputs=("idx",), outputs=(_meta(tokens, d),), param_names=("tok.weight",),
                 module_path="embed"),
            Node(name="out", op="output", kind="output", inputs=("emb",)),
        ]
        chain = coarsen(Graph(name="toy", source="test", nodes=nodes, params=[table]))
        rows = tokens * d * 4
        # output written + the selected rows read + the int64 indices read
        assert chain.blocks[0].mem_traffic_bytes == rows + rows + tokens * 8, op
    # Any other op that reads the table pays for all of it.
    nodes[1] = Node(name="emb", op="aten.mm.default", inputs=("idx",), outputs=(_meta(tokens, d),),
                    param_names=("tok.weight",), module_path="embed")
    chain = coarsen(Graph(name="toy", source="test", nodes=nodes, params=[table]))
    assert chain.blocks[0].mem_traffic_bytes == rows + vocab * d * 4 + tokens * 8


def test_traced_embedding_traffic_is_its_lookups_not_its_table():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Embedding(5000, 8), torch.nn.Linear(8, 8))
    chain = coarsen(trace(model, torch.zeros(2, 4, dtype=torch.long, device="meta")), granularity="fine")
    lookup = 2 * 4 * 8 * 4  # [B, T, d] float32
    assert chain.blocks[0].mem_traffic_bytes == 2 * lookup + 2 * 4 * 8  # + the int64 indices
