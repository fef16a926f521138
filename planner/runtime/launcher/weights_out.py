"""A run's trained weights in the model's own layout: one safetensors state dict (``--save-weights``).

Every rank already writes its final parameters by name into a checkpoint after the
last step (:mod:`planner.runtime.recovery.checkpoint`); a run that saves weights without a
``--checkpoint-dir`` takes that checkpoint in a hidden folder beside the output,
removed afterwards. The launcher then merges the rank files into one file keyed by
the unsplit model's own names: what ``model.state_dict()`` holds, a tied weight
once under the name the model registers first (what ``named_parameters()``
reports: the input embedding of a tied LM head, as Hugging Face keeps it; the
other names are recorded in the metadata, as ``safetensors.torch.save_model``
records them), so ``safetensors.torch.load_model(build_model(spec).module, PATH)``
loads it strictly (an untied model: ``load_state_dict(load_file(PATH))`` too).
Nothing crosses between processes but safetensors files; the output is written
atomically, and everything that can be checked is checked before a rank starts.

A Hugging Face model (an ``hf:`` spec) gets a ``save_pretrained`` folder instead:
``config.json`` and ``model.safetensors`` under the library's own names, which
``AutoModelFor...from_pretrained(PATH)`` loads (its tied head from the embedding).
The folder is written beside the target and renamed into place.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import save as save_tensors

from models.hf import is_hf_spec
from models.registry import build_model
from planner.errors import InvalidInputError, RankFailureError
from planner.outputs import atomic_file, check_writable
from planner.plan import Plan
from planner.plan_load import load_plan
from planner.runtime.launcher.launch import launch
from planner.runtime.launcher.membership import load_signed_plan, operator_trust
from planner.runtime.options import RunOptions, check_model_allowed, refuse_onnx_model
from planner.runtime.recovery import checkpoint
from planner.secret import run_secret


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightLayout:
    """The unsplit model's parameters: per kept name, its aliases (tied weights), shape and dtype."""

    aliases: dict[str, tuple[str, ...]]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]

    @property
    def all_names(self) -> set[str]:
        return {n for names in self.aliases.values() for n in names}


def model_layout(plan: Plan, *, seed: int = 0) -> WeightLayout:
    """The layout of ``plan``'s model, built on the meta device (no weights allocated). A model whose state
    dict holds buffers is refused: ranks checkpoint parameters only, so its buffers would be missing."""
    ref = plan.model
    module = build_model(ref.spec, batch=ref.batch, seq=ref.seq, device="meta", seed=seed).module
    groups: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
        tensors[id(p)] = p
    param_names = {n for names in groups.values() for n in names}
    buffers = [n for n in module.state_dict() if n not in param_names]
    if buffers:
        raise InvalidInputError(f"--save-weights for {ref.spec}", expected="a model whose state dict is its "
                                "parameters (runs gather parameters only)",
                                found=f"buffers {buffers[:3]}" + (f" and {len(buffers) - 3} more"
                                                                  if len(buffers) > 3 else ""),
                                fix="use --checkpoint-dir: its rank files hold every parameter by name")
    aliases, shapes, dtypes = {}, {}, {}
    for key, names in groups.items():
        kept = names[0]  # registration order: safetensors' load_model accepts any alias of a shared tensor
        aliases[kept] = tuple(names)
        shapes[kept], dtypes[kept] = tuple(tensors[key].shape), tensors[key].dtype
    return WeightLayout(aliases=aliases, shapes=shapes, dtypes=dtypes)


def prepare(opts: RunOptions, path: str | os.PathLike) -> tuple[Path, WeightLayout]:
    """Before any rank starts: the output writable, the plan as signed, the model allowed and savable."""
    plan, _ = load_signed_plan(opts.plan, run_secret(opts.secret_file), operator=operator_trust(opts))  # before a build
    target = _check_folder(path) if is_hf_spec(plan.model.spec) else check_writable(path, what="--save-weights")
    refuse_onnx_model(plan.model.spec)  # the launcher's own first refusal, before this builds the model
    check_model_allowed(plan.model.spec, opts.model)
    return target, model_layout(plan, seed=opts.seed)


def consolidate(root: str | Path, *, step: int, layout: WeightLayout, key: bytes) -> dict[str, torch.Tensor]:
    """The model's state dict from the checkpoint after ``step``: every parameter from whichever rank
    owned it (under any of its names), checked against the model's shapes and dtypes."""
    found = checkpoint.read_params(root, step=step, names=layout.all_names, key=key)
    out: dict[str, torch.Tensor] = {}
    for kept, names in layout.aliases.items():
        held = next((found[n] for n in names if n in found), None)
        if held is None:
            raise RankFailureError(f"the checkpoint after step {step} in {root}",
                                   expected="every parameter of the model on some rank",
                                   found=f"no {kept!r}", fix="check that every rank finished the run")
        if tuple(held.shape) != layout.shapes[kept] or held.dtype != layout.dtypes[kept]:
            raise RankFailureError(f"parameter {kept!r} of the checkpoint after step {step}",
                                   expected=f"{layout.dtypes[kept]} {layout.shapes[kept]}",
                                   found=f"{held.dtype} {tuple(held.shape)}")
        out[kept] = held.contiguous()
    return out


def write_weights(path: str | os.PathLike, state: dict[str, torch.Tensor], *, layout: WeightLayout,
                  plan: Plan, step: int) -> Path:
    """One safetensors file, atomically; the metadata names each dropped alias's kept name (as
    ``safetensors.torch.save_model`` does) and the run it came from."""
    meta = {"format": "pt", "stagewise_model": plan.model.spec, "stagewise_fingerprint": plan.model.fingerprint,
            "stagewise_step": str(step)}
    for kept, names in layout.aliases.items():
        meta.update({n: kept for n in names if n != kept})
    with atomic_file(path, binary=True) as fh:
        fh.write(save_tensors(state, metadata=meta))
    return Path(path)


def _check_folder(path: str | os.PathLike) -> Path:
    """A save_pretrained folder's target: new or empty, in a writable place."""
    target = Path(path)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise InvalidInputError(f"--save-weights {os.fspath(path)!r} for a Hugging Face model",
                                expected="a new or empty folder (a save_pretrained folder is written there)",
                                found="a file" if not target.is_dir() else "a folder with files in it",
                                fix="name a new folder")
    check_writable(target / "config.json", what="--save-weights")
    return target


def write_pretrained(path: str | os.PathLike, state: dict[str, torch.Tensor], *, plan: Plan) -> Path:
    """An ``hf:`` model's weights as a ``save_pretrained`` folder (the model built on meta: no copy)."""
    target = Path(path)
    model = build_model(plan.model.spec, batch=plan.model.batch, seq=plan.model.seq, device="meta").module
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    moved = False
    try:
        model.save_pretrained(staging, state_dict=dict(state))  # the library empties the dict it is given
        if target.exists():
            target.rmdir()  # empty, as prepare checked
        staging.rename(target)
        moved = True
    finally:
        if not moved:  # no half-written folder left behind, whatever stopped it
            shutil.rmtree(staging, ignore_errors=True)
    return target


def launch_saving_weights(opts: RunOptions, path: str | os.PathLike, *,
                          on_event: Callable[[dict[str, Any]], None] | None = None,
                          log_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """``launch(opts)``, then the trained weights written to ``path``; returns the run's result."""
    target, layout = prepare(opts, path)
    hidden = None
    if opts.checkpoint_dir is None:  # only the checkpoint after the last step, beside the output
        target.parent.mkdir(parents=True, exist_ok=True)
        hidden = tempfile.mkdtemp(prefix=f".{target.name}.ranks-", dir=target.parent)
        opts = dataclasses.replace(opts, checkpoint_dir=hidden, checkpoint_every=opts.steps)
    try:
        result = launch(opts, on_event=on_event, log_dir=log_dir)
        last = opts.steps - 1
        if last not in checkpoint.complete_steps(opts.checkpoint_dir):
            raise RankFailureError(f"the checkpoint after the last step ({last}) in {opts.checkpoint_dir}",
                                   expected="a complete checkpoint", found="none",
                                   fix="check that every rank finished the run")
        state = consolidate(opts.checkpoint_dir, step=last, layout=layout, key=run_secret(opts.secret_file))
        plan = load_plan(opts.plan)
        if is_hf_spec(plan.model.spec):
            write_pretrained(target, state, plan=plan)
        else:
            write_weights(target, state, layout=layout, plan=plan, step=last)
    finally:
        if hidden is not None:
            shutil.rmtree(hidden, ignore_errors=True)
    return {**result, "weights": os.fspath(target)}
