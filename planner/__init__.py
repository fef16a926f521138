"""Stagewise: an auto-parallel planner compiler for pipeline training on
heterogeneous, partly untrusted devices.

The public API is imported lazily so that ``import planner.ir`` stays cheap and
the layering (ir -> cost models -> solver -> compile -> simulate/runtime) has
no import cycles. ``trace``, ``coarsen`` and ``simulate`` are submodules, so their
functions are reached as ``planner.trace.trace`` etc. (a lazy alias would be shadowed
by the submodule once it is imported).
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "load_onnx": ("planner.onnx_import", "load_onnx"),
    "make_plan": ("planner.api", "make_plan"),
    "load_plan": ("planner.plan_load", "load_plan"),
    "Plan": ("planner.plan", "Plan"),
    "apply_plan": ("planner.runtime.rank.apply", "apply_plan"),
    "train": ("planner.driver", "train"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'planner' has no attribute {name!r}")
