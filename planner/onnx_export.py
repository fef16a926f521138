"""Export a PyTorch model to ONNX (dynamo exporter, weights as external data), never leaving a half-written file."""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

from planner.errors import InvalidInputError, TraceError

__all__ = ["export_onnx"]


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
