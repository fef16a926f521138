"""The fallback tracer: ``torch.fx.symbolic_trace``, then each node run alone on meta tensors and measured."""
from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from planner.flops import measure_op, meta_tensor
from planner.ir import Graph
from planner.random_ops import node_random_op, random_op
from planner.trace_builder import (
    TRACE_ERRORS,
    Builder,
    fetch_attr,
    flat_tensors,
    op_name,
)
from planner.trace_error import trace_error

__all__ = ["FxInterpreter", "trace_with_fx"]


def trace_with_fx(model: nn.Module, inputs: tuple[torch.Tensor, ...], name: str,
                   export_exc: BaseException) -> Graph:
    try:
        gm = torch.fx.symbolic_trace(model)
        return FxInterpreter(gm, name).run(inputs)
    except TRACE_ERRORS as fx_exc:
        raise trace_error(model, name, export_exc, fx_exc) from None


class FxInterpreter:
    """Runs a symbolically traced GraphModule node by node on meta tensors, measuring each op."""

    def __init__(self, gm: torch.fx.GraphModule, name: str) -> None:
        self.gm = gm
        self.builder = Builder(name)

    def run(self, inputs: Sequence[torch.Tensor]) -> Graph:
        b = self.builder
        args_iter = iter(inputs)
        for fx_node in self.gm.graph.nodes:
            if fx_node.op == "placeholder":
                value = next(args_iter)
                b.add_input(fx_node.name, meta_tensor(value.shape, value.dtype))
            elif fx_node.op == "get_attr":
                attr = fetch_attr(self.gm, fx_node.target)
                if isinstance(attr, torch.Tensor):
                    trainable = isinstance(attr, nn.Parameter) and attr.requires_grad
                    b.add_param(fx_node.name, fx_node.target, meta_tensor(attr.shape, attr.dtype), trainable=trainable)
                else:
                    b.values[fx_node.name] = attr
            elif fx_node.op in ("call_function", "call_method", "call_module"):
                self._run_op(fx_node)
            elif fx_node.op == "output":
                returned = [n.name for n in fx_node.all_input_nodes]
                b.add_output(fx_node.name, returned)
        return b.graph("torch.fx")

    def _run_op(self, fx_node: torch.fx.Node) -> None:
        b = self.builder
        args, kwargs, weights = b.leaves(fx_node)
        fn, target, op, params, leaves = self._callable(fx_node)
        cost, result = measure_op(fn, args, kwargs, target=target, params=leaves, weights=weights)
        value = _detach(result)
        if not flat_tensors(value):  # shape arithmetic (x.shape, floordiv): a value, not a node
            b.values[fx_node.name] = value
            return
        b.add_measured(fx_node, value, cost, op, params, random=self._random_op(fx_node) or "")

    def _random_op(self, fx_node: torch.fx.Node) -> str | None:
        """``planner.random_ops`` for a node of the symbolic trace: a dropout module by its ``p`` and mode, an aten
        op by its schema, a Python function (``F.dropout``) by its signature, a method by its name."""
        if fx_node.op == "call_module":
            module = self.gm.get_submodule(fx_node.target)
            if isinstance(module, _DROPOUT_MODULES):
                return random_op("dropout", {"p": module.p, "train": module.training})
            return random_op("rrelu", {"training": module.training}) if isinstance(module, nn.RReLU) else None
        if getattr(fx_node.target, "_schema", None) is not None:
            return node_random_op(fx_node)
        if fx_node.op == "call_method":
            return random_op(fx_node.target, fx_node.kwargs)
        try:
            bound = inspect.signature(fx_node.target).bind_partial(*fx_node.args, **fx_node.kwargs).arguments
        except (TypeError, ValueError):   # a builtin without a Python signature (torch.rand): its keywords
            bound = dict(fx_node.kwargs)
        return random_op(op_name(fx_node.target), bound)

    def _callable(self, fx_node: torch.fx.Node) -> tuple[Any, Any, str, tuple[str, ...], list[torch.Tensor]]:
        """(function, op target, op name, parameter FQNs, parameter leaves) of one fx node."""
        if fx_node.op == "call_function":
            return fx_node.target, fx_node.target, op_name(fx_node.target), (), []
        if fx_node.op == "call_method":
            method = fx_node.target
            return (lambda self_, *a, **k: getattr(self_, method)(*a, **k)), method, method, (), []
        module = self.gm.get_submodule(fx_node.target)
        metas = self._module_params(fx_node.target, module)
        fqns = tuple(f"{fx_node.target}.{local}" for local in metas)
        return ((lambda *a, **k: torch.func.functional_call(module, metas, a, k)),
                type(module).__name__, type(module).__name__, fqns, list(metas.values()))

    def _module_params(self, prefix: str, module: nn.Module) -> dict[str, torch.Tensor]:
        """Meta stand-ins for a leaf module's parameters and buffers, registered as ParamInfo."""
        metas: dict[str, torch.Tensor] = {}
        tensors = [(n, t, True) for n, t in module.named_parameters()] + \
                  [(n, t, False) for n, t in module.named_buffers()]
        for local, tensor, is_param in tensors:
            fqn = f"{prefix}.{local}"
            trainable = is_param and tensor.requires_grad
            metas[local] = meta_tensor(tensor.shape, tensor.dtype, requires_grad=trainable)
            self.builder.add_param(f"{prefix}::{local}", fqn, metas[local], trainable=trainable)
        return metas


_DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return type(value)(_detach(v) for v in value)
    return value

