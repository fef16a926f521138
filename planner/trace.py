"""Trace a PyTorch model into the graph IR (:class:`planner.ir.Graph`).

``torch.export.export(strict=False)`` first: it runs the model on FakeTensors, so
a model built on the meta device (a 7B config) costs no weight memory. Every
exported node carries ``meta['val']`` (shape, dtype, strides) and
``meta['nn_module_stack']`` (its module path). Parameters and buffers are
lifted to placeholders; the graph signature maps them back to their FQNs and we
record them as :class:`~planner.ir.ParamInfo` on the nodes that read them
(they are not nodes). Node names are the exported graph's names, so the runtime
can later split a re-export of the real model by these names.

If export fails, ``torch.fx.symbolic_trace`` is the fallback, interpreted on
meta tensors. If both fail, one :class:`~planner.errors.TraceError` names the
module and the source line that broke tracing.

FLOPs per node come from :func:`planner.flops.measure_op`: each op is re-run
alone on meta tensors under ``FlopCounterMode`` (forward, then its autograd
backward), with ``requires_grad`` propagated from the trainable parameters.
"""
from __future__ import annotations

import contextlib
import inspect
import io
import itertools
import linecache
import logging
import operator
import re
import traceback
from types import TracebackType
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from torch.export.graph_signature import OutputKind, TensorArgument
from torch.fx.node import map_arg

from planner.errors import InvalidInputError, TraceError
from planner.flops import OpCost, measure_op, meta_tensor, table_flops
from planner.ir import Graph, Node, ParamInfo, TensorMeta
from planner.random_ops import node_random_op, random_op

# Exceptions that tracing or re-running user ops raise for an untraceable model.
# (torch.export's own errors derive from RuntimeError; torch.fx's TraceError from ValueError.)
_TRACE_ERRORS = (RuntimeError, TypeError, ValueError, NotImplementedError, AssertionError,
                 AttributeError, KeyError, IndexError)
# Loggers that print whole graphs to stderr when an export attempt fails.
_NOISY_LOGGERS = ("torch._export", "torch.export", "torch._dynamo", "torch.fx.experimental.symbolic_shapes",
                  "torch._subclasses.fake_tensor", "torch._functorch")


def trace(model: nn.Module, example_inputs: Any, *, name: str = "model") -> Graph:
    """Trace ``model`` at the shapes of ``example_inputs`` into a :class:`Graph`.

    ``example_inputs`` is a tensor or a tuple of tensors (meta tensors are fine).
    Raises :class:`TraceError` when neither torch.export nor torch.fx can trace it.
    """
    if not isinstance(model, nn.Module):
        raise InvalidInputError("model to trace", expected="a torch.nn.Module", found=type(model).__name__)
    inputs = _normalise_inputs(model, example_inputs)
    try:
        with _quiet_torch_logs():
            exported = torch.export.export(model, inputs, strict=False)
    except _TRACE_ERRORS as export_exc:
        return _trace_with_fx(model, inputs, name, export_exc)
    return graph_from_exported(exported, name=name)


def graph_from_exported(exported: torch.export.ExportedProgram, *, name: str = "model",
                        source: str = "torch.export") -> Graph:
    """Build the IR from an ``ExportedProgram`` (the node names are the program's)."""
    sig = exported.graph_signature
    lifted = {**sig.inputs_to_parameters, **sig.inputs_to_buffers,
              **sig.inputs_to_lifted_tensor_constants}
    builder = _Builder(name)
    aliases = _unread_aliases(exported)
    for fx_node in exported.graph.nodes:
        if fx_node.op == "placeholder":
            if fx_node.name in aliases:
                continue  # another name of a tied parameter, which that parameter's own entry counts
            if fx_node.name in lifted:
                builder.add_param(fx_node.name, lifted[fx_node.name], fx_node.meta["val"],
                                  trainable=fx_node.name in sig.inputs_to_parameters)
            else:
                builder.add_input(fx_node.name, fx_node.meta["val"])
        elif fx_node.op == "call_function":
            builder.add_exported_op(fx_node)
        elif fx_node.op == "get_attr":
            # Submodules of higher-order ops (e.g. a torch.no_grad() region): values, not nodes.
            builder.values[fx_node.name] = _fetch_attr(exported.graph_module, fx_node.target)
        elif fx_node.op == "output":
            # Buffer mutations (e.g. BatchNorm running stats) are outputs too, but they
            # stay on the stage that owns the buffer: only user outputs leave the model.
            user = [spec.arg.name for spec in sig.output_specs
                    if spec.kind == OutputKind.USER_OUTPUT and isinstance(spec.arg, TensorArgument)]
            builder.add_output(fx_node.name, user)
    return builder.graph(source)


def _unread_aliases(exported: torch.export.ExportedProgram) -> set[str]:
    """Placeholders of the extra names of tied parameters.

    torch.export lifts every name of a tied parameter (``transformer.wte.weight`` and
    ``lm_head.weight``) but routes all reads to one of them; the others are unread. Kept,
    they would count the tied tensor twice (GPT-2 124M as 163M).
    """
    readers = {n.name: len(n.users) for n in exported.graph.nodes if n.op == "placeholder"}
    state = exported.state_dict
    groups: dict[int, list[str]] = {}
    for placeholder, fqn in exported.graph_signature.inputs_to_parameters.items():
        if fqn in state:
            groups.setdefault(id(state[fqn]), []).append(placeholder)
    return {p for group in groups.values() if len(group) > 1 and any(readers.get(q) for q in group)
            for p in group if not readers.get(p)}


# --- inputs --------------------------------------------------------------------
def _normalise_inputs(model: nn.Module, example_inputs: Any) -> tuple[torch.Tensor, ...]:
    inputs = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise InvalidInputError("example inputs", expected="a tensor or a non-empty tuple of tensors",
                                found=repr(tuple(type(t).__name__ for t in inputs)))
    device = _model_device(model)
    if device is None:
        return tuple(inputs)
    # A meta model needs meta inputs; a real model gets placeholder values of the right
    # shape (export only looks at shapes and dtypes, so zeros are as good as data).
    return tuple(t if t.device == device else
                 (t.to("meta") if device.type == "meta" else torch.zeros(t.shape, dtype=t.dtype, device=device))
                 for t in inputs)


def _model_device(model: nn.Module) -> torch.device | None:
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    return None if first is None else first.device


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """Keep a failed export from printing its graph dump: the CLI prints one line.

    torch.export logs through its own loggers and also ``print``s the partial
    graph of a failed trace to ``sys.stderr``; we raise our own error instead.
    """
    saved = {n: logging.getLogger(n).level for n in _NOISY_LOGGERS}
    for n in _NOISY_LOGGERS:
        logging.getLogger(n).setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for n, level in saved.items():
            logging.getLogger(n).setLevel(level)


# --- the builder shared by both tracers ---------------------------------------
def _tensor_meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(shape=tuple(int(d) for d in t.shape), dtype=str(t.dtype).removeprefix("torch."))


def _flat_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _flat_tensors(v)]
    return []


_PARTIAL_OP = re.compile(r"torch\.ops\.([\w.]+)\(")
_STRICT_PATH = re.compile(r"\[['\"]?([^\]'\"]+)['\"]?\]")


def clean_module_path(path: str) -> str:
    """``L['self'].layers[0].attn`` (strict-mode style) -> ``layers.0.attn``; clean paths pass through."""
    path = path.removeprefix("L['self']").removeprefix("L__self__")
    path = _STRICT_PATH.sub(r".\1", path).replace("._modules.", ".")
    return path.strip(".")


class _Builder:
    """Accumulates IR nodes; keeps per-node meta templates to re-run each op alone."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.nodes: list[Node] = []
        self.params: dict[str, ParamInfo] = {}
        self.param_of: dict[str, str] = {}          # placeholder/get_attr name -> FQN
        self.values: dict[str, Any] = {}            # node name -> example value (fake or meta)
        self.requires_grad: dict[str, tuple[bool, ...]] = {}
        self.node_names: set[str] = set()
        self.cost_cache: dict[str, OpCost] = {}

    def add_param(self, node_name: str, fqn: str, value: torch.Tensor, *, trainable: bool) -> None:
        if fqn not in self.params:
            self.params[fqn] = ParamInfo(name=fqn, meta=_tensor_meta(value), trainable=trainable)
        self.param_of[node_name] = fqn
        self.values[node_name] = value
        self.requires_grad[node_name] = (trainable and value.dtype.is_floating_point,)

    def add_input(self, node_name: str, value: torch.Tensor) -> None:
        # Model inputs are data: no gradient flows to them.
        self._append(Node(name=node_name, op="input", kind="input", outputs=(_tensor_meta(value),)), value, (False,))

    def add_output(self, node_name: str, returned: Sequence[str]) -> None:
        inputs = tuple(dict.fromkeys(r for r in returned if r in self.node_names))
        self.nodes.append(Node(name=node_name, op="output", kind="output", inputs=inputs))
        self.node_names.add(node_name)

    def add_exported_op(self, fx_node: torch.fx.Node) -> None:
        value = fx_node.meta.get("val")
        cost = self._exported_cost(fx_node, value)
        self._append(self._node(fx_node, value, cost, op=_op_name(fx_node.target),
                                random=node_random_op(fx_node) or ""), value, cost.outputs_require_grad)

    def add_measured(self, fx_node: torch.fx.Node, value: Any, cost: OpCost, op: str,
                     params: Sequence[str] = (), random: str = "") -> None:
        self._append(self._node(fx_node, value, cost, op=op, params=params, random=random), value,
                     cost.outputs_require_grad)

    def _node(self, fx_node: torch.fx.Node, value: Any, cost: OpCost, *, op: str,
              params: Sequence[str] = (), random: str = "") -> Node:
        producers = [a.name for a in fx_node.all_input_nodes]
        stack = fx_node.meta.get("nn_module_stack") or {}
        path = clean_module_path(list(stack.values())[-1][0]) if stack else ""
        return Node(name=fx_node.name, op=op, kind="compute", module_path=path,
                    inputs=tuple(dict.fromkeys(p for p in producers if p in self.node_names)),
                    outputs=tuple(_tensor_meta(t) for t in _flat_tensors(value)),
                    param_names=tuple(dict.fromkeys(
                        [self.param_of[p] for p in producers if p in self.param_of] + list(params))),
                    fwd_flops=cost.fwd_flops, bwd_flops=cost.bwd_flops, is_view=cost.is_view, random_op=random)

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
            args, kwargs = self._leaf_args(fx_node)
            try:
                self.cost_cache[key], _ = measure_op(fx_node.target, args, kwargs, target=fx_node.target)
            except _TRACE_ERRORS:
                self.cost_cache[key] = self._table_cost(fx_node, value)  # no meta kernel: shapes only
        return self.cost_cache[key]

    def _signature(self, fx_node: torch.fx.Node) -> str:
        """Everything the cost of an op depends on: target, argument layouts, gradient flags, constants."""
        seen: dict[str, int] = {}

        def describe(arg: torch.fx.Node) -> Any:
            index = seen.setdefault(arg.name, len(seen))  # keeps "the same tensor twice" apart from two tensors
            value = self.values.get(arg.name)
            layout = [(tuple(t.shape), tuple(t.stride()), t.dtype) for t in _flat_tensors(value)]
            if not layout and isinstance(value, torch.fx.GraphModule):
                return ("graph", arg.name)  # a higher-order op's body: unique to this call
            return ("node", index, layout or repr(value), self.requires_grad.get(arg.name, ()))

        return repr((str(fx_node.target), map_arg(fx_node.args, describe), map_arg(fx_node.kwargs, describe)))

    def _getitem_cost(self, fx_node: torch.fx.Node) -> OpCost:
        src, index = fx_node.args[0], fx_node.args[1]
        grads = self.requires_grad.get(src.name, ())
        flag = grads[index] if isinstance(index, int) and -len(grads) <= index < len(grads) else any(grads)
        return OpCost(fwd_flops=0, bwd_flops=0, is_view=True, outputs_require_grad=(flag,))

    def _table_cost(self, fx_node: torch.fx.Node, value: Any) -> OpCost:
        ins = [t for a in fx_node.all_input_nodes for t in _flat_tensors(self.values.get(a.name))]
        outs = _flat_tensors(value)
        flops = table_flops(fx_node.target, [t.shape for t in ins], [t.shape for t in outs])
        grad_in = any(g for a in fx_node.all_input_nodes for g in self.requires_grad.get(a.name, ()))
        grads = tuple(grad_in and t.dtype.is_floating_point for t in outs)
        schema = getattr(fx_node.target, "_schema", None)
        is_view = bool(schema and schema.returns and all(
            r.alias_info is not None and not r.alias_info.is_write for r in schema.returns))
        return OpCost(fwd_flops=0 if is_view else flops, bwd_flops=0 if is_view or not grad_in else flops,
                      is_view=is_view, outputs_require_grad=grads)

    def _leaf_args(self, fx_node: torch.fx.Node) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The op's arguments as fresh meta leaves (same shape, dtype, strides, requires_grad)."""
        cache: dict[str, Any] = {}

        def leaf(arg: torch.fx.Node) -> Any:
            if arg.name not in cache:
                cache[arg.name] = _as_meta(self.values.get(arg.name), self.requires_grad.get(arg.name, ()))
            return cache[arg.name]

        return map_arg(fx_node.args, leaf), map_arg(fx_node.kwargs, leaf)

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


def _op_name(target: Any) -> str:
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, torch._ops.OpOverload):
        return str(target)  # e.g. aten.linear.default
    return getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)


# --- torch.fx fallback -----------------------------------------------------------
def _trace_with_fx(model: nn.Module, inputs: tuple[torch.Tensor, ...], name: str,
                   export_exc: BaseException) -> Graph:
    try:
        gm = torch.fx.symbolic_trace(model)
        return _FxInterpreter(gm, name).run(inputs)
    except _TRACE_ERRORS as fx_exc:
        raise _trace_error(model, name, export_exc, fx_exc) from None


class _FxInterpreter:
    """Runs a symbolically traced GraphModule node by node on meta tensors, measuring each op."""

    def __init__(self, gm: torch.fx.GraphModule, name: str) -> None:
        self.gm = gm
        self.builder = _Builder(name)

    def run(self, inputs: Sequence[torch.Tensor]) -> Graph:
        b = self.builder
        args_iter = iter(inputs)
        for fx_node in self.gm.graph.nodes:
            if fx_node.op == "placeholder":
                value = next(args_iter)
                b.add_input(fx_node.name, meta_tensor(value.shape, value.dtype))
            elif fx_node.op == "get_attr":
                attr = _fetch_attr(self.gm, fx_node.target)
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
        args, kwargs = b._leaf_args(fx_node)
        fn, target, op, params, leaves = self._callable(fx_node)
        cost, result = measure_op(fn, args, kwargs, target=target, params=leaves)
        value = _detach(result)
        if not _flat_tensors(value):  # shape arithmetic (x.shape, floordiv): a value, not a node
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
        return random_op(_op_name(fx_node.target), bound)

    def _callable(self, fx_node: torch.fx.Node) -> tuple[Any, Any, str, tuple[str, ...], list[torch.Tensor]]:
        """(function, op target, op name, parameter FQNs, parameter leaves) of one fx node."""
        if fx_node.op == "call_function":
            return fx_node.target, fx_node.target, _op_name(fx_node.target), (), []
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


def _fetch_attr(gm: torch.fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return type(value)(_detach(v) for v in value)
    return value


# --- the error when nothing can trace the model ------------------------------------
def _trace_error(model: nn.Module, name: str, export_exc: BaseException, fx_exc: BaseException) -> TraceError:
    names = {id(m): path for path, m in model.named_modules()}
    where = _culprit(fx_exc.__traceback__, names) or _culprit(export_exc.__traceback__, names)
    first_line = (str(fx_exc) or type(fx_exc).__name__).strip().splitlines()[0]
    export_line = (str(export_exc) or type(export_exc).__name__).strip().splitlines()[0]
    if where is None:
        location = "in the model's forward"
    else:
        path, cls, code, file, lineno = where
        location = f"at `{code}` in module {path or '<root>'} ({cls}), {file}:{lineno}"
    # torch.export attaches the graph it had built so far: its last op is where it stopped.
    ops = _PARTIAL_OP.findall(str(getattr(export_exc, "partial_fx_graph", "") or ""))
    if ops:
        location = f"at op {ops[-1]} " + location
    return TraceError(
        f"cannot trace model {name!r} {location}",
        expected="a model torch.export (strict=False) or torch.fx can trace",
        found=f"torch.export: {export_line[:160]}; torch.fx: {first_line[:160]}",
        fix="replace data-dependent Python control flow on tensor values with torch.where / torch.cond, "
            "or pass an ONNX file instead")


def _culprit(tb: TracebackType | None, names: dict[int, str]) -> tuple[str, str, str, str, int] | None:
    """The innermost traceback frame running a submodule's code: (path, class, line, file, lineno)."""
    found = None
    for frame, lineno in traceback.walk_tb(tb):
        code = frame.f_code
        owner = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None  # `self`, by any name
        if isinstance(owner, nn.Module) and id(owner) in names:
            line = linecache.getline(code.co_filename, lineno).strip()
            found = (names[id(owner)], type(owner).__name__, line, code.co_filename, lineno)
    return found
