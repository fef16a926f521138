"""The graph IR: a traced model as a DAG of ops, and its coarsened chain of blocks.

Both frontends (``planner.trace`` for PyTorch, ``planner.onnx_import`` for ONNX)
produce a :class:`Graph`; ``planner.coarsen`` turns it into a :class:`BlockChain`,
the unit the cost models and the solver work on.

Parameters are not nodes: each compute node lists the parameters (and buffers)
it reads, so a parameter never looks like an activation crossing a cut.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import networkx as nx

from planner.errors import InvalidInputError

NodeKind = Literal["input", "compute", "output"]

DTYPE_BYTES: Mapping[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "complex64": 8,
}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name such as ``float32`` (``torch.`` prefix allowed)."""
    key = dtype.removeprefix("torch.").lower()
    if key not in DTYPE_BYTES:
        raise InvalidInputError(f"unknown dtype {dtype!r}", expected=f"one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[key]


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorMeta:
    """Shape and dtype of one tensor; ``nbytes`` is derived."""

    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if any((not isinstance(d, int)) or d < 0 for d in self.shape):
            raise InvalidInputError("tensor shape", expected="non-negative ints", found=repr(self.shape))
        dtype_bytes(self.dtype)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_bytes(self.dtype)


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamInfo:
    """A parameter or buffer of the model (``trainable`` False for buffers)."""

    name: str
    meta: TensorMeta
    trainable: bool = True

    @property
    def nbytes(self) -> int:
        return self.meta.nbytes


@dataclass(frozen=True, slots=True, kw_only=True)
class Node:
    """One op of the traced graph.

    ``inputs`` are the names of producer nodes, in argument order (with
    repetition removed). ``is_view`` marks ops whose output aliases an input
    (reshape, transpose, slicing): they allocate no activation memory.
    ``random_op`` names the op where it draws random numbers as traced
    (``planner.random_ops``: a dropout in training, a sampler), else ``""``.
    ``bwd_input_flops``: of ``bwd_flops``, those that produce the gradients of
    its activation inputs, not of its weights (``planner.flops``: a linear
    layer's half, a weightless op's all); None where not recorded.
    """

    name: str
    op: str
    kind: NodeKind = "compute"
    module_path: str = ""
    inputs: tuple[str, ...] = ()
    outputs: tuple[TensorMeta, ...] = ()
    param_names: tuple[str, ...] = ()
    fwd_flops: int = 0
    bwd_flops: int = 0
    is_view: bool = False
    random_op: str = ""
    bwd_input_flops: int | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise InvalidInputError("node name", expected="a non-empty string", found=repr(self.name))
        if self.fwd_flops < 0 or self.bwd_flops < 0:
            raise InvalidInputError(f"flops of node {self.name}", expected=">= 0",
                                    found=f"{self.fwd_flops}/{self.bwd_flops}")
        if self.bwd_input_flops is not None and not 0 <= self.bwd_input_flops <= self.bwd_flops:
            raise InvalidInputError(f"input-gradient flops of node {self.name}", expected=f"0 to {self.bwd_flops}",
                                    found=str(self.bwd_input_flops))

    @property
    def out_bytes(self) -> int:
        return sum(t.nbytes for t in self.outputs)


class Graph:
    """A traced model: nodes in topological order over a networkx DiGraph.

    Edges go producer -> consumer. The node order given at construction must
    be topological (the frontends emit it that way); it is the order
    coarsening walks.
    """

    def __init__(self, *, name: str, source: str, nodes: Sequence[Node],
                 params: Iterable[ParamInfo] = ()) -> None:
        self.name = name
        self.source = source
        self._params: dict[str, ParamInfo] = {p.name: p for p in params}
        self._order: tuple[str, ...] = tuple(n.name for n in nodes)
        self._dg = nx.DiGraph()
        seen: set[str] = set()
        for node in nodes:
            if node.name in seen:
                raise InvalidInputError(f"graph {name}: duplicate node {node.name!r}")
            for src in node.inputs:
                if src not in seen:
                    raise InvalidInputError(
                        f"graph {name}: node {node.name!r} reads {src!r}",
                        expected="producers listed before their consumers (topological order)",
                        found=f"{src!r} missing or later")
            for p in node.param_names:
                if p not in self._params:
                    raise InvalidInputError(f"graph {name}: node {node.name!r} uses unknown parameter {p!r}")
            self._dg.add_node(node.name, node=node)
            for src in node.inputs:
                self._dg.add_edge(src, node.name)
            seen.add(node.name)

    # --- structure -------------------------------------------------------
    @property
    def dag(self) -> nx.DiGraph:
        """The underlying networkx graph (read it, do not mutate it)."""
        return self._dg

    @property
    def order(self) -> tuple[str, ...]:
        return self._order

    def nodes(self) -> tuple[Node, ...]:
        return tuple(self._dg.nodes[n]["node"] for n in self._order)

    def node(self, name: str) -> Node:
        try:
            return self._dg.nodes[name]["node"]
        except KeyError:
            raise InvalidInputError(f"graph {self.name}: no node named {name!r}") from None

    def successors(self, name: str) -> tuple[str, ...]:
        return tuple(self._dg.successors(name))

    def predecessors(self, name: str) -> tuple[str, ...]:
        return tuple(self._dg.predecessors(name))

    def __len__(self) -> int:
        return len(self._order)

    @property
    def params(self) -> Mapping[str, ParamInfo]:
        return dict(self._params)

    def inputs(self) -> tuple[Node, ...]:
        return tuple(n for n in self.nodes() if n.kind == "input")

    def outputs(self) -> tuple[Node, ...]:
        return tuple(n for n in self.nodes() if n.kind == "output")

    # --- totals ----------------------------------------------------------
    @property
    def fwd_flops(self) -> int:
        return sum(n.fwd_flops for n in self.nodes())

    @property
    def bwd_flops(self) -> int:
        return sum(n.bwd_flops for n in self.nodes())

    @property
    def param_count(self) -> int:
        return sum(p.meta.numel for p in self._params.values() if p.trainable)

    @property
    def param_bytes(self) -> int:
        return sum(p.nbytes for p in self._params.values() if p.trainable)

    @property
    def buffer_bytes(self) -> int:
        return sum(p.nbytes for p in self._params.values() if not p.trainable)

    def fingerprint(self) -> str:
        """SHA-256 of the structure: nodes, ops, edges, output shapes, parameter shapes.

        Two traces of the same model at the same input shapes agree; any change
        of architecture, size or input shape changes it.
        """
        payload = {
            "nodes": [[n.name, n.op, list(n.inputs), [[list(t.shape), t.dtype] for t in n.outputs],
                       list(n.param_names)] for n in self.nodes()],
            "params": sorted([p.name, list(p.meta.shape), p.meta.dtype, p.trainable]
                             for p in self._params.values()),
        }
        blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()


@dataclass(frozen=True, slots=True, kw_only=True)
class Block:
    """A contiguous run of nodes between two cut points, with its totals.

    ``out_bytes`` is what crosses the block's right edge per microbatch (the
    activation sent forward, and the same size of gradient sent back);
    ``boundary_nodes`` names the producers of those tensors. ``saved_act_bytes``
    is what one microbatch keeps alive for the backward pass.
    ``mem_traffic_bytes`` is the bytes the block's ops read and write (for a
    roofline estimate). ``random_ops``: the ops of the block that draw random
    numbers (``Node.random_op``), whose stage an audit cannot recompute; empty
    also where nobody looked (a chain or plan written before the field), so
    the runtime's own check on the stage's graph stays the last word.
    """

    index: int
    name: str
    node_names: tuple[str, ...]
    module_paths: tuple[str, ...]
    param_names: tuple[str, ...]
    fwd_flops: int
    bwd_flops: int
    param_count: int
    param_bytes: int
    saved_act_bytes: int
    out_bytes: int
    boundary_nodes: tuple[str, ...]
    mem_traffic_bytes: int = 0
    random_ops: tuple[str, ...] = ()
    bwd_input_flops: int | None = None   # of bwd_flops, the activations' gradients' (Node.bwd_input_flops); None: unknown

    def __post_init__(self) -> None:
        for f in ("fwd_flops", "bwd_flops", "param_count", "param_bytes", "saved_act_bytes",
                  "out_bytes", "mem_traffic_bytes"):
            if getattr(self, f) < 0:
                raise InvalidInputError(f"block {self.name}.{f}", expected=">= 0", found=str(getattr(self, f)))
        if self.bwd_input_flops is not None and not 0 <= self.bwd_input_flops <= self.bwd_flops:
            raise InvalidInputError(f"block {self.name}.bwd_input_flops", expected=f"0 to {self.bwd_flops}",
                                    found=str(self.bwd_input_flops))
        if not self.node_names:
            raise InvalidInputError(f"block {self.name}", expected="at least one node", found="none")
        if not all(isinstance(op, str) and op for op in self.random_ops):
            raise InvalidInputError(f"block {self.name}.random_ops", expected="op names (non-empty strings)",
                                    found=repr(self.random_ops))


@dataclass(frozen=True, slots=True, kw_only=True)
class TiedParam:
    """A parameter read by more than one block (e.g. a tied embedding / LM head)."""

    name: str
    blocks: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockChain:
    """The coarsened model: a chain of blocks in execution order.

    ``input_bytes`` is the size of the model input per microbatch (what the
    first stage receives); ``microbatch_size`` is the batch the graph was
    traced at, so every per-block figure is per microbatch. A tied parameter
    is counted in the ``param_bytes`` of the first block that reads it only.
    """

    model_name: str
    fingerprint: str
    blocks: tuple[Block, ...]
    input_bytes: int
    microbatch_size: int
    tied_params: tuple[TiedParam, ...] = ()
    meta: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.blocks:
            raise InvalidInputError(f"block chain of {self.model_name}", expected="at least one block", found="none")
        for i, b in enumerate(self.blocks):
            if b.index != i:
                raise InvalidInputError(f"block {b.name}", expected=f"index {i}", found=str(b.index))

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def fwd_flops(self) -> int:
        return sum(b.fwd_flops for b in self.blocks)

    @property
    def bwd_flops(self) -> int:
        return sum(b.bwd_flops for b in self.blocks)

    @property
    def param_bytes(self) -> int:
        return sum(b.param_bytes for b in self.blocks)

    @property
    def param_count(self) -> int:
        return sum(b.param_count for b in self.blocks)
