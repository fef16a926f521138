"""Read an ONNX file's graph (weights stay on disk): it must be a model, and its external-data files whole."""
from __future__ import annotations

from pathlib import Path

import onnx
from google.protobuf.message import DecodeError
from onnx import external_data_helper

from planner.errors import InvalidInputError

__all__ = ["check_external_data", "read_onnx"]


def read_onnx(path: Path) -> onnx.ModelProto:
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
