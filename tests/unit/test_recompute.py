"""Activation recomputation: priced (a second forward, only block inputs saved), chosen per stage where
memory binds, compiled into the plan, simulated as priced, and executed by checkpointing each block."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cost_models import memory
from cost_models.training import TrainingConfig
from planner.api import plan_chain
from planner.errors import InfeasiblePlanError, InvalidInputError
from planner.runtime.rank.recompute import Checkpointed, build_plan_stage
from planner.runtime.rank.stage import (
    build_stage,
    export_model,
    plan_node_names,
    split_graph,
)
from planner.simulate import simulate
from planner.solver.policy import VerificationPolicy
from planner.solver.problem import bound_problem, recompute_problem
from planner.solver.problem_build import build_problem
from planner.solver.recompute import variants
from tests.dist.plans import make_plan
from tests.unit.solver_fixtures import random_chain
from tests.unit.test_solver_explain import cluster, host

torch.set_num_threads(1)
CONFIG = TrainingConfig(global_batch=8, microbatch_size=1)


def _tight_chain():
    """8 uniform blocks: 25.6 GB of Adam state and 3 GB of activations per block and microbatch."""
    return random_chain(np.random.default_rng(0), 8, param_scale=2e8, act_scale=3e9, out_scale=2e7, uniform=True)


def _four_t4s():
    return cluster(host("a", "T4", 2), host("b", "T4", 2))


def test_recompute_tables_add_a_forward_and_keep_block_inputs():
    base = build_problem(_tight_chain(), _four_t4s(), CONFIG, VerificationPolicy())
    rc = recompute_problem(base)
    fwd = base.time_ms - base.bwd_ms
    np.testing.assert_allclose(rc.time_ms, base.time_ms + fwd)
    np.testing.assert_allclose(rc.bwd_ms, base.bwd_ms + fwd)
    assert list(rc.act_bytes) == [base.input_bytes, *base.out_bytes_int[:-1]]
    peak = int(base.act_bytes.max())  # the recomputing block's activations, set aside on every device
    assert all(r.mem_bytes == b.mem_bytes - peak for r, b in zip(rc.classes, base.classes))
    assert rc.tables(False) is base and rc.tables(None) is rc and rc.tables(True) is rc
    relaxed = bound_problem(rc)  # base times and memory, recompute's activations: below both
    assert (relaxed.time_ms == base.time_ms).all() and (relaxed.act_bytes == rc.act_bytes).all()
    assert relaxed.classes == base.classes


def test_memory_model_of_a_recomputing_stage():
    chain = _tight_chain()
    plain = memory.stage_memory(chain, 2, 4, CONFIG, 3)
    rc = memory.stage_memory(chain, 2, 4, CONFIG, 3, recompute=True)
    inputs = sum(b.out_bytes for b in chain.blocks[1:4])
    assert rc.activations_bytes == 3 * inputs + max(b.saved_act_bytes for b in chain.blocks[2:5])
    assert plain.activations_bytes == 3 * sum(b.saved_act_bytes for b in chain.blocks[2:5])
    assert rc.static_bytes == plain.static_bytes


def test_auto_recomputes_only_the_stages_whose_memory_binds():
    chain, cl = _tight_chain(), _four_t4s()
    with pytest.raises(InfeasiblePlanError, match="no placement fits in memory"):
        plan_chain(chain, cl, spec="t:c", global_batch=8, microbatch_size=1, time_limit_s=3, workers=1,
                   dtype="fp32", recompute="never")
    plan = plan_chain(chain, cl, spec="t:c", global_batch=8, microbatch_size=1, time_limit_s=3, workers=1,
                      dtype="fp32")
    flags = [st.recompute for st in plan.stages]
    assert any(flags) and not all(flags)  # 1F1B's last stage holds one microbatch: it fits without
    sim = simulate(plan)
    assert abs(plan.report.objective_ms - sim.step_ms) <= 0.05 * sim.step_ms
    usable = memory.usable_memory_bytes(cl.device(plan.ranks[0].device).spec)
    assert max(sim.peak_mem_bytes) <= usable
    assert plan.report.bound_ms <= plan.report.objective_ms


def test_auto_searches_without_recomputation_first():
    loose = random_chain(np.random.default_rng(0), 8, param_scale=1e6, act_scale=1e6, out_scale=1e5, uniform=True)
    base = build_problem(loose, _four_t4s(), CONFIG, VerificationPolicy())
    assert [p.recompute for p in variants(base, "auto")] == [False]
    assert [p.recompute for p in variants(base, "never")] == [False]
    assert [p.recompute for p in variants(base, "always")] == [True]
    with pytest.raises(InvalidInputError, match="recompute mode"):
        variants(base, "sometimes")


def _saved_bytes(module, inputs) -> tuple[int, list[torch.Tensor]]:
    """Bytes autograd saves for backward in one forward, and the parameters' gradients after it."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        out = module(*inputs)
    sum(o.float().sum() for o in out if o.is_floating_point()).backward()
    grads = [p.grad.clone() for _, p in module.named_parameters()]
    return sum(saved), grads


def test_a_recomputing_stage_saves_less_and_computes_the_same_gradients():
    from models.registry import build_model

    plan = make_plan("gpt-tiny", microbatch=2, num_microbatches=2, seq=16, stages=[(0, 3), (4, 5)],
                     recompute=(0,))
    bundle = build_model("gpt-tiny", batch=2, seq=16, device="cpu", seed=0)
    model, inputs = bundle.module, bundle.example_inputs
    split = split_graph(model, inputs, plan_node_names(plan), ep=export_model(model, inputs))
    plain = build_stage(split, 0, model)
    ckpt = build_plan_stage(split, plan, 0, model, device="cpu")
    assert isinstance(ckpt.module, Checkpointed)
    assert [n for n, _ in ckpt.parameters()] == [n for n, _ in plain.parameters()]
    plain_bytes, plain_grads = _saved_bytes(plain.module, inputs)
    model.zero_grad(set_to_none=True)
    ckpt_bytes, ckpt_grads = _saved_bytes(ckpt.module, inputs)
    assert ckpt_bytes < plain_bytes / 3, (ckpt_bytes, plain_bytes)
    for a, b in zip(ckpt_grads, plain_grads):
        torch.testing.assert_close(a, b)
    assert not isinstance(build_plan_stage(split, plan, 1, model, device="cpu").module, Checkpointed)
