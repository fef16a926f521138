"""One ONNX file per stage of a plan, with the tensors crossing each cut as graph inputs and outputs.

The plan's stages are contiguous block ranges; each block lists the graph nodes it holds. For a plan
made from an ONNX file those are the nodes :mod:`planner.onnx_import` built from that file, so the cut
maps straight onto the file's tensors. For a plan made from a torch model, the model is exported with
``torch.onnx`` at the plan's microbatch shape, imported and coarsened like the plan's own trace, and the
stages are matched by block name (``embed``, ``layers.0``, ...).

Each ONNX node belongs to the stage of the IR node it became; *static* nodes (computed from weights and
constants alone, e.g. a transposed weight) belong to no stage: every stage that needs one recomputes it.
A stage's outputs are the values it produces that a later stage reads or that the model returns; its
inputs are found by walking back from those outputs to values produced earlier (by the model's input
or an earlier stage). A value can feed several later stages directly: the manifest (``stages.json``)
names, for every stage input, the stage that produces it. The subgraphs themselves are cut by
``onnx.utils.Extractor``; each stage's weights are read from the source's external data, one stage at
a time, and written beside its file.

The folder is written atomically: everything goes into a hidden sibling that is renamed into place
at the end, so a failure leaves the old folder (or none), never a mix.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import onnx
import onnx.utils

from models.registry import build_model
from planner.coarsen import GRANULARITIES, coarsen
from planner.errors import InvalidInputError, PlanMismatchError
from planner.ir import TensorMeta
from planner.model_io import is_onnx_spec
from planner.onnx_import import OnnxImport, export_onnx, import_onnx
from planner.outputs import temp_path_for
from planner.plan import Plan
from planner.trace import trace

MANIFEST = "stages.json"
MANIFEST_FORMAT = "stagewise-onnx-stages"
MANIFEST_VERSION = 1
MODEL_INPUT = -1  # "from_stage" of a value the model's caller supplies


@dataclass(frozen=True, slots=True, kw_only=True)
class StageCut:
    """Stage ``index`` of the exported model: its blocks and the ONNX value names it reads and writes."""

    index: int
    blocks: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.outputs:
            raise InvalidInputError(f"stage {self.index} ({', '.join(self.blocks)})",
                                    expected="at least one value a later stage or the model's caller reads",
                                    found="none", fix="re-plan: a stage whose results nobody reads cannot be cut")


@dataclass(frozen=True, slots=True, kw_only=True)
class StageExport:
    """What :func:`export_stages` wrote: the folder, the stage files in order and the manifest."""

    folder: Path
    files: tuple[Path, ...]
    manifest: Mapping[str, Any]


# --------------------------------------------------------------------------- output folder
def check_output_folder(folder: str | os.PathLike) -> Path:
    """Refuse a ``-o DIR`` that cannot receive the stage files, before any work starts.

    DIR may be new, an empty folder, or a folder an earlier export wrote (it holds ``stages.json``);
    the nearest existing folder above it must be writable (the files are staged there and renamed).
    """
    target = Path(folder)
    what = f"-o {os.fspath(folder)!r}"
    if target.exists() and not target.is_dir():
        raise InvalidInputError(f"{what} is a file", expected="a folder for the stage files",
                                fix="name a new folder, e.g. -o stages/")
    if target.is_dir() and any(target.iterdir()) and not (target / MANIFEST).is_file():
        raise InvalidInputError(f"{what} holds other files", expected="a new or empty folder, or one an earlier "
                                f"export-onnx --plan wrote ({MANIFEST})", found="a folder without a manifest",
                                fix="name a new folder: export-onnx replaces only a folder it wrote")
    if target.is_dir() and not os.access(target, os.W_OK | os.X_OK):
        raise InvalidInputError(f"{what} cannot be written", expected="a writable folder",
                                found=f"{target} is read-only", fix="choose another folder")
    parent = _nearest_existing(target.parent)
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise InvalidInputError(f"{what} cannot be written", expected="a writable folder above it",
                                found=f"{parent} is {'not writable' if parent.is_dir() else 'not a folder'}",
                                fix="choose another folder")
    return target


def _nearest_existing(folder: Path) -> Path:
    folder = folder.absolute()
    while not folder.exists():
        folder = folder.parent
    return folder


def _publish(staging: Path, target: Path) -> None:
    """Move the finished staging folder to ``target``, replacing an empty folder or an earlier export."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.is_dir() and any(target.iterdir()):
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
        os.replace(target, old / target.name)
        try:
            os.replace(staging, target)
        except OSError:
            os.replace(old / target.name, target)  # put the earlier export back
            raise
        finally:
            shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, target)  # POSIX rename replaces an empty folder


# --------------------------------------------------------------------------- the source model
def _onnx_source(plan: Plan, plan_path: Path | None) -> OnnxImport:
    """The ONNX file an ONNX plan was made from: as named in the plan, else beside the plan file."""
    spec = Path(plan.model.spec)
    candidates = [spec] + ([plan_path.parent / spec] if plan_path is not None and not spec.is_absolute() else [])
    found = next((c for c in candidates if c.is_file()), None)
    if found is None:
        raise InvalidInputError(f"the plan's model {plan.model.spec!r}",
                                expected="the ONNX file the plan was made from",
                                found="no such file" + (f" here or beside {plan_path}" if plan_path else ""),
                                fix="run from the folder you planned in, or put the .onnx and its .onnx.data "
                                    "beside the plan")
    source = import_onnx(found)
    if source.graph.fingerprint() != plan.model.fingerprint:
        raise PlanMismatchError(f"{found} is not the model the plan was made from",
                                expected=f"fingerprint {plan.model.fingerprint[:16]}...",
                                found=f"{source.graph.fingerprint()[:16]}...",
                                fix="use the ONNX file you planned, or re-plan this one with `stagewise plan`")
    return source


def _torch_source(plan: Plan, workdir: Path, seed: int) -> tuple[OnnxImport, list[frozenset[str]]]:
    """Export the plan's torch model with ``torch.onnx`` and map the plan's stages onto its blocks."""
    ref = plan.model
    meta = build_model(ref.spec, batch=ref.batch, seq=ref.seq, device="meta")
    if trace(meta.module, meta.example_inputs, name=ref.name).fingerprint() != ref.fingerprint:
        raise PlanMismatchError(f"the model {ref.spec!r} builds today is not the one the plan was made for",
                                expected=f"fingerprint {ref.fingerprint[:16]}...",
                                fix="re-plan it with `stagewise plan`")
    real = build_model(ref.spec, batch=plan.config.microbatch_size, seq=ref.seq, device="cpu", seed=seed)
    source = import_onnx(export_onnx(real.module, real.example_inputs, workdir / f"{ref.name}.onnx"))
    wanted = [b.name for st in plan.stages for b in st.blocks]
    for granularity in GRANULARITIES:  # the plan does not record the granularity it was coarsened at
        chain = coarsen(source.graph, granularity=granularity)
        stage_of = _export_stages(chain.blocks, plan)
        if stage_of is not None:
            return source, [frozenset(n for b, k in zip(chain.blocks, stage_of) if k == st.index
                                      for n in b.node_names) for st in plan.stages]
    raise InvalidInputError(f"the plan's blocks of {ref.spec!r}", expected="the blocks of its ONNX export "
                            f"({', '.join(wanted[:4])}{', ...' if len(wanted) > 4 else ''})",
                            found=f"{', '.join(b.name for b in coarsen(source.graph).blocks[:4])}, ... in the export",
                            fix="export the model with `stagewise export-onnx MODEL -o FILE.onnx`, plan that file, "
                                "and export its plan")


def _export_stages(exported: Sequence[Any], plan: Plan) -> list[int] | None:
    """The plan's stage of each exported block, or None when the blocks do not map onto the plan's.

    The export may lack a planned block or merge neighbours (``a..b``): the ONNX graph is of the eval model
    (no dropout left to make a block of) and folds a block computed from weights and constants alone (GPT-2's
    position table lookup at a fixed length) into static nodes, which every stage that reads them recomputes.
    Each exported block must cover planned blocks in the plan's order, all in one stage."""
    planned = [(b.name, st.index) for st in plan.stages for b in st.blocks]
    position = {name: i for i, (name, _) in enumerate(planned)}
    stages, after = [], -1
    for block in exported:
        first, _, last = ("", "", "") if block.name in position else block.name.partition("..")
        span = (position.get(first or block.name), position.get(last or first or block.name))
        if None in span or not after < span[0] <= span[1] or planned[span[0]][1] != planned[span[1]][1]:
            return None
        stages.append(planned[span[0]][1])
        after = span[1]
    return stages if stages else None


# --------------------------------------------------------------------------- the cut
def stage_cuts(source: OnnxImport, stage_nodes: Sequence[frozenset[str]],
               block_names: Sequence[tuple[str, ...]]) -> tuple[StageCut, ...]:
    """The inputs and outputs of each stage (module docstring), in value order, last stage first."""
    g = source.model.graph
    node_stage = {name: k for k, names in enumerate(stage_nodes) for name in names}
    inputs = {vi.name for vi in g.input}
    producer: dict[str, int] = {}  # value -> index of the ONNX node that makes it
    stage_of_node: list[int | None] = []
    for i, node in enumerate(g.node):
        ir_name = next((source.producers[v] for v in node.output if v in source.producers), None)
        if ir_name is not None and ir_name not in node_stage:
            raise InvalidInputError(f"ONNX node {node.name or node.op_type!r}", expected="in one of the plan's stages",
                                    found="in none", fix="re-plan the model with `stagewise plan`")
        stage_of_node.append(None if ir_name is None else node_stage[ir_name])
        producer.update({v: i for v in node.output if v})
    order = {v: i for i, v in enumerate([vi.name for vi in g.input] + [v for n in g.node for v in n.output if v])}

    def stage_of(value: str) -> int | None:
        if value in inputs:
            return MODEL_INPUT
        return stage_of_node[producer[value]] if value in producer else None  # None: static (or an initializer)

    model_outputs = [o.name for o in g.output]
    cuts: list[StageCut] = []
    read_later: set[str] = set()
    last = len(stage_nodes) - 1
    for k in range(last, -1, -1):
        outs = [v for v in order if stage_of(v) == k and (v in read_later or v in model_outputs)]
        if k == last:  # a model output computed from constants alone: the last stage returns it
            outs += [v for v in model_outputs if stage_of(v) is None and v not in outs]
        ins = _walk_back(outs, k, stage_of, producer, g)
        read_later.update(ins)
        cuts.append(StageCut(index=k, blocks=tuple(block_names[k]), inputs=tuple(sorted(ins, key=order.get)),
                             outputs=tuple(sorted(dict.fromkeys(outs), key=order.get))))
    return tuple(reversed(cuts))


def _walk_back(outputs: Sequence[str], k: int, stage_of: Callable[[str], int | None], producer: Mapping[str, int],
               g: onnx.GraphProto) -> set[str]:
    """Values from earlier stages (or the model's input) that stage ``k`` needs to compute ``outputs``."""
    needed: set[str] = set()
    seen: set[str] = set()
    stack = list(outputs)
    while stack:
        value = stack.pop()
        if value in seen or not value:
            continue
        seen.add(value)
        stage = stage_of(value)
        if stage is not None and stage < k:
            needed.add(value)
        elif stage is not None and stage > k:
            raise InvalidInputError(f"stage {k} reads {value!r} of the later stage {stage}",
                                    expected="stages in the model's order", fix="re-plan with `stagewise plan`")
        elif value in producer:  # made in this stage, or static: recomputed here from its own inputs
            stack.extend(g.node[producer[value]].input)
    return needed


# --------------------------------------------------------------------------- writing
def export_stages(plan: Plan, folder: str | os.PathLike, *, plan_path: str | os.PathLike | None = None,
                  seed: int = 0) -> StageExport:
    """Write ``stage{k}.onnx`` (+ ``.onnx.data``) per stage of ``plan`` and ``stages.json`` into ``folder``.

    ``plan_path`` is where the plan was read from (an ONNX plan's model is also looked for beside it);
    ``seed`` initialises a torch model's weights as ``stagewise run`` does.
    """
    target = check_output_folder(folder)
    # A hidden, unique folder beside where DIR will be (mkdir, not mkdtemp: the usual permissions).
    staging = temp_path_for(_nearest_existing(target.parent) / target.name)
    try:
        staging.mkdir()
    except OSError as exc:
        raise InvalidInputError(f"-o {os.fspath(folder)!r} cannot be written", expected="a writable folder",
                                found=f"{type(exc).__name__}: {exc.strerror}", fix="choose another folder") from None
    try:
        source_dir = staging / ".source"
        source_dir.mkdir()
        if is_onnx_spec(plan.model.spec):
            source = _onnx_source(plan, Path(plan_path) if plan_path is not None else None)
            stage_nodes = [frozenset(st.node_names) for st in plan.stages]
            described = str(source.path)
        else:
            source, stage_nodes = _torch_source(plan, source_dir, seed)
            described = f"torch.onnx export of {plan.model.spec} (seed {seed})"
        cuts = stage_cuts(source, stage_nodes, [st.block_names for st in plan.stages])
        files = [_write_stage(source, cut, staging) for cut in cuts]
        shutil.rmtree(source_dir)
        manifest = _manifest(plan, source, cuts, files, described)
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        _publish(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return StageExport(folder=target, files=tuple(target / f for f, _ in files), manifest=manifest)


def _write_stage(source: OnnxImport, cut: StageCut, folder: Path) -> tuple[str, str | None]:
    """Cut one stage out of the source graph, read its weights, and save it.

    Returns the file's name and its weights file's (None when every tensor was small enough to stay inline).
    """
    try:
        stage = onnx.utils.Extractor(source.model).extract_model(list(cut.inputs), list(cut.outputs))
    except ValueError as exc:
        raise InvalidInputError(f"stage {cut.index} of {source.path}", expected="values with inferred shapes",
                                found=str(exc).splitlines()[0],
                                fix="export the model with fixed input shapes") from None
    stage.graph.name = f"stage{cut.index}"
    onnx.helper.set_model_props(stage, {"stagewise.stage": str(cut.index), "stagewise.blocks": ",".join(cut.blocks)})
    # Only this stage's weights are read, so one stage at a time is ever in memory.
    onnx.load_external_data_for_model(stage, str(source.path.parent))
    name = f"stage{cut.index}.onnx"
    onnx.save_model(stage, str(folder / name), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=f"{name}.data", size_threshold=1024)
    onnx.checker.check_model(str(folder / name))
    return name, f"{name}.data" if (folder / f"{name}.data").is_file() else None


def _value_metas(source: OnnxImport) -> dict[str, TensorMeta]:
    """Shape and dtype of every value with a static shape (shape inference gave the importer these)."""
    g = source.model.graph
    metas = {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        tt = vi.type.tensor_type
        if vi.type.HasField("tensor_type") and all(d.HasField("dim_value") for d in tt.shape.dim):
            metas[vi.name] = TensorMeta(shape=tuple(int(d.dim_value) for d in tt.shape.dim),
                                        dtype=onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).name)
    return metas


def _manifest(plan: Plan, source: OnnxImport, cuts: Sequence[StageCut], files: Sequence[tuple[str, str | None]],
              described: str) -> dict[str, Any]:
    metas = _value_metas(source)
    model_inputs = [vi.name for vi in source.model.graph.input]
    made_by = {**{v: MODEL_INPUT for v in model_inputs}, **{v: cut.index for cut in cuts for v in cut.outputs}}
    read_by: dict[str, list[int]] = {}
    for cut in cuts:
        for v in cut.inputs:
            read_by.setdefault(v, []).append(cut.index)
    model_outputs = [o.name for o in source.model.graph.output]

    def tensor(name: str) -> dict[str, Any]:
        meta = metas.get(name)
        return {"name": name, "shape": list(meta.shape) if meta else None, "dtype": meta.dtype if meta else None}

    return {
        "format": MANIFEST_FORMAT, "version": MANIFEST_VERSION,
        "model": {"spec": plan.model.spec, "name": plan.model.name, "fingerprint": plan.model.fingerprint},
        "source": described,
        "inputs": [tensor(v) for v in model_inputs],
        "outputs": [{**tensor(v), "from_stage": made_by.get(v)} for v in model_outputs],
        "stages": [{
            "index": cut.index, "file": file, "data": data, "blocks": list(cut.blocks),
            "inputs": [{**tensor(v), "from_stage": made_by[v]} for v in cut.inputs],
            "outputs": [{**tensor(v), "to_stages": [k for k in read_by.get(v, []) if k > cut.index],
                         "model_output": v in model_outputs} for v in cut.outputs],
        } for cut, (file, data) in zip(cuts, files)],
    }
