"""Each boundary's codec in a plan (``--compress``): fixed, or under ``auto`` chosen per boundary.

``auto``'s searches price every boundary as int8 (``problem.search_codec``); then, boundary by boundary, the
least lossy codec (none, then fp8) replaces int8 wherever the compiled programs cost at most ``AUTO_SLACK`` more
than the all-int8 plan: boundaries on fast links stay uncompressed, slow ones keep int8. int4 is never chosen
by ``auto`` (its error is the one the convergence goal allows 3% for): ask for it by name.

Under ``auto`` each replicated stage's gradient all-reduce may also run PowerSGD (``allreduce_codec``): all of
them do if that prices the program more than ``AUTO_SLACK`` lower, then each goes back to ``none`` wherever
that costs nothing (a stage whose all-reduce does not pace the step keeps exact gradients). Fixed boundary
codecs leave every all-reduce uncompressed.
"""
from __future__ import annotations

import dataclasses

from planner.solver.objective import Placement, price_program, stage_memory_bytes
from planner.solver.problem import Problem

AUTO_SLACK = 0.005
AUTO_ORDER = ("none", "fp8")  # tried in turn before keeping int8


def with_codecs(placement: Placement, codecs: list[str]) -> Placement:
    stages = tuple(dataclasses.replace(st, out_codec=c) for st, c in zip(placement.stages, codecs))
    return dataclasses.replace(placement, stages=stages)


def with_allreduce_codecs(placement: Placement, codecs: list[str]) -> Placement:
    stages = tuple(dataclasses.replace(st, allreduce_codec=c) for st, c in zip(placement.stages, codecs))
    return dataclasses.replace(placement, stages=stages)


def choose_allreduce_codecs(problem: Problem, placement: Placement) -> Placement:
    """``placement`` with every stage's ``allreduce_codec`` set: PowerSGD where it pays (module docstring)."""
    plain = ["none"] * placement.num_stages
    replicated = [k for k, st in enumerate(placement.stages) if len(st.devices) > 1]
    if problem.compress != "auto" or not replicated:
        return with_allreduce_codecs(placement, plain)
    base = price_program(problem, with_allreduce_codecs(placement, plain)).step_ms
    codecs = ["powersgd" if k in replicated and _fits(problem, placement, k) else "none"
              for k in range(placement.num_stages)]
    best = price_program(problem, with_allreduce_codecs(placement, codecs)).step_ms
    if best >= base * (1 - AUTO_SLACK):
        return with_allreduce_codecs(placement, plain)
    for k in replicated:
        trial = codecs[:k] + ["none"] + codecs[k + 1:]
        if price_program(problem, with_allreduce_codecs(placement, trial)).step_ms <= best:
            codecs = trial
    return with_allreduce_codecs(placement, codecs)


def _fits(problem: Problem, placement: Placement, k: int) -> bool:
    """Whether stage ``k``'s replicas still fit their memory with PowerSGD's error-feedback buffer."""
    st = dataclasses.replace(placement.stages[k], allreduce_codec="powersgd")
    return all(stage_memory_bytes(problem, st, placement.num_stages, m) <= problem.classes[problem.class_of(d)].mem_bytes
               for d, m in zip(st.devices, st.microbatches))


def choose_codecs(problem: Problem, placement: Placement) -> Placement:
    """``placement`` with every stage's ``out_codec`` set (the last stage's: none), then its all-reduce codecs
    (:func:`choose_allreduce_codecs`)."""
    S = placement.num_stages
    codecs = [problem.codec] * (S - 1) + ["none"]
    if problem.compress != "auto":
        return choose_allreduce_codecs(problem, with_codecs(placement, codecs))
    limit = price_program(problem, with_codecs(placement, codecs)).step_ms * (1 + AUTO_SLACK)
    for k in range(S - 1):
        for codec in AUTO_ORDER:
            trial = codecs[:k] + [codec] + codecs[k + 1:]
            if price_program(problem, with_codecs(placement, trial)).step_ms <= limit:
                codecs = trial
                break
    return choose_allreduce_codecs(problem, with_codecs(placement, codecs))
