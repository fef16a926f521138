"""Whether a stage's forward draws random numbers (``planner.runtime.rank.audits``): a recompute of such a stage
draws others, so an audit would fail an honest replica."""
from __future__ import annotations

import torch

RANDOM_OPS = frozenset({"bernoulli", "rand", "randn", "randint", "randperm", "rand_like", "randn_like",
                        "randint_like", "normal", "uniform", "multinomial", "poisson", "exponential", "geometric",
                        "cauchy", "log_normal", "random"})
DROPOUT_OPS = frozenset({"dropout", "native_dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout"})


def random_op(module: torch.nn.Module) -> str | None:
    """The first op of ``module``'s graph that draws random numbers (a dropout of p > 0 in training, a sampler,
    an attention with dropout), or None: an audit recomputes a stage only where its forward is a function."""
    for node in getattr(getattr(module, "graph", None), "nodes", ()):
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is None:
            continue
        name = schema.name.split("::")[-1].rstrip("_")
        if name in RANDOM_OPS:
            return name
        if name in DROPOUT_OPS and float(node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)) > 0 \
                and bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)):
            return name
        if "scaled_dot_product" in name and float(node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4
                                                                   else 0.0)) > 0:
            return name
    return None
