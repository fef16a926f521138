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

import logging
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import onnx
from google.protobuf.message import DecodeError
from onnx import external_data_helper

from planner.errors import InvalidInputError, TraceError
from planner.flops import ONNX_VIEW_OPS, onnx_bwd_flops, onnx_fwd_flops
from planner.ir import DTYPE_BYTES, Graph, Node, ParamInfo, TensorMeta

_ONNX_DTYPES: Mapping[int, str] = {
    onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.DOUBLE: "float64", onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.BFLOAT16: "bfloat16", onnx.TensorProto.INT64: "int64", onnx.TensorProto.INT32: "int32",
    onnx.TensorProto.INT16: "int16", onnx.TensorProto.INT8: "int8", onnx.TensorProto.UINT8: "uint8",
    onnx.TensorProto.BOOL: "bool", onnx.TensorProto.COMPLEX64: "complex64",
    onnx.TensorProto.FLOAT8E4M3FN: "float8_e4m3fn", onnx.TensorProto.FLOAT8E5M2: "float8_e5m2",
}
_FLOATING = frozenset({"float32", "float64", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"})
# Inputs whose values an op reads (the others give only a shape or a dtype); ops not
# listed read every input. Shape(x) and CastLike(c, x) do not depend on x's values.
_VALUE_INPUTS: Mapping[str, tuple[int, ...]] = {"Shape": (), "Size": (), "CastLike": (0,)}
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
    model = _read(Path(path))
    inferred = onnx.shape_inference.infer_shapes(_fold_shape_constants(model), strict_mode=False, data_prop=True)
    importer = _Importer(inferred, name=Path(path).stem, kinds=_param_kinds(model))
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


def _read(path: Path) -> onnx.ModelProto:
    if not path.is_file():
        raise InvalidInputError(f"ONNX file {str(path)!r}", expected="an existing .onnx file", found="no such file",
                                fix="check the path, or create one with `stagewise export-onnx MODEL -o FILE.onnx`")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, ValueError, OSError, RuntimeError) as exc:
        raise InvalidInputError(f"ONNX file {str(path)!r}", expected="a valid ONNX model (protobuf ModelProto)",
                                found=f"unreadable: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                                fix="re-export the model; a truncated or non-ONNX file cannot be read") from None
    if not model.graph.node or not model.graph.output:
        raise InvalidInputError(f"ONNX file {str(path)!r}", expected="a model graph with nodes and outputs",
                                found=f"{len(model.graph.node)} nodes, {len(model.graph.output)} outputs",
                                fix="pass an ONNX model file, not another kind of file")
    check_external_data(model, path)
    return model


def check_external_data(model: onnx.ModelProto, path: Path) -> None:
    """Every external-data file the model names exists beside it and is long enough for its tensors.

    Import never reads the weights, so without this a missing or truncated ``X.onnx.data`` would pass
    trace and plan and fail only when the weights are read. The bound per file is the largest
    ``offset + length`` of its tensors (``length`` defaults to the tensor's own size).
    """
    needed: dict[str, tuple[int, str]] = {}  # location -> (bytes needed, the tensor that needs the most)
    for tensor in _all_initializers(model.graph):
        if not external_data_helper.uses_external_data(tensor):
            continue
        try:
            info = external_data_helper.ExternalDataInfo(tensor)
        except ValueError as exc:
            raise InvalidInputError(f"ONNX file {str(path)!r}: tensor {tensor.name!r}",
                                    expected="valid external-data offset and length", found=str(exc),
                                    fix="re-export the model") from None
        end = (info.offset or 0) + (info.length if info.length is not None else _tensor_bytes(tensor))
        if end > needed.get(info.location, (-1, ""))[0]:
            needed[info.location] = (end, tensor.name)
    folder = path.parent.resolve()
    for location, (size, tensor_name) in needed.items():
        data = (folder / location).resolve()
        what = f"external data {str(data)!r} of ONNX file {str(path)!r}"
        fix = "copy the model's .data file beside it, or re-export the model (`stagewise export-onnx`)"
        if not location or folder not in data.parents:
            raise InvalidInputError(what, expected="a file inside the model's folder", found=f"location {location!r}",
                                    fix="re-export the model with its weights beside it")
        if not data.is_file():
            raise InvalidInputError(what, expected=f"a file of at least {size:,} bytes", found="no such file", fix=fix)
        found = data.stat().st_size
        if found < size:
            raise InvalidInputError(what, expected=f"at least {size:,} bytes (tensor {tensor_name!r} ends there)",
                                    found=f"{found:,} bytes (truncated)", fix=fix)


def _all_initializers(graph: onnx.GraphProto):
    """Initializers of the graph and of its control-flow subgraphs (If/Loop bodies)."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from _all_initializers(sub)


def _tensor_bytes(tensor: onnx.TensorProto) -> int:
    numel = 1
    for d in tensor.dims:
        numel *= int(d)
    try:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    except (KeyError, TypeError, ValueError):
        itemsize = 1  # an exotic dtype: at least one byte per element
    return numel * itemsize


class _Importer:
    def __init__(self, model: onnx.ModelProto, *, name: str, kinds: Mapping[str, str]) -> None:
        self.model = model
        self.g = model.graph
        self.name = name
        self.types = self._types()
        self.params = self._params(kinds)
        self.producer: dict[str, str] = {}          # value name -> IR node name
        self.static_deps: dict[str, frozenset[str]] = {
            i.name: frozenset({i.name}) if i.name in self.params else frozenset() for i in self.g.initializer}
        self.requires_grad: dict[str, bool] = {p: info.trainable for p, info in self.params.items()}
        self.path_of_value: dict[str, str] = {}
        self.nodes: list[Node] = []
        self.used_names: set[str] = set()

    # -- tables -------------------------------------------------------------
    def _types(self) -> dict[str, Any]:
        types: dict[str, Any] = {}
        for vi in list(self.g.input) + list(self.g.value_info) + list(self.g.output):
            types[vi.name] = vi.type
        return types

    def _params(self, kinds: Mapping[str, str]) -> dict[str, ParamInfo]:
        has_kinds = any(kinds.get(init.name) for init in self.g.initializer)
        params = {}
        for init in self.g.initializer:
            if has_kinds and not kinds.get(init.name):
                continue  # a folded constant in a file that marks its parameters and buffers
            dtype = _dtype(init.data_type, init.name)
            meta = TensorMeta(shape=tuple(int(d) for d in init.dims), dtype=dtype)
            trainable = kinds.get(init.name) == "PARAMETER" if has_kinds else dtype in _FLOATING
            params[init.name] = ParamInfo(name=init.name, meta=meta, trainable=trainable)
        return params

    def _meta(self, value: str) -> TensorMeta | None:
        if value in self.params:
            return self.params[value].meta
        tp = self.types.get(value)
        if tp is None:
            return None
        if tp.HasField("sequence_type"):
            tp = tp.sequence_type.elem_type
        if not tp.HasField("tensor_type"):
            return None
        tt = tp.tensor_type
        if not tt.HasField("shape") or any(not d.HasField("dim_value") for d in tt.shape.dim):
            return None
        return TensorMeta(shape=tuple(int(d.dim_value) for d in tt.shape.dim), dtype=_dtype(tt.elem_type, value))

    def _static_meta(self, value: str) -> TensorMeta:
        meta = self._meta(value)
        if meta is None:
            raise InvalidInputError(f"ONNX value {value!r} in {self.name}", expected="a static shape after shape inference",
                                    found="an unknown or symbolic shape",
                                    fix="export the model with fixed input shapes (no dynamic axes)")
        return meta

    # -- build --------------------------------------------------------------
    def build(self) -> Graph:
        init_names = {i.name for i in self.g.initializer}
        for vi in self.g.input:
            if vi.name in init_names:
                continue  # old exporters list initializers as inputs too
            meta = self._static_meta(vi.name)
            node_name = self._unique(vi.name)
            self.nodes.append(Node(name=node_name, op="input", kind="input", outputs=(meta,)))
            self.producer[vi.name] = node_name
            self.requires_grad[vi.name] = False
        for i, onode in enumerate(self.g.node):
            if self._is_static(onode):
                self._fold(onode)
            else:
                self._add(onode, i)
        outputs = tuple(dict.fromkeys(self.producer[o.name] for o in self.g.output if o.name in self.producer))
        self.nodes.append(Node(name=self._unique("output"), op="output", kind="output", inputs=outputs))
        return Graph(name=self.name, source="onnx", nodes=self.nodes, params=self.params.values())

    @staticmethod
    def _value_inputs(onode: onnx.NodeProto) -> list[str]:
        positions = _VALUE_INPUTS.get(onode.op_type)
        values = list(onode.input) if positions is None else [onode.input[i] for i in positions
                                                               if i < len(onode.input)]
        return [v for v in values if v]

    def _is_static(self, onode: onnx.NodeProto) -> bool:
        return all(v in self.static_deps for v in self._value_inputs(onode))

    def _fold(self, onode: onnx.NodeProto) -> None:
        """A static node: its outputs carry the parameters they derive from, not a node."""
        inputs = self._value_inputs(onode)
        deps = frozenset().union(*(self.static_deps[v] for v in inputs))
        grad = any(self.requires_grad.get(v, False) for v in inputs)
        for out in onode.output:
            if out:
                self.static_deps[out] = deps
                self.requires_grad[out] = grad and (self._meta(out) or _NO_META).dtype in _FLOATING

    def _add(self, onode: onnx.NodeProto, index: int) -> None:
        name = self._unique(onode.name or f"{onode.op_type}_{index}")
        live_inputs = [v for v in onode.input if v and v not in self.static_deps]
        params = sorted({p for v in onode.input if v in self.static_deps for p in self.static_deps[v]},
                        key=list(self.params).index)
        outs = [v for v in onode.output if v]
        metas = tuple(self._output_meta(onode, v) for v in outs)
        in_shapes = [m.shape if (m := self._meta(v)) is not None else None for v in onode.input if v]
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in onode.attribute}
        fwd = onnx_fwd_flops(onode.op_type, in_shapes, [m.shape for m in metas], attrs)
        grads = [self.requires_grad.get(v, False) for v in onode.input if v]
        is_view = onode.op_type in ONNX_VIEW_OPS
        path = _module_path(onode) or self._inherited_path(live_inputs)
        self.nodes.append(Node(
            name=name, op=onode.op_type, kind="compute", module_path=path,
            inputs=tuple(dict.fromkeys(self.producer[v] for v in live_inputs if v in self.producer)),
            outputs=metas,
            param_names=tuple(params), fwd_flops=0 if is_view else fwd,
            bwd_flops=0 if is_view else onnx_bwd_flops(onode.op_type, fwd, grad_inputs=grads),
            is_view=is_view))
        for v, meta in zip(outs, metas):
            self.producer[v] = name
            self.requires_grad[v] = any(grads) and meta.dtype in _FLOATING
            self.path_of_value[v] = path

    def _output_meta(self, onode: onnx.NodeProto, value: str) -> TensorMeta:
        if onode.op_type == "SplitToSequence" and self._meta(onode.input[0]) is not None:
            return self._static_meta(onode.input[0])  # the sequence covers its whole input
        return self._static_meta(value)

    def _inherited_path(self, live_inputs: Sequence[str]) -> str:
        """Nodes without metadata (added by an optimizer) sit in their first input's module."""
        return next((self.path_of_value[v] for v in live_inputs if self.path_of_value.get(v)), "")

    def _unique(self, name: str) -> str:
        candidate, k = name, 1
        while candidate in self.used_names:
            candidate, k = f"{name}_{k}", k + 1
        self.used_names.add(candidate)
        return candidate


_NO_META = TensorMeta(shape=(), dtype="int64")


def _dtype(elem_type: int, value: str) -> str:
    dtype = _ONNX_DTYPES.get(elem_type)
    if dtype is None or dtype not in DTYPE_BYTES:
        raise InvalidInputError(f"ONNX value {value!r}", expected=f"one of the dtypes {sorted(_ONNX_DTYPES.values())}",
                                found=onnx.TensorProto.DataType.Name(elem_type) if elem_type in
                                onnx.TensorProto.DataType.values() else str(elem_type))
    return dtype


def _module_path(onode: onnx.NodeProto) -> str:
    """``layers.0.attn.qkv`` from the dynamo ``namespace`` metadata or a TorchScript-style node name."""
    meta = {p.key: p.value for p in onode.metadata_props}
    namespace = meta.get("namespace")
    if namespace:
        # ": GPT/layers.0: Block/layers.0.attn: Attn/linear: aten.linear.default" -> modules, then the fx node.
        scopes = namespace.split("/")
        return scopes[-2].split(":")[0].strip() if len(scopes) >= 2 else ""
    if onode.name.startswith("/") and onode.name.count("/") >= 2:
        return ".".join(s for s in onode.name.strip("/").split("/")[:-1] if s)
    return ""


# --- export ---------------------------------------------------------------------
def export_onnx(model: Any, example_inputs: Any, path: str | os.PathLike[str]) -> Path:
    """Export ``model`` (real weights, e.g. CPU) to ``path`` with weights as external data.

    Uses ``torch.onnx.export(dynamo=True, optimize=False)``: the optimizer would
    fold weight transposes into new, renamed initializers and merge identical
    ones (all LayerNorm weights start as ones), so parameter names and counts
    would no longer match the PyTorch model. Writes to a temporary folder beside
    ``path`` and moves the files into place (data first, graph last), so a
    failed export never leaves a half-written model.
    """
    import torch  # heavy; only this function needs it

    target = Path(path)
    if not target.parent.is_dir():
        raise InvalidInputError(f"output path {str(target)!r}", expected="a file in an existing folder",
                                found=f"no folder {str(target.parent)!r}", fix="create the folder first")
    if any(t.device.type == "meta" for t in list(model.parameters()) + list(model.buffers())):
        raise InvalidInputError("model to export", expected="real weights (CPU or GPU)", found="meta tensors",
                                fix="build it with build_model(spec, device='cpu')")
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        staged = tmp / target.name
        training = model.training
        model.eval()  # an ONNX file is for inference: dropout (GPT-2's) would make every run of it random
        try:
            _quiet_export(lambda: torch.onnx.export(model, inputs, str(staged), dynamo=True, external_data=True,
                                                    optimize=False, verbose=False), model)
        finally:
            model.train(training)
        for f in sorted(tmp.iterdir(), key=lambda p: p.name == target.name):  # graph file last
            os.replace(f, target.parent / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _quiet_export(export: Any, model: Any) -> None:
    """Run the exporter without its warnings and log lines (e.g. "torchvision is not installed")."""
    onnx_log = logging.getLogger("torch.onnx")
    level = onnx_log.level
    onnx_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            export()
    except (RuntimeError, TypeError, ValueError, NotImplementedError, AssertionError) as exc:
        raise TraceError(f"cannot export {type(model).__name__} to ONNX",
                         expected="a model torch.onnx.export(dynamo=True) supports",
                         found=(str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]) from None
    finally:
        onnx_log.setLevel(level)
