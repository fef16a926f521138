"""Build the graph IR from a shape-inferred ONNX graph: static values folded into parameters, module paths kept."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import onnx

from planner.errors import InvalidInputError
from planner.flops import (
    ONNX_VIEW_OPS,
    onnx_bwd_flops,
    onnx_bwd_input_flops,
    onnx_fwd_flops,
)
from planner.ir import DTYPE_BYTES, Graph, Node, ParamInfo, TensorMeta

__all__ = ["Importer"]

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


class Importer:
    """One ONNX graph walked in order: its value types and parameters first, then an IR node per live op."""

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
        weights = [v in self.static_deps for v in onode.input if v]   # parameter-derived operands
        is_view = onode.op_type in ONNX_VIEW_OPS
        path = _module_path(onode) or self._inherited_path(live_inputs)
        self.nodes.append(Node(
            name=name, op=onode.op_type, kind="compute", module_path=path,
            inputs=tuple(dict.fromkeys(self.producer[v] for v in live_inputs if v in self.producer)),
            outputs=metas,
            param_names=tuple(params), fwd_flops=0 if is_view else fwd,
            bwd_flops=0 if is_view else onnx_bwd_flops(onode.op_type, fwd, grad_inputs=grads),
            is_view=is_view,
            bwd_input_flops=0 if is_view else onnx_bwd_input_flops(onode.op_type, fwd, grad_inputs=grads,
                                                                  weight_inputs=weights)))
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
