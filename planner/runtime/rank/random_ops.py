"""Whether a stage's forward draws random numbers (``planner.runtime.rank.audits``): a recompute of such a stage
draws others, so an audit would fail an honest replica. What counts is ``planner.random_ops``, the definition the
planner marks traced nodes by too."""
from __future__ import annotations

import torch

from planner.random_ops import node_random_op


def random_op(module: torch.nn.Module) -> str | None:
    """The first op of ``module``'s graph that draws random numbers (a dropout of p > 0 in training, a sampler,
    an attention with dropout), or None: an audit recomputes a stage only where its forward is a function."""
    for node in getattr(getattr(module, "graph", None), "nodes", ()):
        found = node_random_op(node)
        if found is not None:
            return found
    return None
