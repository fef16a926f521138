"""Ops that draw random numbers (issue 37 leftover): one definition (``planner.random_ops``) the trace marks blocks
by, the runtime finds in a stage's graph, and the solver audits no such stage by."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

from models.registry import build_model
from planner.coarsen import chain_from_dict, chain_to_dict, coarsen
from planner.errors import InvalidInputError
from planner.plan import Plan
from planner.random_ops import base_name, node_random_op, random_op
from planner.runtime.rank.random_ops import random_op as stage_random_op
from planner.simulate_audits import audit_site as sim_audit_site
from planner.simulate_audits import audited_stages
from planner.solver.audit_price import audit_site, audit_where
from planner.solver.audits import audit_notes, choose_audits, with_audits
from planner.solver.objective import price_program
from planner.trace import trace
from tests.dist.plans import make_plan
from tests.unit.audit_fixtures import watched
from tests.unit.plan_fixtures import golden_plan

torch.set_num_threads(1)


@pytest.mark.parametrize("op, arguments, found", [
    ("aten::dropout", {"p": 0.1, "train": True}, "dropout"),
    ("aten.dropout.default", {"p": 0.0, "train": True}, None),
    ("aten.dropout.default", {"p": 0.1, "train": False}, None),
    ("aten::native_dropout", {"p": 0.1, "train": None}, "native_dropout"),   # torch draws for train=None
    ("dropout", {"p": 0.5, "training": False}, None),                        # F.dropout's spelling
    ("dropout", {}, "dropout"),                                              # F.dropout's defaults: p 0.5, training
    ("aten.bernoulli_.float", {}, "bernoulli"),
    ("aten::rand", {}, "rand"),
    ("_VariableFunctionsClass.randn", {}, "randn"),
    ("uniform_", {}, "uniform"),
    ("aten::scaled_dot_product_attention", {"dropout_p": 0.1}, "scaled_dot_product_attention"),
    ("aten::scaled_dot_product_attention", {}, None),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", {"dropout_p": 0.2},
     "_scaled_dot_product_flash_attention_for_cpu"),
    ("aten::rrelu", {"training": True}, "rrelu"),
    ("aten::rrelu", {}, None),
    ("aten.linear.default", {}, None),
    ("normalize", {}, None),
    ("RandomNormal", {}, "RandomNormal"),
    ("Dropout", {"training_mode": True, "ratio": 0.1}, "Dropout"),
    ("Dropout", {}, None),                                                   # ONNX: inference unless told
])
def test_the_one_definition_of_an_op_that_draws_random_numbers(op, arguments, found):
    assert random_op(op, arguments) == found


def test_op_names_reduce_to_the_aten_base_name():
    assert [base_name(n) for n in ("aten::dropout", "aten.native_dropout.default", "bernoulli_",
                                   "torch.nn.functional.dropout")] == ["dropout", "native_dropout", "bernoulli",
                                                                       "dropout"]


class _Net(nn.Module):
    """Two numbered layers, the second with a dropout of ``p``: blocks ``layers.0`` and ``layers.1``."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ReLU()),
                                     nn.Sequential(nn.Linear(8, 8), nn.Dropout(p))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _block_ops(model: nn.Module) -> dict[str, tuple[str, ...]]:
    return {b.name: b.random_ops for b in coarsen(trace(model, torch.randn(2, 8), name="net")).blocks}


@pytest.mark.parametrize("p, training, second", [(0.1, True, ("dropout",)), (0.0, True, ()), (0.1, False, ())])
def test_the_trace_marks_the_block_whose_dropout_draws(p, training, second):
    assert _block_ops(_Net(p).train(training)) == {"layers.0": (), "layers.1": second}


def test_the_fx_fallback_marks_the_same_block(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("export unavailable in this test")

    monkeypatch.setattr(torch.export, "export", refuse)
    assert _block_ops(_Net(0.1).train()) == {"layers.0": (), "layers.1": ("dropout",)}
    assert _block_ops(_Net(0.1).eval()) == {"layers.0": (), "layers.1": ()}


def test_the_trace_and_the_runtime_find_the_same_op_in_one_graph():
    model = _Net(0.1).train()
    exported = torch.export.export(model, (torch.randn(2, 8),), strict=False)
    marked = [node_random_op(n) for n in exported.graph.nodes if node_random_op(n)]
    assert marked == ["dropout"] and stage_random_op(exported.module()) == "dropout"


def test_hf_gpt2_with_dropout_marks_its_layers_and_without_marks_none():
    pytest.importorskip("transformers")
    ops = {}
    for pdrop in (0.1, 0.0):
        spec = (f"hf:gpt2?n_layer=2,n_embd=32,n_head=2,vocab_size=64,n_positions=16,attn_pdrop={pdrop},"
                f"resid_pdrop={pdrop},embd_pdrop={pdrop}")
        bundle = build_model(spec, batch=1, seq=8, device="meta")
        ops[pdrop] = {b.name: b.random_ops for b in coarsen(trace(bundle.module, bundle.example_inputs)).blocks}
    assert set(ops[0.1]["transformer.h.0"]) == {"dropout", "scaled_dot_product_attention"}
    assert ops[0.1]["transformer.h.1"] == ops[0.1]["transformer.h.0"]
    assert not any(ops[0.0].values())


def test_the_chain_json_keeps_the_marks_and_reads_old_chains_as_none_known():
    ch = coarsen(trace(_Net(0.1).train(), torch.randn(2, 8), name="net"))
    data = json.loads(json.dumps(chain_to_dict(ch)))
    assert chain_from_dict(data) == ch and data["blocks"][1]["random_ops"] == ["dropout"]
    for b in data["blocks"]:
        del b["random_ops"]   # a chain written before the field
    assert all(b.random_ops == () for b in chain_from_dict(data).blocks)
    with pytest.raises(InvalidInputError, match="random_ops"):
        dataclasses.replace(ch.blocks[0], random_ops=("",))
    for bad in ("dropout", [None], [""]):   # a string is not a list of one name; nor is None a name
        data["blocks"][1]["random_ops"] = bad
        with pytest.raises(InvalidInputError, match="random_ops"):
            chain_from_dict(data)


def test_plans_carry_the_marks_and_old_plans_load_as_none_known():
    old = golden_plan()
    data = old.to_dict()
    for st in data["stages"]:
        for b in st["blocks"]:
            del b["random_ops"]   # as every plan written before the field
    assert Plan.from_dict(json.loads(json.dumps(data))) == old
    assert all(b.random_ops == () for st in old.stages for b in st.blocks)
    data = old.to_dict()
    data["stages"][1]["blocks"][0]["random_ops"] = ["dropout"]
    marked = Plan.from_dict(json.loads(json.dumps(data)))   # the shipped schema accepts the field
    assert marked.stages[1].blocks[0].random_ops == ("dropout",)
    assert marked.chain().blocks[marked.stages[1].first_block].random_ops == ("dropout",)  # what a replan solves


def test_the_solver_audits_no_stage_that_draws_random_numbers_and_says_why():
    plain, placement = watched(None)
    assert [st.audit_every for st in choose_audits(plain, placement).stages] == [0, 4, 0]   # the control
    problem, placement = watched(2)
    assert audit_site(problem, placement.stages, placement.verifiers, 1) is None
    assert "draws random numbers (dropout)" in audit_where(problem, placement.stages, placement.verifiers, 1)
    chosen = choose_audits(problem, placement)
    assert [st.audit_every for st in chosen.stages] == [0, 0, 0]
    notes = audit_notes(problem, chosen)
    assert notes == (("stage 1: replicas not audited: it draws random numbers (dropout): an audit's recompute "
                     "would draw others and fail an honest replica"),)
    # nor is it priced: a plan that asks for its audits anyway pays nothing for them (the runtime stops them)
    assert price_program(problem, with_audits(placement, {1: 4})).step_ms == \
        price_program(problem, with_audits(placement, {})).step_ms


def test_a_plan_whose_stage_draws_random_numbers_is_neither_audited_nor_priced_so_in_a_rehearsal():
    plan = make_plan("mlp-tiny", microbatch=2, num_microbatches=8, stages=[(0, 1), (2, 3), (4, 5)],
                     replicas={1: (4, 4)}, untrusted=(1, 2), verifiers=[(0, 0, ("act", "grad")), (1, 0, ("act", "grad"))])
    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, audit_every=4 if s.index == 1 else 0)
                                                  for s in plan.stages))
    assert set(audited_stages(plan)) == {1}   # the control
    st = plan.stages[1]
    marked = dataclasses.replace(st, blocks=(dataclasses.replace(st.blocks[0], random_ops=("dropout",)),
                                             *st.blocks[1:]))
    plan = dataclasses.replace(plan, stages=(plan.stages[0], marked, plan.stages[2]))
    assert audited_stages(plan) == {} and "draws random numbers (dropout)" in sim_audit_site(plan, 1)
