"""The solver: cost tables, the CP-SAT model, baselines, the DP and infeasibility explanations.

Public entry points (imported lazily, so ``import planner.solver.solution`` stays cheap):
``solve``, ``solve_or_explain``, ``baseline``, ``microbatch_candidates``.
"""
from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "solve": ("planner.solver.api", "solve"),
    "solve_or_explain": ("planner.solver.api", "solve_or_explain"),
    "baseline": ("planner.solver.api", "baseline"),
    "microbatch_candidates": ("planner.solver.api", "microbatch_candidates"),
    "BASELINES": ("planner.solver.baselines", "BASELINES"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'planner.solver' has no attribute {name!r}")
