"""Each boundary's codec in a plan (``--compress``): fixed, or under ``auto`` chosen per boundary.

``auto``'s searches price every boundary as int8 (``problem.search_codec``); then, boundary by boundary, the
least lossy codec (none, then fp8) replaces int8 wherever the compiled programs cost at most ``AUTO_SLACK`` more
than the all-int8 plan: boundaries on fast links stay uncompressed, slow ones keep int8. int4 is never chosen
by ``auto`` (its error is the one the convergence goal allows 3% for): ask for it by name.
"""
from __future__ import annotations

import dataclasses

from planner.solver.objective import Placement, price_program
from planner.solver.problem import Problem

AUTO_SLACK = 0.005
AUTO_ORDER = ("none", "fp8")  # tried in turn before keeping int8


def with_codecs(placement: Placement, codecs: list[str]) -> Placement:
    stages = tuple(dataclasses.replace(st, out_codec=c) for st, c in zip(placement.stages, codecs))
    return dataclasses.replace(placement, stages=stages)


def choose_codecs(problem: Problem, placement: Placement) -> Placement:
    """``placement`` with every stage's ``out_codec`` set (the last stage's: none)."""
    S = placement.num_stages
    codecs = [problem.codec] * (S - 1) + ["none"]
    if problem.compress != "auto":
        return with_codecs(placement, codecs)
    limit = price_program(problem, with_codecs(placement, codecs)).step_ms * (1 + AUTO_SLACK)
    for k in range(S - 1):
        for codec in AUTO_ORDER:
            trial = codecs[:k] + [codec] + codecs[k + 1:]
            if price_program(problem, with_codecs(placement, trial)).step_ms <= limit:
                codecs = trial
                break
    return with_codecs(placement, codecs)
