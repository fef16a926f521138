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
import io
import itertools
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.export.graph_signature import OutputKind, TensorArgument

from planner.errors import InvalidInputError
from planner.ir import Graph
from planner.trace_builder import TRACE_ERRORS, Builder, clean_module_path, fetch_attr
from planner.trace_fx import trace_with_fx

__all__ = ["clean_module_path", "graph_from_exported", "trace"]

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
    except TRACE_ERRORS as export_exc:
        return trace_with_fx(model, inputs, name, export_exc)
    return graph_from_exported(exported, name=name)


def graph_from_exported(exported: torch.export.ExportedProgram, *, name: str = "model",
                        source: str = "torch.export") -> Graph:
    """Build the IR from an ``ExportedProgram`` (the node names are the program's)."""
    sig = exported.graph_signature
    lifted = {**sig.inputs_to_parameters, **sig.inputs_to_buffers,
              **sig.inputs_to_lifted_tensor_constants}
    builder = Builder(name)
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
            builder.values[fx_node.name] = fetch_attr(exported.graph_module, fx_node.target)
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
