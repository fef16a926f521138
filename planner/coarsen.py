"""Coarsen a traced :class:`~planner.ir.Graph` into a :class:`~planner.ir.BlockChain`.

Cut points. We walk the graph's topological order; a *position* is the gap
after one node. The tensors crossing a position are the outputs of earlier
nodes that a later node still reads. Parameters and buffers never count (they
are not nodes), and neither do *input-independent* tensors (computed from
parameters, buffers or constants only, e.g. rotary tables sliced from a buffer
or a causal mask): they bind no cut to a place. Views are counted once with the
tensor they alias. A position is a *legal cut* when the number of crossing
tensors is the minimum over all positions that have real work on both sides
(for a transformer: the residual stream alone). A skip connection that spans
several layers keeps two tensors alive across them, so no cut falls inside it.

Granularity:

- ``"fine"``: every legal cut.
- ``"layer"``: the legal cuts where the top-level *unit* changes. The unit of a
  node is its module path up to and including the first numeric component
  (``layers.3.attn.qkv`` -> ``layers.3``, ``transformer.h.7.mlp`` ->
  ``transformer.h.7``); without one, the shortest prefix that is not a
  container of numbered units (``embed.tok`` -> ``embed``, ``transformer.wte``
  -> ``transformer.wte``, ``head.proj`` -> ``head``). Nodes in top-level glue
  code (empty path, or a container's own forward) belong to no unit and join
  the block before them. For the GPT/Llama presets this gives ``embed``,
  ``layers.0`` ... ``layers.N-1``, ``head``.

Block totals: FLOPs are sums over nodes; a parameter read by several blocks is
counted in the first and listed in ``tied_params``; ``saved_act_bytes`` and
``mem_traffic_bytes`` are estimates explained where they are computed (a
gather such as an embedding lookup reads only the rows it selects).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from planner.errors import InvalidInputError
from planner.ir import Block, BlockChain, Graph, Node, TiedParam

Granularity = Literal["layer", "fine"]
GRANULARITIES: tuple[str, ...] = ("layer", "fine")
CHAIN_FORMAT_VERSION = 1


def coarsen(graph: Graph, *, granularity: Granularity = "layer",
            microbatch_size: int | None = None) -> BlockChain:
    """Cut ``graph`` into a chain of blocks (see the module docstring for the rules).

    ``microbatch_size`` is the batch the graph was traced at; by default the first
    dimension of the first model input.
    """
    if granularity not in GRANULARITIES:
        raise InvalidInputError("granularity", expected=" or ".join(GRANULARITIES), found=repr(granularity),
                                fix="use --granularity layer (one block per module unit) or fine")
    liveness = _Liveness(graph)
    legal = liveness.legal_cuts()
    cuts = legal if granularity == "fine" else _unit_cuts(graph, legal)
    segments = _segments(len(graph.order), _drop_idle_cuts(graph, liveness, cuts))
    blocks = _blocks(graph, liveness, segments, granularity)
    return BlockChain(
        model_name=graph.name, fingerprint=graph.fingerprint(), blocks=tuple(blocks),
        input_bytes=sum(n.out_bytes for n in graph.inputs()),
        microbatch_size=microbatch_size if microbatch_size is not None else _batch_of(graph),
        tied_params=_tied(graph, blocks),
        meta=(("granularity", granularity), ("source", graph.source), ("nodes", str(len(graph))),
              ("crossing_tensors_at_cuts", str(liveness.minimum))))


# --- liveness -------------------------------------------------------------------
class _Liveness:
    """Which tensors cross each position of the topological order."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.order = graph.order
        self.index = {name: i for i, name in enumerate(self.order)}
        nodes = graph.nodes()
        self.root = _view_roots(nodes)
        self.dependent = _input_dependent(graph)
        # last_use[i]: index of the last consumer of node i (i itself if none).
        self.last_use = [max((self.index[s] for s in graph.successors(n.name)), default=i)
                         for i, n in enumerate(nodes)]
        self.is_tensor = [bool(n.outputs) for n in nodes]
        self.counts = self._crossing_counts()
        self.candidates = self._candidate_positions(nodes)
        self.minimum = min((self.counts[p] for p in self.candidates), default=0)

    def _crossing_counts(self) -> list[int]:
        """Number of distinct input-dependent storages (view roots) crossing each position."""
        n = len(self.order)
        span: dict[str, tuple[int, int]] = {}
        for i, name in enumerate(self.order):
            if not self.is_tensor[i] or self.last_use[i] <= i or name not in self.dependent:
                continue
            root = self.root[name]
            lo, hi = span.get(root, (self.index[root], self.last_use[i]))
            span[root] = (min(lo, i), max(hi, self.last_use[i]))
        diff = [0] * (n + 1)
        for lo, hi in span.values():  # live across positions lo .. hi-1
            diff[lo] += 1
            diff[hi] -= 1
        counts, running = [], 0
        for p in range(n):
            running += diff[p]
            counts.append(running)
        return counts

    def _candidate_positions(self, nodes: Sequence[Node]) -> list[int]:
        """Positions with input-dependent compute on both sides (no empty or constant-only blocks)."""
        real = [i for i, n in enumerate(nodes) if n.kind == "compute" and n.name in self.dependent]
        if len(real) < 2:
            return []
        return list(range(real[0], real[-1]))

    def legal_cuts(self) -> list[int]:
        return [p for p in self.candidates if self.counts[p] == self.minimum]

    def crossing(self, position: int) -> tuple[list[str], int]:
        """Producers of the tensors crossing ``position`` and their bytes (a view counted once with its root)."""
        by_root: dict[str, list[str]] = {}
        for i in range(position + 1):
            if self.is_tensor[i] and self.last_use[i] > position:
                name = self.order[i]
                by_root.setdefault(self.root[name], []).append(name)
        names: list[str] = []
        total = 0
        for root, members in by_root.items():
            if root in members:
                names.append(root)
                total += self.graph.node(root).out_bytes
            else:  # only views of it cross: send those (never more than the whole storage)
                names.extend(members)
                total += min(sum(self.graph.node(m).out_bytes for m in members), self.graph.node(root).out_bytes)
        names.sort(key=self.index.__getitem__)
        return names, total


def _view_roots(nodes: Sequence[Node]) -> dict[str, str]:
    """Each node's storage root: a view's root is its first input's root."""
    root: dict[str, str] = {}
    for n in nodes:
        root[n.name] = root[n.inputs[0]] if n.is_view and n.inputs else n.name
    return root


def _input_dependent(graph: Graph) -> set[str]:
    """Nodes whose values depend on a model input (descendants of the input nodes)."""
    seen: set[str] = set()
    stack = [n.name for n in graph.inputs()]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        stack.extend(graph.successors(name))
    return seen


# --- units and cuts -------------------------------------------------------------
def _unit_cuts(graph: Graph, legal: Sequence[int]) -> list[int]:
    """Legal cuts where the unit changes; of several between the same two units, the last."""
    nodes = graph.nodes()
    unit_of = module_units(n.module_path for n in nodes)
    units = [unit_of.get(n.module_path, "") if n.kind == "compute" else "" for n in nodes]
    before, current = [], ""
    for u in units:
        current = u or current
        before.append(current)
    after, current = [""] * len(units), ""
    for i in range(len(units) - 1, -1, -1):
        after[i] = current
        current = units[i] or current
    chosen: dict[int, int] = {}  # start of the next unit -> cut
    for p in legal:
        if before[p] and after[p] and before[p] != after[p]:
            # One cut per unit change: the last legal gap before the next unit starts.
            chosen[_first_unit_start(units, p)] = p
    return sorted(chosen.values())


def _first_unit_start(units: Sequence[str], position: int) -> int:
    for i in range(position + 1, len(units)):
        if units[i]:
            return i
    return len(units)


def module_units(paths: Iterable[str]) -> dict[str, str]:
    """Map each module path to its unit (module docstring); glue paths map to ``""``.

    The numbered containers are those whose index sits at the shallowest depth
    of any numeric path component (``layers`` in ``layers.3``, ``transformer.h``
    in ``transformer.h.7``); deeper numbering (``stem.conv.0``, an
    ``nn.Sequential`` inside a layer) does not make units of its own.
    """
    paths = [p for p in dict.fromkeys(paths) if p]
    depth_of = {p: next((i for i, part in enumerate(p.split(".")) if part.isdigit()), None) for p in paths}
    depths = [d for d in depth_of.values() if d is not None]
    top = min(depths) if depths else None
    containers = {".".join(p.split(".")[:top]) for p, d in depth_of.items() if d is not None and d == top}
    container_prefixes = {".".join(c.split(".")[:j]) for c in containers for j in range(len(c.split(".")) + 1)}
    units: dict[str, str] = {}
    for p in paths:
        parts = p.split(".")
        if top is not None and len(parts) > top and parts[top].isdigit() and ".".join(parts[:top]) in containers:
            units[p] = ".".join(parts[:top + 1])
            continue
        prefixes = [".".join(parts[:j]) for j in range(1, len(parts) + 1)]
        units[p] = next((q for q in prefixes if q not in container_prefixes), "")
    return units


def _drop_idle_cuts(graph: Graph, liveness: _Liveness, cuts: Sequence[int]) -> list[int]:
    """Keep only cuts that leave real work (an input-dependent, non-view op) on each side.

    Without this, "fine" would make blocks of a lone view or of constant setup
    (an ``arange``), which no stage wants on its own.
    """
    nodes = graph.nodes()
    work = [n.kind == "compute" and not n.is_view and n.name in liveness.dependent for n in nodes]
    kept: list[int] = []
    start = 0
    for p in sorted(cuts):
        if any(work[start:p + 1]):
            kept.append(p)
            start = p + 1
    while kept and not any(work[kept[-1] + 1:]):
        kept.pop()  # the tail after the last cut does no work: merge it into the block before
    return kept


def _segments(n: int, cuts: Sequence[int]) -> list[range]:
    bounds = [-1, *sorted(cuts), n - 1]
    return [range(bounds[k] + 1, bounds[k + 1] + 1) for k in range(len(bounds) - 1)]


# --- blocks -----------------------------------------------------------------------
def _blocks(graph: Graph, liveness: _Liveness, segments: Sequence[range], granularity: str) -> list[Block]:
    nodes = graph.nodes()
    unit_of = module_units(n.module_path for n in nodes)
    owner = _param_owner(graph, nodes, segments)
    names = _block_names([[unit_of.get(nodes[i].module_path, "") for i in seg] for seg in segments])
    blocks = []
    for k, seg in enumerate(segments):
        members = [nodes[i] for i in seg]
        if k == len(segments) - 1:
            out_nodes = [src for n in members if n.kind == "output" for src in n.inputs]
            out_bytes = sum(graph.node(s).out_bytes for s in out_nodes)
        else:
            out_nodes, out_bytes = liveness.crossing(seg[-1])
        read = tuple(dict.fromkeys(p for n in members for p in n.param_names))
        owned = [graph.params[p] for p, b in owner.items() if b == k and graph.params[p].trainable]
        blocks.append(Block(
            index=k, name=names[k], node_names=tuple(n.name for n in members),
            module_paths=tuple(dict.fromkeys(n.module_path for n in members if n.module_path)),
            param_names=read,
            fwd_flops=sum(n.fwd_flops for n in members), bwd_flops=sum(n.bwd_flops for n in members),
            param_count=sum(p.meta.numel for p in owned), param_bytes=sum(p.nbytes for p in owned),
            saved_act_bytes=_saved_bytes(members), out_bytes=out_bytes, boundary_nodes=tuple(out_nodes),
            mem_traffic_bytes=_traffic_bytes(graph, members),
            random_ops=tuple(dict.fromkeys(n.random_op for n in members if n.random_op)),
            bwd_input_flops=input_grad_flops(members)))
    return blocks


def input_grad_flops(members: Sequence[Node]) -> int | None:
    """Of ``members``' backward FLOPs, those producing the gradients of activations rather than of weights
    (``Node.bwd_input_flops``: what an audit recomputing the block's input gradient alone runs); None where a node
    with a backward recorded no split."""
    if any(n.bwd_flops and n.bwd_input_flops is None for n in members):
        return None
    return sum(n.bwd_input_flops or 0 for n in members)


def _saved_bytes(members: Sequence[Node]) -> int:
    """Activation bytes one microbatch keeps for backward: outputs of non-view compute nodes.

    An honest upper-ish estimate: autograd saves roughly each intermediate once
    (matmul inputs, norm inputs, activation inputs). It overcounts outputs nobody
    saves (a residual add's result is saved only as the next op's input, which is
    the same tensor) and undercounts small extras (norm statistics, softmax
    log-sum-exp, dropout masks). Views alias their base and add nothing.
    """
    return sum(n.out_bytes for n in members if n.kind == "compute" and not n.is_view)


def _traffic_bytes(graph: Graph, members: Sequence[Node]) -> int:
    """Bytes the block's ops read and write: inputs + parameters + outputs of each non-view op.

    Views move no data. A roofline estimate that assumes no reuse between ops
    through caches, which is right for tensors larger than the cache.
    """
    return sum(op_traffic_bytes(graph, n) for n in members if n.kind == "compute" and not n.is_view)


# Ops that read only the rows their indices select from a table (torch.export, torch.fx and
# ONNX spellings): counting the whole table would grossly over-predict a lookup's traffic.
GATHER_OPS = frozenset({"embedding", "Embedding", "index_select", "gather", "index", "take",
                        "Gather", "GatherElements", "GatherND"})


def _op_base(op: str) -> str:
    """``aten.embedding.default`` -> ``embedding``; ``_VariableFunctionsClass.gather`` (torch.fx) -> ``gather``."""
    return op.split(".")[1] if op.startswith("aten.") else op.rsplit(".", 1)[-1]


def _is_floating(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat", "complex"))


def op_traffic_bytes(graph: Graph, node: Node) -> int:
    """Bytes one op reads and writes: its output, its inputs and the parameters it reads.

    A gather (:data:`GATHER_OPS`) reads its index operands in full but, from its
    floating-point tables (embedding weights, the tensor an ``index_select``
    picks from), only the selected rows: the bytes of its output.
    """
    operands = [(graph.node(s).out_bytes, all(_is_floating(t.dtype) for t in graph.node(s).outputs))
                for s in node.inputs]
    operands += [(graph.params[p].nbytes, _is_floating(graph.params[p].meta.dtype)) for p in node.param_names]
    if _op_base(node.op) not in GATHER_OPS:
        return node.out_bytes + sum(nbytes for nbytes, _ in operands)
    tables = sum(nbytes for nbytes, floating in operands if floating)
    indices = sum(nbytes for nbytes, floating in operands if not floating)
    return node.out_bytes + min(tables, node.out_bytes) + indices


def _param_owner(graph: Graph, nodes: Sequence[Node], segments: Sequence[range]) -> dict[str, int]:
    """The block that counts each parameter: the first that reads it (unread ones: block 0)."""
    owner: dict[str, int] = {}
    for k, seg in enumerate(segments):
        for i in seg:
            for p in nodes[i].param_names:
                owner.setdefault(p, k)
    for p in graph.params:
        owner.setdefault(p, 0)  # in the state dict but read by no op: someone must hold it
    return owner


def _tied(graph: Graph, blocks: Sequence[Block]) -> tuple[TiedParam, ...]:
    readers: dict[str, list[int]] = {}
    for b in blocks:
        for p in b.param_names:
            readers.setdefault(p, []).append(b.index)
    return tuple(TiedParam(name=p, blocks=tuple(ks), nbytes=graph.params[p].nbytes)
                 for p, ks in readers.items() if len(ks) > 1)


def _block_names(units_per_block: Sequence[Sequence[str]]) -> list[str]:
    """``layers.3``; ``layers.1..layers.3`` when a block spans units; ``.partK`` for repeats."""
    names = []
    for k, units in enumerate(units_per_block):
        distinct = list(dict.fromkeys(u for u in units if u))
        if not distinct:
            names.append(f"block{k}")
        elif len(distinct) == 1:
            names.append(distinct[0])
        else:
            names.append(f"{distinct[0]}..{distinct[-1]}")
    counts: dict[str, int] = {}
    for n in names:
        counts[n] = counts.get(n, 0) + 1
    seen: dict[str, int] = {}
    out = []
    for n in names:
        if counts[n] > 1:
            out.append(f"{n}.part{seen.get(n, 0)}")
            seen[n] = seen.get(n, 0) + 1
        else:
            out.append(n)
    return out


def _batch_of(graph: Graph) -> int:
    for n in graph.inputs():
        if n.outputs and n.outputs[0].shape:
            return n.outputs[0].shape[0]
    return 1


# --- JSON ----------------------------------------------------------------------------
_BLOCK_INT_FIELDS = ("index", "fwd_flops", "bwd_flops", "param_count", "param_bytes", "saved_act_bytes",
                     "out_bytes", "mem_traffic_bytes")
_BLOCK_TUPLE_FIELDS = ("node_names", "module_paths", "param_names", "boundary_nodes")


def chain_to_dict(chain: BlockChain) -> dict[str, Any]:
    """A JSON-ready dict (lists for tuples); :func:`chain_from_dict` reads it back exactly."""
    return {
        "format_version": CHAIN_FORMAT_VERSION,
        "model_name": chain.model_name, "fingerprint": chain.fingerprint,
        "input_bytes": chain.input_bytes, "microbatch_size": chain.microbatch_size,
        "blocks": [{"name": b.name, **{f: getattr(b, f) for f in _BLOCK_INT_FIELDS},
                    **{f: list(getattr(b, f)) for f in _BLOCK_TUPLE_FIELDS},
                    "random_ops": list(b.random_ops),
                    **({} if b.bwd_input_flops is None else {"bwd_input_flops": b.bwd_input_flops})}
                   for b in chain.blocks],
        "tied_params": [{"name": t.name, "blocks": list(t.blocks), "nbytes": t.nbytes} for t in chain.tied_params],
        "meta": {k: v for k, v in chain.meta},
    }


def _op_names(value: Any, block: Any) -> tuple[str, ...]:
    """A block's ``random_ops`` as read from a file: a list of op names (``Block`` refuses empty ones)."""
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise InvalidInputError(f"block {block} random_ops", expected="a list of op names", found=repr(value)[:80],
                                fix="re-run `stagewise trace --json`")
    return tuple(value)


def chain_from_dict(data: Mapping[str, Any]) -> BlockChain:
    """Inverse of :func:`chain_to_dict`; raises :class:`InvalidInputError` on a malformed dict."""
    try:
        version = data.get("format_version", CHAIN_FORMAT_VERSION)
        if version != CHAIN_FORMAT_VERSION:
            raise InvalidInputError("block chain format_version", expected=str(CHAIN_FORMAT_VERSION),
                                    found=repr(version), fix="re-run `stagewise trace --json` with this version")
        blocks = tuple(Block(name=str(b["name"]), **{f: int(b.get(f, 0)) for f in _BLOCK_INT_FIELDS},
                             **{f: tuple(str(x) for x in b[f]) for f in _BLOCK_TUPLE_FIELDS},
                             # absent before the field: nothing known random (the runtime checks each stage)
                             random_ops=_op_names(b.get("random_ops", []), b["name"]),
                             # absent before the field: no split known (the price's constant)
                             bwd_input_flops=None if b.get("bwd_input_flops") is None
                             else int(b["bwd_input_flops"]))
                       for b in data["blocks"])
        tied = tuple(TiedParam(name=str(t["name"]), blocks=tuple(int(x) for x in t["blocks"]),
                               nbytes=int(t["nbytes"])) for t in data.get("tied_params", ()))
        return BlockChain(model_name=str(data["model_name"]), fingerprint=str(data["fingerprint"]),
                          blocks=blocks, input_bytes=int(data["input_bytes"]),
                          microbatch_size=int(data["microbatch_size"]), tied_params=tied,
                          meta=tuple((str(k), str(v)) for k, v in dict(data.get("meta", {})).items()))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise InvalidInputError("block chain dict", expected="the output of chain_to_dict",
                                found=f"{type(exc).__name__}: {exc}") from None

