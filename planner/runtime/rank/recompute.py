"""A stage that recomputes: each of its blocks runs under ``torch.utils.checkpoint``.

The stage's graph is cut again at the plan's block boundaries (the same cut rules as stages, so a
value that skips a block passes through it); a microbatch in flight then keeps only each block's
inputs, and each block's forward runs again when its backward needs the activations. Parameters
stay the model's own tensors: the stage's names, gradients and optimizer are unchanged.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from planner.errors import InvalidInputError
from planner.plan import Plan
from planner.runtime.rank.stage import INPUT_STAGE, SplitGraph, StageRuntime, build_stage


@dataclasses.dataclass(frozen=True, slots=True)
class _Part:
    module: nn.Module
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


class Checkpointed(nn.Module):
    """Runs a stage's blocks in order, each checkpointed; holds the stage's own module for its state."""

    def __init__(self, stage: StageRuntime, parts: Sequence[_Part]) -> None:
        super().__init__()
        self.whole = stage.module  # registered: parameters() and buffers() of the stage, by their names
        self._parts = tuple(parts)  # the blocks share the same tensors (not registered twice)
        self._inputs = tuple(s.name for s in stage.inputs)
        self._outputs = tuple(s.name for s in stage.outputs)

    def named_parameters(self, *args, **kwargs):  # the model's own names, as the plain stage has them
        return self.whole.named_parameters(*args, **kwargs)

    def named_buffers(self, *args, **kwargs):
        return self.whole.named_buffers(*args, **kwargs)

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        env = dict(zip(self._inputs, inputs))
        for part in self._parts:
            outs = checkpoint(part.module, *(env[n] for n in part.inputs), use_reentrant=False)
            env.update(zip(part.outputs, outs))
        return tuple(env[n] for n in self._outputs)


def checkpointed_stage(split: SplitGraph, stage: StageRuntime, block_nodes: Sequence[Sequence[str]],
                       blocks: range, model: nn.Module, *, device: torch.device) -> StageRuntime:
    """``stage`` running its ``blocks`` (indices into ``block_nodes``, every block's node names) checkpointed."""
    mutated = set(split.ep.graph_signature.buffers_to_mutate.values())
    used = {name for name, _ in stage.module.named_buffers()}
    if mutated & used:
        raise InvalidInputError(f"stage {stage.index} recomputes but updates buffers in its forward "
                                f"({sorted(mutated & used)[0]})", expected="a stage without running statistics",
                                found="BatchNorm-like buffers, which a second forward would update twice",
                                fix="plan with --recompute never")
    block_of = {n: b for b, names in enumerate(block_nodes) for n in names}
    by_block = dataclasses.replace(
        split, num_stages=len(block_nodes),
        stage_of={n: k if k == INPUT_STAGE else block_of[n] for n, k in split.stage_of.items()})
    parts = []
    for b in blocks:
        part = build_stage(by_block, b, model, device=device)
        parts.append(_Part(module=part.module, inputs=tuple(s.name for s in part.inputs),
                           outputs=tuple(s.name for s in part.outputs)))
    return dataclasses.replace(stage, module=Checkpointed(stage, parts))


def build_plan_stage(split: SplitGraph, plan: Plan, k: int, model: nn.Module, *,
                     device: torch.device | str) -> StageRuntime:
    """Stage ``k`` of ``plan``, its blocks checkpointed when the plan says it recomputes."""
    device = torch.device(device)
    stage = build_stage(split, k, model, device=device)
    info = plan.stages[k]
    if not info.recompute:
        return stage
    block_nodes = [b.node_names for st in plan.stages for b in st.blocks]
    return checkpointed_stage(split, stage, block_nodes, range(info.first_block, info.last_block + 1), model,
                              device=device)
