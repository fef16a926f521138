"""Splitting an exported model into stage modules (planner.runtime.rank.stage), in one process."""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from models.registry import build_model
from planner.errors import PlanMismatchError
from planner.runtime.rank.stage import (
    build_stage,
    export_model,
    materialize,
    split_graph,
    stage_edges,
    stage_state_names,
)

torch.set_num_threads(1)


@functools.lru_cache(maxsize=None)
def _chain(spec: str, batch: int, seq: int | None):
    from planner.coarsen import coarsen
    from planner.trace import trace

    bundle = build_model(spec, batch=batch, seq=seq, device="meta")
    return coarsen(trace(bundle.module, bundle.example_inputs, name=spec))


def _stage_names(chain, ranges):
    return [tuple(n for b in chain.blocks[lo:hi + 1] for n in b.node_names) for lo, hi in ranges]


def _run_stages(stages, inputs):
    values = tuple(inputs)
    for st in stages:
        values = st.module(*values)
    return values


@pytest.mark.parametrize("spec,seq,ranges", [
    ("gpt-tiny", 16, [(0, 1), (2, 4), (5, 5)]),
    ("llama-tiny", 16, [(0, 0), (1, 5)]),
    ("cnn-tiny", None, [(0, 2), (3, 4)]),
])
def test_stages_compose_to_the_model_with_original_names(spec, seq, ranges):
    chain = _chain(spec, 2, seq)
    if ranges[-1][1] != len(chain.blocks) - 1:
        ranges = ranges[:-1] + [(ranges[-1][0], len(chain.blocks) - 1)]
    bundle = build_model(spec, batch=2, seq=seq, device="cpu", seed=3)
    model = bundle.module
    split = split_graph(model, bundle.example_inputs, _stage_names(chain, ranges))
    stages = [build_stage(split, k, model) for k in range(len(ranges))]
    out = _run_stages(stages, bundle.example_inputs)
    ref = model(*bundle.example_inputs)
    torch.testing.assert_close(out[0], ref, rtol=0, atol=0)
    # every parameter lives in exactly one stage, under its own name, as the model's own tensor
    own = dict(model.named_parameters())
    names = [n for st in stages for n, _ in st.parameters()]
    assert sorted(names) == sorted(own)
    for st in stages:
        for n, p in st.parameters():
            assert p is own[n]


def test_gradients_through_stages_equal_the_model():
    spec, seq = "gpt-tiny", 16
    chain = _chain(spec, 2, seq)
    bundle = build_model(spec, batch=2, seq=seq, device="cpu", seed=1)
    model = bundle.module
    split = split_graph(model, bundle.example_inputs, _stage_names(chain, [(0, 2), (3, 5)]))
    s0, s1 = build_stage(split, 0, model), build_stage(split, 1, model)
    (h,) = s0.module(*bundle.example_inputs)
    h_in = h.detach().requires_grad_(s1.inputs[0].carries_grad)
    (logits,) = s1.module(h_in)
    logits.square().mean().backward()
    h.backward(h_in.grad)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model(*bundle.example_inputs).square().mean().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad)
    assert s0.inputs[0].carries_grad is False and s1.inputs[0].carries_grad is True


class _Skip(nn.Module):
    """A value from the first layer is read again by the last one (it must pass through the middle)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.c(self.b(h).relu() + h)


def test_value_skipping_a_stage_is_passed_through():
    torch.manual_seed(0)
    model, x = _Skip(), torch.randn(3, 4)
    ep = export_model(model, (x,))
    calls = [n.name for n in ep.graph.nodes if n.op == "call_function"]
    b_first = calls.index(next(n for n in calls if n.startswith("linear_1")))
    names = [calls[:b_first], calls[b_first:b_first + 2], calls[b_first + 2:]]
    split = split_graph(model, (x,), names, ep=ep)
    ins1, outs1 = stage_edges(split, 1)
    assert len(ins1) == 1 and len(outs1) == 2 and ins1[0] in outs1  # h goes through stage 1
    stages = [build_stage(split, k, model) for k in range(3)]
    torch.testing.assert_close(_run_stages(stages, (x,))[0], model(x), rtol=0, atol=0)


def test_plan_naming_unknown_or_missing_nodes_is_refused():
    bundle = build_model("mlp-tiny", batch=2, device="cpu")
    ep = export_model(bundle.module, bundle.example_inputs)
    calls = [n.name for n in ep.graph.nodes if n.op == "call_function"]
    with pytest.raises(PlanMismatchError, match="no stage of the plan lists"):
        split_graph(bundle.module, bundle.example_inputs, [calls[:-1]], ep=ep)
    with pytest.raises(PlanMismatchError, match="lacks"):
        split_graph(bundle.module, bundle.example_inputs, [calls + ["not_a_node"]], ep=ep)
    with pytest.raises(PlanMismatchError, match="later stage"):
        split_graph(bundle.module, bundle.example_inputs, [calls[3:], calls[:3]], ep=ep)


def test_meta_export_and_partial_materialisation_match_the_full_model():
    spec, seq = "llama-tiny", 16
    chain = _chain(spec, 2, seq)
    names = _stage_names(chain, [(0, 2), (3, len(chain.blocks) - 1)])
    meta = build_model(spec, batch=2, seq=seq, device="meta", seed=5)
    split = split_graph(meta.module, meta.example_inputs, names)
    materialize(meta.module, stage_state_names(split, 1), "cpu")
    meta.module.init_weights(5)
    stage = build_stage(split, 1, meta.module, device="cpu")
    assert all(p.device.type == "cpu" for _, p in stage.parameters())
    assert any(p.device.type == "meta" for p in meta.module.parameters())  # stage 0 never allocated
    full = build_model(spec, batch=2, seq=seq, device="cpu", seed=5)
    own = dict(full.module.named_parameters())
    for n, p in stage.parameters():
        torch.testing.assert_close(p, own[n], rtol=0, atol=0)
    s0 = build_stage(split_graph(full.module, full.example_inputs, names), 0, full.module)
    (h,) = s0.module(*full.example_inputs)
    torch.testing.assert_close(stage.module(h)[0], full.module(*full.example_inputs), rtol=0, atol=0)


def test_apply_plan_builds_the_ranks_stage_and_refuses_another_model():
    from models.mlp import MLP, MLPConfig
    from planner.runtime.rank.apply import apply_plan
    from tests.dist.plans import make_plan

    plan = make_plan("mlp-tiny", microbatch=2, num_microbatches=2, stages=[(0, 2), (3, 5)])
    model = build_model("mlp-tiny", batch=2, device="cpu", seed=0).module
    stage = apply_plan(model, plan, 1)
    assert stage.index == 1 and stage.is_last
    assert {n for n, _ in stage.parameters()} == set(plan.stages[1].param_names)
    wider = MLP(MLPConfig(d_in=32, d_model=64, d_ff=96, n_layers=4, n_classes=10))
    with pytest.raises(PlanMismatchError, match="does not match"):
        apply_plan(wider, plan, 0)
