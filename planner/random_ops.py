"""Which ops draw random numbers: one definition for the planner and the runtime.

A stage whose forward draws random numbers (a dropout of p > 0 in training, a sampler, an attention with
dropout) cannot be audited: the auditor's recompute would draw other numbers than the replica and fail it.
``planner.trace`` marks such nodes (``ir.Node.random_op``), so the solver audits none of their stages;
``planner.runtime.rank.random_ops`` finds them in a stage's fx graph and stops its audits at step 0.

Pure: op names (aten schema names such as ``aten::dropout``, torch.export's ``aten.dropout.default``, torch.fx
method or function names, ONNX op types) and argument values, no torch import.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# Draw whatever their arguments (aten names, trailing ``_`` of in-place forms dropped).
SAMPLERS = frozenset({"bernoulli", "rand", "randn", "randint", "randperm", "rand_like", "randn_like",
                      "randint_like", "normal", "uniform", "multinomial", "poisson", "exponential", "geometric",
                      "cauchy", "log_normal", "random"})
# Draw where ``p`` > 0 and in training.
DROPOUTS = frozenset({"dropout", "native_dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout",
                      "dropout1d", "dropout2d", "dropout3d"})
# Draw only where called with ``training`` true (their default is false).
NOISY_ACTIVATIONS = frozenset({"rrelu", "rrelu_with_noise"})
# ONNX op types that always draw; ONNX ``Dropout`` draws only with ``training_mode`` true.
ONNX_SAMPLERS = frozenset({"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli",
                           "Multinomial"})
ONNX_DROPOUT = "Dropout"


def base_name(op: str) -> str:
    """``aten::dropout``, ``aten.dropout.default``, ``bernoulli_`` or ``torch.nn.functional.dropout`` ->
    ``dropout`` / ``bernoulli``: the name :data:`SAMPLERS` and :data:`DROPOUTS` list."""
    name = op.rsplit("::", 1)[-1]
    parts = name.split(".")
    if parts[0] in ("aten", "prims") and len(parts) > 1:
        name = parts[1]   # aten.<op>.<overload>
    else:
        name = parts[-1]
    return name.rstrip("_")


def _positive(value: Any) -> bool:
    """A probability argument above zero; one that is not a number here (a traced value) may be: it counts."""
    try:
        return float(value) > 0
    except (TypeError, ValueError):
        return value is not None   # not a number we can read (a traced value): it may draw


def random_op(op: str, arguments: Mapping[str, Any] | None = None) -> str | None:
    """The base name of ``op`` where it draws random numbers called with ``arguments`` (by parameter name: a
    dropout's ``p`` and ``train`` / ``training``, an attention's ``dropout_p``; absent ones take the torch
    defaults), else None. A ``train`` of None (``native_dropout``'s default) draws, as torch does."""
    args = arguments or {}
    if op in ONNX_SAMPLERS:
        return op
    if op == ONNX_DROPOUT:
        return op if args.get("training_mode") is True and _positive(args.get("ratio", 0.5)) else None
    name = base_name(op)
    if name in SAMPLERS:
        return name
    if name in DROPOUTS:
        train = args.get("train", args.get("training", True))
        return name if train is not False and _positive(args.get("p", 0.5)) else None
    if name in NOISY_ACTIVATIONS:
        return name if args.get("training") is True else None
    if "scaled_dot_product" in name:
        return name if _positive(args.get("dropout_p", 0.0)) else None
    return None


def bind(names: Sequence[str], args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Positional ``args`` and ``kwargs`` of a call, by the parameter ``names`` of its schema."""
    return {**dict(zip(names, args)), **kwargs}


def node_random_op(node: Any) -> str | None:
    """:func:`random_op` of an fx ``call_function`` node of an aten op (torch.export's graphs, a stage's
    module), its arguments bound by the op's schema; None for any other node."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None:
        return None
    names = [a.name for a in schema.arguments]
    return random_op(schema.name, bind(names, node.args, node.kwargs))
