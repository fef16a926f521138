"""The one error when neither torch.export nor torch.fx can trace a model: the module and source line that broke."""
from __future__ import annotations

import linecache
import re
import traceback
from types import TracebackType

from torch import nn

from planner.errors import TraceError

__all__ = ["trace_error"]

_PARTIAL_OP = re.compile(r"torch\.ops\.([\w.]+)\(")


def trace_error(model: nn.Module, name: str, export_exc: BaseException, fx_exc: BaseException) -> TraceError:
    names = {id(m): path for path, m in model.named_modules()}
    where = _culprit(fx_exc.__traceback__, names) or _culprit(export_exc.__traceback__, names)
    first_line = (str(fx_exc) or type(fx_exc).__name__).strip().splitlines()[0]
    export_line = (str(export_exc) or type(export_exc).__name__).strip().splitlines()[0]
    if where is None:
        location = "in the model's forward"
    else:
        path, cls, code, file, lineno = where
        location = f"at `{code}` in module {path or '<root>'} ({cls}), {file}:{lineno}"
    # torch.export attaches the graph it had built so far: its last op is where it stopped.
    ops = _PARTIAL_OP.findall(str(getattr(export_exc, "partial_fx_graph", "") or ""))
    if ops:
        location = f"at op {ops[-1]} " + location
    return TraceError(
        f"cannot trace model {name!r} {location}",
        expected="a model torch.export (strict=False) or torch.fx can trace",
        found=f"torch.export: {export_line[:160]}; torch.fx: {first_line[:160]}",
        fix="replace data-dependent Python control flow on tensor values with torch.where / torch.cond, "
            "or pass an ONNX file instead")


def _culprit(tb: TracebackType | None, names: dict[int, str]) -> tuple[str, str, str, str, int] | None:
    """The innermost traceback frame running a submodule's code: (path, class, line, file, lineno)."""
    found = None
    for frame, lineno in traceback.walk_tb(tb):
        code = frame.f_code
        owner = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None  # `self`, by any name
        if isinstance(owner, nn.Module) and id(owner) in names:
            line = linecache.getline(code.co_filename, lineno).strip()
            found = (names[id(owner)], type(owner).__name__, line, code.co_filename, lineno)
    return found
