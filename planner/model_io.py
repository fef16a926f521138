"""Resolve a model spec to a traced graph and its block chain.

A spec is a preset name (``gpt-small``, ``llama-7b``), a ``package.module:factory``
path (both built by :func:`models.registry.build_model` on the meta device, so
no weight memory), or a path to an ``.onnx`` file (read with
:func:`planner.onnx_import.load_onnx`; its shapes are fixed in the file).
"""
from __future__ import annotations

from pathlib import Path

from models.registry import build_model
from planner.coarsen import Granularity, coarsen
from planner.errors import InvalidInputError
from planner.ir import BlockChain, Graph
from planner.trace import trace


def is_onnx_spec(spec: str) -> bool:
    return Path(spec).suffix.lower() == ".onnx"


def load_graph(spec: str, *, batch: int | None = None, seq: int | None = None) -> Graph:
    """Trace a preset or factory at ``batch`` x ``seq``, or read an ONNX file."""
    if is_onnx_spec(spec):
        # onnx takes ~0.8 s to import: only for .onnx models.
        from planner.onnx_import import load_onnx

        graph = load_onnx(spec)
        _check_onnx_shapes(spec, graph, batch, seq)
        return graph

    bundle = build_model(spec, batch=1 if batch is None else batch, seq=seq, device="meta")
    return trace(bundle.module, bundle.example_inputs, name=bundle.name)


def load_chain(spec: str, *, batch: int | None = None, seq: int | None = None,
               granularity: Granularity = "layer") -> tuple[Graph, BlockChain]:
    """``(graph, chain)`` for a spec; every block figure is per microbatch of ``batch``."""
    graph = load_graph(spec, batch=batch, seq=seq)
    return graph, coarsen(graph, granularity=granularity)


def _check_onnx_shapes(spec: str, graph: Graph, batch: int | None, seq: int | None) -> None:
    """An ONNX file has fixed shapes: a --batch/--seq that disagrees is an error, not a silent no-op."""
    inputs = graph.inputs()
    if not inputs or not inputs[0].outputs:
        return
    shape = inputs[0].outputs[0].shape
    for label, wanted, dim in (("batch", batch, 0), ("seq", seq, 1)):
        if wanted is None:
            continue
        if len(shape) <= dim or shape[dim] != wanted:
            found = shape[dim] if len(shape) > dim else "none"
            raise InvalidInputError(
                f"--{label} {wanted} for {spec}", expected=f"the {label} fixed in the ONNX file",
                found=f"input {inputs[0].name} of shape {list(shape)} ({label} {found})",
                fix=f"omit --{label}, or re-export with `stagewise export-onnx MODEL --{label} {wanted} -o FILE.onnx`")
