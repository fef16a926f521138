"""Build one rank's pipeline stage from a plan: split the exported graph by node names.

The planner traced the model with ``torch.export`` under fake tensors; the
node names of that graph are what the plan stores per stage. Here the real
model is exported again at the same (microbatch) shapes, which yields the same
node names, and the graph is cut into one ``torch.fx.GraphModule`` per stage.

A stage module reads its parameters and buffers through ``get_attr`` nodes
whose targets are the original fully qualified names (``layers.0.attn.qkv.weight``),
bound to the very tensors of the full model: gradients can be compared with an
unpipelined reference by name, and in-place buffer updates (BatchNorm running
stats) land in the model's own buffers.

Values that cross a cut are computed generally: stage ``k`` receives every
value defined before it and read by it or any later stage, so a tensor that
skips a stage is passed through it rather than lost.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from planner.errors import InvalidInputError, PlanMismatchError
from planner.plan import Plan
from planner.trace import graph_from_exported

# Sentinel stage index of the model's user inputs: "defined before stage 0".
INPUT_STAGE = -1


@dataclass(frozen=True, slots=True, kw_only=True)
class ValueSpec:
    """A tensor crossing a stage edge: its graph name, static shape and dtype.

    ``carries_grad`` is True when the value depends on a trainable parameter
    through differentiable ops, so a gradient flows back across the edge.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    carries_grad: bool

    def __post_init__(self) -> None:
        if any(d < 0 for d in self.shape):
            raise InvalidInputError(f"value {self.name} shape", expected="non-negative dims", found=repr(self.shape))

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True, slots=True, kw_only=True)
class EdgeSpecs:
    """Static shapes of what crosses each boundary, forward (all values) and backward (grad-carrying)."""

    act: tuple[ValueSpec, ...]

    @property
    def grad(self) -> tuple[ValueSpec, ...]:
        return tuple(v for v in self.act if v.carries_grad)


@dataclass(frozen=True, slots=True, kw_only=True)
class StageRuntime:
    """This rank's stage: a module over the original parameter names, and its edges.

    ``inputs``: model inputs (stage 0) or values received from stage ``k - 1``,
    in this order as positional arguments of ``module``. ``outputs``: values sent
    to stage ``k + 1`` or, on the last stage, the model's outputs.
    """

    index: int
    num_stages: int
    module: nn.Module  # the stage's GraphModule, or its blocks checkpointed (planner.runtime.rank.recompute)
    inputs: tuple[ValueSpec, ...]
    outputs: tuple[ValueSpec, ...]

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def parameters(self) -> tuple[tuple[str, nn.Parameter], ...]:
        return tuple(self.module.named_parameters())


# --------------------------------------------------------------------------- export
def export_model(model: nn.Module, example_inputs: Sequence[torch.Tensor]) -> torch.export.ExportedProgram:
    """``torch.export`` the real model at the given (microbatch) inputs, in training mode."""
    model.train()
    try:
        return torch.export.export(model, tuple(example_inputs), strict=False)
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as exc:
        raise InvalidInputError(f"cannot export the model for the runtime: {type(exc).__name__}: "
                                f"{str(exc).splitlines()[0] if str(exc) else ''}",
                                fix="make the model traceable by torch.export (see `stagewise trace`)") from exc


def _lifted_state(ep: torch.export.ExportedProgram) -> dict[str, tuple[str, str]]:
    """Map each lifted placeholder to (kind, target): the FQN of a parameter or buffer, or a constant's name."""
    sig = ep.graph_signature
    out: dict[str, tuple[str, str]] = {}
    for ph, fqn in sig.inputs_to_parameters.items():
        out[ph] = ("param", fqn)
    for ph, fqn in sig.inputs_to_buffers.items():
        out[ph] = ("buffer", fqn)
    for ph, name in sig.inputs_to_lifted_tensor_constants.items():
        out[ph] = ("const", name)
    for ph, name in getattr(sig, "inputs_to_lifted_custom_objs", {}).items():
        out[ph] = ("const", name)
    return out


def _resolve(split: "SplitGraph", model: nn.Module, kind: str, target: str) -> tuple[str, Any]:
    """The attribute path and tensor a stage module binds for one lifted input."""
    if kind == "param":
        return target, model.get_parameter(target)
    if kind == "buffer":
        try:
            return target, model.get_buffer(target)
        except AttributeError:  # a buffer export moved to the constants table
            return target, split.ep.constants[target]
    value = split.ep.constants[target]
    if isinstance(value, torch.Tensor) and value.device.type == "meta":
        raise InvalidInputError(f"constant {target!r} of the exported model has no data (exported on meta)",
                                fix="export the real model (build it on a real device)")
    return f"_stagewise_const.{target.replace('.', '_')}", value


def stage_state_names(split: "SplitGraph", k: int) -> tuple[str, ...]:
    """FQNs of the parameters and buffers stage ``k`` reads (what a rank must materialise)."""
    names: list[str] = []
    for node in split.ep.graph.nodes:
        if node.op == "call_function" and split.stage_of.get(node.name) == k:
            for src in node.all_input_nodes:
                entry = split.state.get(src.name)
                if entry is not None and entry[0] in ("param", "buffer") and entry[1] not in names:
                    names.append(entry[1])
    return tuple(names)


def has_constants(split: "SplitGraph") -> bool:
    return any(kind == "const" for kind, _ in split.state.values())


# --------------------------------------------------------------------------- split
@dataclass(frozen=True, slots=True, kw_only=True)
class SplitGraph:
    """The exported graph with every node assigned to a stage, ready to build stage modules."""

    ep: torch.export.ExportedProgram
    state: Mapping[str, tuple[str, str]]
    user_inputs: tuple[str, ...]
    output_values: tuple[str, ...]
    stage_of: Mapping[str, int]
    num_stages: int
    specs: Mapping[str, ValueSpec]


def split_graph(model: nn.Module, example_inputs: Sequence[torch.Tensor],
                stage_node_names: Sequence[Sequence[str]], *,
                ep: torch.export.ExportedProgram | None = None) -> SplitGraph:
    """Assign the exported graph's nodes to stages by the plan's node names.

    Every compute node must belong to exactly one stage, and a node may read
    only values of its own or earlier stages; otherwise the plan does not fit
    this model and :class:`PlanMismatchError` says which node is wrong.
    """
    ep = ep if ep is not None else export_model(model, example_inputs)
    # (the model is only exported here; build_stage binds tensors of whichever copy it is given)
    state = _lifted_state(ep)
    num_stages = len(stage_node_names)
    if num_stages < 1:
        raise InvalidInputError("plan stages", expected="at least one stage", found="none")
    wanted: dict[str, int] = {}
    for k, names in enumerate(stage_node_names):
        for name in names:
            if name in wanted and wanted[name] != k:
                raise PlanMismatchError(f"node {name!r} is listed in stages {wanted[name]} and {k}",
                                        fix="regenerate the plan with `stagewise plan`")
            wanted[name] = k
    graph_nodes = {n.name: n for n in ep.graph.nodes}
    stage_of: dict[str, int] = {}
    user_inputs: list[str] = []
    output_values: tuple[str, ...] = ()
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            if node.name in state:
                continue  # parameters, buffers and constants are local to every stage
            user_inputs.append(node.name)
            stage_of[node.name] = INPUT_STAGE
        elif node.op == "output":
            output_values = tuple(a.name for a in pytree.tree_leaves(node.args[0]) if isinstance(a, fx.Node))
        else:
            if node.name not in wanted:
                raise PlanMismatchError(
                    f"the exported model has node {node.name!r} ({node.target}) that no stage of the plan lists",
                    expected="every node of the model in exactly one stage",
                    fix="the plan was made for a different model or torch version: regenerate it")
            k = wanted[node.name]
            for src in node.all_input_nodes:
                ks = stage_of.get(src.name)
                if ks is not None and ks > k:
                    raise PlanMismatchError(
                        f"node {node.name!r} of stage {k} reads {src.name!r} of later stage {ks}",
                        expected="each stage reads only its own or earlier stages' values",
                        fix="regenerate the plan for this model")
            stage_of[node.name] = k
    missing = sorted(set(wanted) - set(graph_nodes))
    if missing:
        raise PlanMismatchError(f"the plan lists {len(missing)} node(s) the exported model lacks, e.g. {missing[0]!r}",
                                fix="the plan was made for a different model: regenerate it")
    specs = _value_specs(ep, state, model)
    return SplitGraph(ep=ep, state=state, user_inputs=tuple(user_inputs), output_values=output_values,
                      stage_of=stage_of, num_stages=num_stages, specs=specs)


def _value_specs(ep: torch.export.ExportedProgram, state: Mapping[str, tuple[str, str]],
                 model: nn.Module) -> dict[str, ValueSpec]:
    """Shape, dtype and whether a gradient flows, for every tensor value of the graph.

    Gradient flow is found exactly by running the graph under autograd on meta
    tensors (no memory, no compute): export's own metadata does not record
    ``requires_grad``.
    """
    meta_env: dict[str, Any] = {}
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            if node.name in state:
                kind, target = state[node.name]
                trainable = kind == "param" and model.get_parameter(target).requires_grad
                meta_env[node.name] = (torch.empty(val.shape, dtype=val.dtype, device="meta").requires_grad_(trainable)
                                       if isinstance(val, torch.Tensor) else _on_meta(ep.constants.get(target, val)))
            elif isinstance(val, torch.Tensor):
                meta_env[node.name] = torch.empty(val.shape, dtype=val.dtype, device="meta")
            else:
                meta_env[node.name] = val
    interp = _MetaInterpreter(ep.graph_module, meta_env)
    with torch.enable_grad():
        interp.run(*[meta_env[n.name] for n in ep.graph.nodes if n.op == "placeholder"])
    specs: dict[str, ValueSpec] = {}
    for name, val in interp.env_by_name.items():
        if isinstance(val, torch.Tensor):
            specs[name] = ValueSpec(name=name, shape=tuple(int(d) for d in val.shape), dtype=val.dtype,
                                    carries_grad=bool(val.requires_grad))
    return specs


class _MetaInterpreter(fx.Interpreter):
    """Runs the exported graph on meta tensors and keeps every node's value by name."""

    def __init__(self, gm: fx.GraphModule, env: Mapping[str, Any]) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.env_by_name: dict[str, Any] = dict(env)

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        self.env_by_name[n.name] = out
        return out

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        # A model exported with real weights bakes its device into ops (``inv_freq.to(cpu)``): keep them on meta.
        return super().call_function(target, _on_device(args, _META), _on_device(kwargs, _META))


_META = torch.device("meta")


def _on_meta(value: Any) -> Any:
    """A real constant as a meta tensor of its shape (a meta run cannot mix it with meta values)."""
    return torch.empty_like(value, device=_META) if isinstance(value, torch.Tensor) else value


def stage_edges(split: SplitGraph, k: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Names of the values stage ``k`` receives and sends, in graph order.

    Stage ``k`` receives every value defined before it (model inputs count as
    defined before stage 0) that stage ``k`` or a later one reads; the last
    stage's outputs are the model outputs.
    """
    readers: dict[str, int] = {}  # value -> last stage that reads it
    for node in split.ep.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        k_node = split.stage_of[node.name]
        for src in node.all_input_nodes:
            if src.name in split.stage_of:
                readers[src.name] = max(readers.get(src.name, INPUT_STAGE), k_node)
    for name in split.output_values:
        readers[name] = split.num_stages  # model outputs are "read" after the last stage
    order = [n.name for n in split.ep.graph.nodes if n.name in split.stage_of]

    def crossing(edge: int) -> tuple[str, ...]:
        # values defined at or before stage `edge - 1` and read at or after stage `edge`
        return tuple(v for v in order if split.stage_of[v] < edge <= readers.get(v, INPUT_STAGE))

    if k == 0:
        inputs = split.user_inputs
    else:
        inputs = crossing(k)
    outputs = split.output_values if k == split.num_stages - 1 else crossing(k + 1)
    return inputs, outputs


def _on_device(value: Any, device: torch.device) -> Any:
    """Rewrite devices baked into op arguments (``arange(..., device=meta)``) to the run device."""
    return fx.node.map_aggregate(value, lambda v: device if isinstance(v, torch.device) else v)


def build_stage(split: SplitGraph, k: int, model: nn.Module, *, device: torch.device | str = "cpu") -> StageRuntime:
    """The ``GraphModule`` of stage ``k``, bound to ``model``'s own parameters and buffers.

    ``model`` is the module that was split or any copy with the same names (for
    instance one built on the meta device with only this stage materialised).
    Factory ops in the graph (``arange``, ``zeros``) get ``device``, wherever
    the graph was exported.
    """
    device = torch.device(device)
    if not 0 <= k < split.num_stages:
        raise InvalidInputError("stage index", expected=f"0..{split.num_stages - 1}", found=str(k))
    inputs, outputs = stage_edges(split, k)
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    root: dict[str, Any] = {}
    for name in inputs:
        env[name] = graph.placeholder(name)
    for node in split.ep.graph.nodes:
        if node.op != "call_function" or split.stage_of.get(node.name) != k:
            continue
        for src in node.all_input_nodes:
            if src.name not in env and src.name in split.state:
                path, tensor = _resolve(split, model, *split.state[src.name])
                env[src.name] = graph.get_attr(path)
                env[src.name].name = src.name
                root[path] = tensor
            elif src.name not in env:
                raise PlanMismatchError(f"stage {k} node {node.name!r} reads {src.name!r}, which it does not receive",
                                        fix="regenerate the plan for this model")
        new = graph.node_copy(node, lambda n: env[n.name])
        new.args, new.kwargs = _on_device(new.args, device), _on_device(new.kwargs, device)
        env[node.name] = new
    for name in outputs:
        if name not in env:
            raise PlanMismatchError(f"stage {k} must send {name!r} but neither computes nor receives it",
                                    fix="regenerate the plan for this model")
    graph.output(tuple(env[name] for name in outputs))
    module = fx.GraphModule(root, graph, class_name=f"Stage{k}")
    return StageRuntime(index=k, num_stages=split.num_stages, module=module,
                        inputs=tuple(_spec(split, n) for n in inputs),
                        outputs=tuple(_spec(split, n) for n in outputs))


def _spec(split: SplitGraph, name: str) -> ValueSpec:
    if name not in split.specs:
        raise InvalidInputError(f"value {name!r} crossing a stage edge is not a single tensor",
                                fix="cut the model where a tensor (not a tuple or scalar) crosses")
    return split.specs[name]


def materialize(model: nn.Module, names: Sequence[str], device: torch.device | str) -> None:
    """Give the named parameters/buffers of a meta-device ``model`` real (uninitialised) storage.

    The rest of the model stays on meta: a rank allocates only its own stage.
    Tied parameters are one object under several names; each object is
    replaced once and every attribute that held it is rebound.
    """
    device = torch.device(device)
    targets = {id(_lookup(model, n)) for n in names}
    replaced: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for attr, tensor in list(store.items()):
                if tensor is None or id(tensor) not in targets or tensor.device.type != "meta":
                    continue
                if id(tensor) not in replaced:
                    new = torch.empty_like(tensor, device=device)
                    replaced[id(tensor)] = (nn.Parameter(new, requires_grad=tensor.requires_grad)
                                            if isinstance(tensor, nn.Parameter) else new)
                store[attr] = replaced[id(tensor)]


def _lookup(model: nn.Module, name: str) -> torch.Tensor:
    prefix, _, attr = name.rpartition(".")
    owner = model.get_submodule(prefix) if prefix else model
    return getattr(owner, attr)


# --------------------------------------------------------------------------- plans
def check_fingerprint(ep: torch.export.ExportedProgram, plan: "Plan") -> None:
    """Refuse a plan made for another model: the plan's fingerprint against this export's graph.

    The graph is built by the planner's own code (``planner.trace.graph_from_exported``), so the
    fingerprint is computed exactly as ``stagewise trace/plan`` computed it.
    """

    found = graph_from_exported(ep, name=plan.model.name).fingerprint()
    if found != plan.model.fingerprint:
        raise PlanMismatchError(
            f"plan for model {plan.model.spec!r} does not match the given model",
            expected=f"fingerprint {plan.model.fingerprint[:12]}",
            found=f"{found[:12]} (architecture, size or input shape differs)",
            fix="regenerate the plan with `stagewise plan` for this model and batch/sequence size")


def plan_node_names(plan: "Plan") -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(st.node_names) for st in plan.stages)


__all__ = ["ValueSpec", "StageRuntime", "SplitGraph", "export_model", "split_graph", "stage_edges",
           "build_stage", "stage_state_names", "materialize", "EdgeSpecs", "check_fingerprint",
           "INPUT_STAGE"]
