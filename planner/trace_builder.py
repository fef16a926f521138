"""The graph builder both tracers share: IR nodes from fx nodes, each op's cost measured once per signature."""
from __future__ import annotations

import operator
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch.fx.node import map_arg

from planner.flops import OpCost, measure_op, meta_tensor, table_flops
from planner.ir import Graph, Node, ParamInfo, TensorMeta
from planner.random_ops import node_random_op

__all__ = ["TRACE_ERRORS", "Builder", "clean_module_path", "fetch_attr", "flat_tensors", "op_name", "tensor_meta"]

# Exceptions that tracing or re-running user ops raise for an untraceable model.
# (torch.export's own errors derive from RuntimeError; torch.fx's TraceError from ValueError.)
TRACE_ERRORS = (RuntimeError, TypeError, ValueError, NotImplementedError, AssertionError,
                AttributeError, KeyError, IndexError)


def tensor_meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(shape=tuple(int(d) for d in t.shape), dtype=str(t.dtype).removeprefix("torch."))


def flat_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in flat_tensors(v)]
    return []


_STRICT_PATH = re.compile(r"\[['\"]?([^\]'\"]+)['\"]?\]")


def clean_module_path(path: str) -> str:
    """``L['self'].layers[0].attn`` (strict-mode style) -> ``layers.0.attn``; clean paths pass through."""
    path = path.removeprefix("L['self']").removeprefix("L__self__")
    path = _STRICT_PATH.sub(r".\1", path).replace("._modules.", ".")
    return path.strip(".")


class Builder:
    """Accumulates IR nodes; keeps per-node meta templates to re-run each op alone."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.nodes: list[Node] = []
        self.params: dict[str, ParamInfo] = {}
        self.param_of: dict[str, str] = {}          # placeholder/get_attr name -> FQN
        self.values: dict[str, Any] = {}            # node name -> example value (fake or meta)
        self.requires_grad: dict[str, tuple[bool, ...]] = {}
        self.node_names: set[str] = set()
        self.static: set[str] = set()               # names whose value derives from parameters alone
        self.cost_cache: dict[str, OpCost] = {}

    def add_param(self, node_name: str, fqn: str, value: torch.Tensor, *, trainable: bool) -> None:
        if fqn not in self.params:
            self.params[fqn] = ParamInfo(name=fqn, meta=tensor_meta(value), trainable=trainable)
        self.param_of[node_name] = fqn
        self.static.add(node_name)
        self.values[node_name] = value
        self.requires_grad[node_name] = (trainable and value.dtype.is_floating_point,)

    def add_input(self, node_name: str, value: torch.Tensor) -> None:
        # Model inputs are data: no gradient flows to them.
        self._append(Node(name=node_name, op="input", kind="input", outputs=(tensor_meta(value),)), value, (False,))

    def add_output(self, node_name: str, returned: Sequence[str]) -> None:
        inputs = tuple(dict.fromkeys(r for r in returned if r in self.node_names))
        self.nodes.append(Node(name=node_name, op="output", kind="output", inputs=inputs))
        self.node_names.add(node_name)

    def add_exported_op(self, fx_node: torch.fx.Node) -> None:
        value = fx_node.meta.get("val")
        cost = self._exported_cost(fx_node, value)
        self._mark_static(fx_node)
        self._append(self._node(fx_node, value, cost, op=op_name(fx_node.target),
                                random=node_random_op(fx_node) or ""), value, cost.outputs_require_grad)

    def add_measured(self, fx_node: torch.fx.Node, value: Any, cost: OpCost, op: str,
                     params: Sequence[str] = (), random: str = "") -> None:
        self._mark_static(fx_node)
        self._append(self._node(fx_node, value, cost, op=op, params=params, random=random), value,
                     cost.outputs_require_grad)

    def _node(self, fx_node: torch.fx.Node, value: Any, cost: OpCost, *, op: str,
              params: Sequence[str] = (), random: str = "") -> Node:
        producers = [a.name for a in fx_node.all_input_nodes]
        stack = fx_node.meta.get("nn_module_stack") or {}
        path = clean_module_path(list(stack.values())[-1][0]) if stack else ""
        return Node(name=fx_node.name, op=op, kind="compute", module_path=path,
                    inputs=tuple(dict.fromkeys(p for p in producers if p in self.node_names)),
                    outputs=tuple(tensor_meta(t) for t in flat_tensors(value)),
                    param_names=tuple(dict.fromkeys(
                        [self.param_of[p] for p in producers if p in self.param_of] + list(params))),
                    fwd_flops=cost.fwd_flops, bwd_flops=cost.bwd_flops, is_view=cost.is_view, random_op=random,
                    bwd_input_flops=cost.bwd_input_flops)

    def _mark_static(self, fx_node: torch.fx.Node) -> None:
        """An op all of whose tensor operands derive from parameters alone does too (its gradient reaches only
        them: an audit asking for the stage input's gradient never runs its backward)."""
        tensors = [a.name for a in fx_node.all_input_nodes if a.name in self.node_names or a.name in self.static]
        if tensors and all(name in self.static for name in tensors):
            self.static.add(fx_node.name)

    def _append(self, node: Node, value: Any, grads: tuple[bool, ...]) -> None:
        self.nodes.append(node)
        self.node_names.add(node.name)
        self.values[node.name] = value
        self.requires_grad[node.name] = grads

    # -- cost of one exported op ----------------------------------------------
    def _exported_cost(self, fx_node: torch.fx.Node, value: Any) -> OpCost:
        if fx_node.target is operator.getitem:
            return self._getitem_cost(fx_node)
        # Transformer layers repeat the same ops at the same shapes: measure each signature once.
        key = self._signature(fx_node)
        if key not in self.cost_cache:
            args, kwargs, weights = self.leaves(fx_node)
            try:
                self.cost_cache[key], _ = measure_op(fx_node.target, args, kwargs, target=fx_node.target,
                                                     weights=weights)
            except TRACE_ERRORS:
                self.cost_cache[key] = self._table_cost(fx_node, value)  # no meta kernel: shapes only
        return self.cost_cache[key]

    def _signature(self, fx_node: torch.fx.Node) -> str:
        """Everything the cost of an op depends on: target, argument layouts, gradient flags, constants."""
        seen: dict[str, int] = {}

        def describe(arg: torch.fx.Node) -> Any:
            index = seen.setdefault(arg.name, len(seen))  # keeps "the same tensor twice" apart from two tensors
            value = self.values.get(arg.name)
            layout = [(tuple(t.shape), tuple(t.stride()), t.dtype) for t in flat_tensors(value)]
            if not layout and isinstance(value, torch.fx.GraphModule):
                return ("graph", arg.name)  # a higher-order op's body: unique to this call
            return ("node", index, layout or repr(value), self.requires_grad.get(arg.name, ()), arg.name in self.static)

        return repr((str(fx_node.target), map_arg(fx_node.args, describe), map_arg(fx_node.kwargs, describe)))

    def _getitem_cost(self, fx_node: torch.fx.Node) -> OpCost:
        src, index = fx_node.args[0], fx_node.args[1]
        grads = self.requires_grad.get(src.name, ())
        flag = grads[index] if isinstance(index, int) and -len(grads) <= index < len(grads) else any(grads)
        return OpCost(fwd_flops=0, bwd_flops=0, is_view=True, outputs_require_grad=(flag,))

    def _table_cost(self, fx_node: torch.fx.Node, value: Any) -> OpCost:
        ins = [t for a in fx_node.all_input_nodes for t in flat_tensors(self.values.get(a.name))]
        outs = flat_tensors(value)
        flops = table_flops(fx_node.target, [t.shape for t in ins], [t.shape for t in outs])
        grad_in = any(g for a in fx_node.all_input_nodes for g in self.requires_grad.get(a.name, ()))
        grad_act = any(g for a in fx_node.all_input_nodes if a.name not in self.static
                       for g in self.requires_grad.get(a.name, ()))
        grads = tuple(grad_in and t.dtype.is_floating_point for t in outs)
        schema = getattr(fx_node.target, "_schema", None)
        is_view = bool(schema and schema.returns and all(
            r.alias_info is not None and not r.alias_info.is_write for r in schema.returns))
        return OpCost(fwd_flops=0 if is_view else flops, bwd_flops=0 if is_view or not grad_in else flops,
                      is_view=is_view, outputs_require_grad=grads,
                      bwd_input_flops=0 if is_view or not grad_act else flops)

    def leaves(self, fx_node: torch.fx.Node) -> tuple[tuple[Any, ...], dict[str, Any], list[torch.Tensor]]:
        """The op's arguments as fresh meta leaves (same shape, dtype, strides, requires_grad) and, of those
        leaves, the ones derived from parameters alone (``measure_op``'s ``weights``)."""
        cache: dict[str, Any] = {}
        weights: list[torch.Tensor] = []

        def leaf(arg: torch.fx.Node) -> Any:
            if arg.name not in cache:
                cache[arg.name] = _as_meta(self.values.get(arg.name), self.requires_grad.get(arg.name, ()))
                if arg.name in self.static:
                    weights.extend(flat_tensors(cache[arg.name]))
            return cache[arg.name]

        return map_arg(fx_node.args, leaf), map_arg(fx_node.kwargs, leaf), weights

    def graph(self, source: str) -> Graph:
        return Graph(name=self.name, source=source, nodes=self.nodes, params=self.params.values())


def _as_meta(value: Any, grads: tuple[bool, ...]) -> Any:
    """A fake/real/meta example value as meta leaf tensor(s); non-tensors pass through."""
    if isinstance(value, torch.Tensor):
        return meta_tensor(value.shape, value.dtype, stride=value.stride(),
                           requires_grad=bool(grads and grads[0]))
    if isinstance(value, (tuple, list)):
        flags = list(grads) + [False] * len(value)
        return type(value)(_as_meta(v, (flags[i],)) for i, v in enumerate(value))
    if isinstance(value, torch.SymInt):
        return int(value)
    return value


def op_name(target: Any) -> str:
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, torch._ops.OpOverload):
        return str(target)  # e.g. aten.linear.default
    return getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)


def fetch_attr(gm: torch.fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj

