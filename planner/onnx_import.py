"""ONNX <-> graph IR: import an ONNX model as a :class:`~planner.ir.Graph`, export a model to ONNX.

Import reads only the graph (``load_external_data=False``: weights stay on disk)
and runs ONNX shape inference, so every value has a static shape and dtype.
Initializers become parameters (trainable when the exporter marked them
``PARAMETER``, or, for files without that metadata, when they are floating
point). *Static* values (initializers, ``Constant``/``Shape`` outputs and
anything computed from those alone, e.g. a transposed weight or a causal mask)
are folded away: they are not nodes, and a node reading one lists the
initializers it derives from as its parameters. Module paths come from the
dynamo exporter's ``metadata_props['namespace']`` (``: GPT/layers.0: Block/...``),
or from TorchScript-style node names (``/layers.0/attn/MatMul``), mapped to the
same ``layers.0.attn`` paths as the PyTorch tracer. FLOPs follow
:mod:`planner.flops`.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import onnx

from planner.ir import Graph
from planner.onnx_export import export_onnx
from planner.onnx_file import read_onnx
from planner.onnx_importer import Importer

__all__ = ["OnnxImport", "export_onnx", "import_onnx", "load_onnx"]

_KIND_KEY = "pkg.torch.export.graph_signature.InputSpec.kind"
_FOLD_LIMIT = 1 << 16  # elements: folds shape arithmetic and masks, never anything weight-sized


@dataclass(frozen=True, slots=True, kw_only=True)
class OnnxImport:
    """An ONNX file as imported: the IR ``graph``; ``model``, the ONNX graph it was built from (static
    values folded, shapes inferred; weights still on disk beside ``path``); and ``producers``, the IR node
    that produces each input-dependent ONNX value (a model input's is its input node). Values missing
    from ``producers`` are static: recomputable from initializers and constants alone."""

    path: Path
    graph: Graph
    model: onnx.ModelProto
    producers: Mapping[str, str]


def load_onnx(path: str | os.PathLike[str]) -> Graph:
    """Read an ONNX file (graph only) into a :class:`Graph`; bad files raise :class:`InvalidInputError`."""
    return import_onnx(path).graph


def import_onnx(path: str | os.PathLike[str]) -> OnnxImport:
    """:func:`load_onnx` keeping the ONNX side too (what stage export needs to cut the file by value names)."""
    model = read_onnx(Path(path))
    inferred = onnx.shape_inference.infer_shapes(_fold_shape_constants(model), strict_mode=False, data_prop=True)
    importer = Importer(inferred, name=Path(path).stem, kinds=_param_kinds(model))
    graph = importer.build()
    return OnnxImport(path=Path(path), graph=graph, model=inferred, producers=dict(importer.producer))


def _param_kinds(model: onnx.ModelProto) -> dict[str, str]:
    """``PARAMETER``/``BUFFER``/... per initializer, from the torch exporter's value metadata."""
    kinds = {}
    for vi in list(model.graph.value_info) + list(model.graph.input):
        kind = {p.key: p.value for p in vi.metadata_props}.get(_KIND_KEY)
        if kind:
            kinds[vi.name] = kind
    return kinds


def _fold_shape_constants(model: onnx.ModelProto) -> onnx.ModelProto:
    """Constant-fold the small parameter-free computations (shape arithmetic, masks).

    Exporters compute reshape targets and norm scales with Shape/Concat/Expand
    chains that ONNX shape inference cannot see through, which leaves later
    shapes unknown. ``onnxscript``'s folder evaluates them. The initializers are
    turned into graph inputs while it runs, so no weight is read (they stay on
    disk), folded or renamed; they are restored afterwards.
    """
    import onnx_ir
    from onnxscript import optimizer  # heavy import, only needed here

    work = onnx.ModelProto()
    work.CopyFrom(model)
    inits = list(work.graph.initializer)
    del work.graph.initializer[:]
    present = {vi.name for vi in work.graph.input}
    for init in inits:
        if init.name not in present:
            work.graph.input.append(onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    try:
        ir_model = onnx_ir.from_proto(work)
        optimizer.fold_constants(ir_model, input_size_limit=_FOLD_LIMIT, output_size_limit=_FOLD_LIMIT)
        folded = onnx_ir.to_proto(ir_model)
    except (ValueError, TypeError, RuntimeError, KeyError, AttributeError, NotImplementedError):
        return model  # the folder gave up on this graph: import it as it is
    names = {init.name for init in inits}
    kept_inputs = [vi for vi in folded.graph.input if vi.name not in names]
    del folded.graph.input[:]
    folded.graph.input.extend(kept_inputs)
    folded.graph.initializer.extend(inits)
    return folded
