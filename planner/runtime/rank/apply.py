"""``apply_plan``: a rank's stage of a plan, built from the user's own model (the Python API)."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from models.hf import adapt_if_hf
from planner.errors import InvalidInputError
from planner.meta_twin import on_meta
from planner.plan import Plan
from planner.runtime.data import plan_example_inputs
from planner.runtime.options import is_factory_spec
from planner.runtime.rank.recompute import build_plan_stage
from planner.runtime.rank.stage import (
    StageRuntime,
    check_fingerprint,
    export_model,
    has_constants,
    plan_node_names,
    split_graph,
)


def apply_plan(model: nn.Module, plan: "Plan", rank: int, *,
               example_inputs: Sequence[torch.Tensor] | None = None,
               check: bool = True) -> StageRuntime:
    """Build ``rank``'s stage of ``plan`` from the full ``model`` (parameters shared, names kept).

    ``example_inputs`` are one microbatch of model inputs; by default they are
    made from the plan (the synthetic batch of its model spec). The plan's
    fingerprint is checked against a fresh trace first (``check=False`` skips
    it when the caller has just done so). A transformers model is adapted in place, as
    :func:`planner.make_plan` adapts it; the graph is exported on meta copies of the weights
    and the stage binds the model's own (real or meta) tensors.
    """
    if not 0 <= rank < len(plan.ranks):
        raise InvalidInputError("rank", expected=f"0..{len(plan.ranks) - 1}", found=str(rank))
    info = plan.ranks[rank]
    if info.stage is None:
        raise InvalidInputError(f"rank {rank} runs no stage (it is a verifier-only rank)",
                                fix="call apply_plan only on stage ranks")
    if example_inputs is None:
        if is_factory_spec(plan.model.spec):  # a plan file never makes this process import code
            raise InvalidInputError(f"apply_plan: the plan's model {plan.model.spec!r} is not a preset or an hf: "
                                    "config", fix="pass example_inputs= (one microbatch of the model's inputs)")
        example_inputs = plan_example_inputs(plan)
    example_inputs = tuple(example_inputs)
    adapt_if_hf(model)
    with on_meta(model, example_inputs) as meta_inputs:  # the graph the plan was traced from (planner.meta_twin)
        ep = export_model(model, meta_inputs)
        if check:  # before anything else: a plan for another model must not get further
            same_batch = example_inputs[0].shape[0] == plan.model.batch
            check_fingerprint(ep if same_batch else export_model(model, _at_batch(meta_inputs, plan.model.batch)),
                              plan)
        split = split_graph(model, meta_inputs, plan_node_names(plan), ep=ep)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if has_constants(split) and device.type != "meta":  # constants' data: only a real export holds it (as on a rank)
        split = split_graph(model, example_inputs, plan_node_names(plan))
    return build_plan_stage(split, plan, info.stage, model, device=device)


def _at_batch(inputs: Sequence[torch.Tensor], batch: int) -> tuple[torch.Tensor, ...]:
    """Placeholder inputs of another batch size (export reads shapes and dtypes only)."""
    return tuple(torch.zeros((batch, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in inputs)
