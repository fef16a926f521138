"""``train``: run a plan's programs from Python with the local launcher, as ``stagewise run`` does.

A Python model object cannot cross into the rank processes, so a transformers model is saved
(config and safetensors weights) into a temporary folder that the ranks build and load offline
as ``hf:DIR`` (``models.hf_weights``), and the plan is re-signed with that spec.
"""
from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from models import hf
from planner.errors import InvalidInputError
from planner.plan import Plan
from planner.runtime.launcher.launch import launch
from planner.runtime.options import RunOptions

MODEL_DIR = "model"      # inside the temporary folder: the saved transformers model
TOKENS_FILE = "tokens.npy"  # inside the temporary folder: token ids given as an array
EVAL_TOKENS_FILE = "eval-tokens.npy"  # the same for the validation data
PLAN_FILE = "plan.json"


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainResult:
    """What a Python run returns: the loss and wall time of each step, the validation losses as (step,
    loss) pairs, and rank 0's whole result."""

    losses: tuple[float | None, ...]
    step_ms: tuple[float, ...]
    eval_losses: tuple[tuple[int, float | None], ...] = ()
    result: Mapping[str, Any] = dataclasses.field(compare=False, repr=False)


def train(plan: Plan, model: nn.Module | None = None, *, steps: int = 5, data: str | Sequence[int] | Any = "auto",
          lr: float | None = None, seed: int = 0, verify: bool = True, timeout_s: float = 120.0,
          threads: int = 1, log_dir: str | Path | None = None, eval_data: str | Sequence[int] | Any = None,
          eval_every: int | None = None, accumulate: int = 1) -> TrainResult:
    """Train ``model`` (a transformers ``PreTrainedModel``, its weights as they are now) under ``plan`` for
    ``steps`` steps, one local process per rank; ``model=None`` runs the plan's own spec (a preset or ``hf:``).

    ``data``: a ``--data`` spec (``auto``, ``synthetic``, ``tokens:FILE.npy``, ...) or the token ids
    themselves (a flat integer array); ``eval_data`` the same for a validation loss after the last step and
    every ``eval_every`` steps. ``lr``, ``seed``, ``verify``, ``timeout_s``, ``threads``, ``accumulate``: as
    ``stagewise run``'s. ``model`` is not changed: the trained weights stay with the ranks (``stagewise run
    --save-weights`` writes them).
    """
    with tempfile.TemporaryDirectory(prefix="stagewise-train-") as folder:
        work = Path(folder)
        run_plan = plan if model is None else _with_saved_model(plan, model, work / MODEL_DIR)
        path = run_plan.save(work / PLAN_FILE)  # signed with this machine's run secret, as the launcher checks
        opts = RunOptions(plan=str(path), steps=steps, lr=lr, seed=seed, verify=verify, timeout_s=timeout_s,
                          threads=threads, data=_data_spec(data, work / TOKENS_FILE), eval_every=eval_every,
                          eval_data=None if eval_data is None else _data_spec(eval_data, work / EVAL_TOKENS_FILE),
                          accumulate=accumulate)
        result = launch(opts, log_dir=log_dir)
    evals = tuple((e["step"], e["loss"]) for e in result.get("eval_losses") or ())
    return TrainResult(losses=tuple(result.get("losses") or ()), step_ms=tuple(result.get("step_ms") or ()),
                       eval_losses=evals, result=result)


def _with_saved_model(plan: Plan, model: nn.Module, folder: Path) -> Plan:
    """``plan`` for ``model`` saved into ``folder``: its model spec becomes ``hf:folder`` (the fingerprint
    stays: the ranks check the folder's model against it)."""
    if not hf.is_hf_model(model):
        raise InvalidInputError(f"train(model={type(model).__name__})",
                                expected="a transformers PreTrainedModel (saved for the ranks to load), or None",
                                found="another module: its code and weights cannot reach the rank processes",
                                fix="plan a preset or factory and run it with `stagewise run PLAN --model SPEC`")
    if any(t.device.type == "meta" for t in model.state_dict().values()):
        raise InvalidInputError(f"train(model={type(model).__name__})", expected="a model with real weights",
                                found="meta tensors", fix="build it on the CPU (or load it with from_pretrained)")
    hf.adapt(model)  # as make_plan adapted it: the saved config says no cache
    bars = hf.transformers().utils.logging
    shown = bars.is_progress_bar_enabled()
    bars.disable_progress_bar()  # the library's "Writing model shards" bar is no output of ours
    try:
        with hf.quiet():
            model.save_pretrained(folder, safe_serialization=True)
    finally:
        if shown:
            bars.enable_progress_bar()
    return dataclasses.replace(plan, model=dataclasses.replace(plan.model, spec=f"{hf.PREFIX}{folder}"))


def _data_spec(data: Any, path: Path) -> str:
    """A ``--data`` spec for ``data``: a spec string as it is, token ids saved as a flat ``.npy`` file."""
    if isinstance(data, str):
        return data
    ids = data.detach().cpu().numpy() if isinstance(data, torch.Tensor) else np.asarray(data)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise InvalidInputError("train(data=...)", expected="a --data spec or a flat array of integer token ids",
                                found=f"an array of shape {ids.shape} and dtype {ids.dtype}",
                                fix="pass ids.reshape(-1), or a spec such as 'tokens:FILE.npy'")
    np.save(path, ids.astype(np.int64))
    return f"tokens:{path}"
