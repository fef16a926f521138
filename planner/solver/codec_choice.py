"""Each boundary's codec in a plan (``--compress``): fixed, or under ``auto`` chosen per boundary.

``auto``'s searches price every boundary as int8 (``problem_build.search_codec``); then, boundary by boundary, the
least lossy codec (none, then fp8) replaces int8 wherever the compiled programs cost at most ``AUTO_SLACK`` more
than the all-int8 plan: boundaries on fast links stay uncompressed, slow ones keep int8. int4 is never chosen
by ``auto`` (its error is the one the convergence goal allows 3% for): ask for it by name.

Under ``auto`` each replicated stage's gradient all-reduce may also be compressed (``allreduce_codec``): each
takes its cheapest of none, int8 and PowerSGD (``objective.allreduce_ms``, ties to the less lossy, the
error-feedback buffer fitting its memory); if that prices the program more than ``AUTO_SLACK`` lower, each
then goes back to a less lossy codec wherever that costs the step nothing (a stage whose all-reduce does
not pace the step keeps exact gradients), else every all-reduce stays exact. ``--compress int8`` puts a
replicated stage's all-reduce on int8 wherever that prices no dearer than exact: the user asked for 8-bit
traffic, and error feedback keeps SGD-type updates sound (Karimireddy et al. 2019), but an all-gather
receives ``r - 1`` payloads where the ring receives about two, so from 8 replicas (or on links fast
enough that the codec's passes dominate) int8 would cost time and precision for nothing. fp8 and int4
leave every all-reduce exact (no such all-reduce codec: fp8's per-block range buys a gradient sum
nothing over int8's, int4's error is too coarse to sum without a convergence check).
"""
from __future__ import annotations

import dataclasses

from cost_models.codecs import ALLREDUCE_CODECS
from planner.solver.objective import (
    Placement,
    allreduce_ms,
    price_program,
    stage_memory_bytes,
)
from planner.solver.problem import Problem
from planner.solver.solution import StagePlacement

AUTO_SLACK = 0.005
AUTO_ORDER = ("none", "fp8")  # tried in turn before keeping int8
# The all-reduce codecs each --compress offers a replicated stage (besides none).
ALLREDUCE_OFFERS = {"auto": ("int8", "powersgd"), "int8": ("int8",)}


def with_codecs(placement: Placement, codecs: list[str]) -> Placement:
    stages = tuple(dataclasses.replace(st, out_codec=c) for st, c in zip(placement.stages, codecs))
    return dataclasses.replace(placement, stages=stages)


def with_allreduce_codecs(placement: Placement, codecs: list[str]) -> Placement:
    stages = tuple(dataclasses.replace(st, allreduce_codec=c) for st, c in zip(placement.stages, codecs))
    return dataclasses.replace(placement, stages=stages)


def choose_allreduce_codecs(problem: Problem, placement: Placement) -> Placement:
    """``placement`` with every stage's ``allreduce_codec`` set (module docstring): under ``auto`` each
    replicated stage's cheapest codec, under ``int8`` int8 wherever it prices no dearer than exact."""
    plain = ["none"] * placement.num_stages
    replicated = [k for k, st in enumerate(placement.stages) if len(st.devices) > 1]
    offered = ALLREDUCE_OFFERS.get(problem.compress, ())
    if not offered or not replicated:
        return with_allreduce_codecs(placement, plain)
    codecs = list(plain)
    for k in replicated:
        fits = [c for c in ("none", *offered) if c == "none" or _fits(problem, placement, k, c)]
        codecs[k] = min(fits, key=lambda c: _stage_allreduce_ms(problem, placement.stages[k], c))  # ties: least lossy
    if problem.compress != "auto":
        return with_allreduce_codecs(placement, codecs)
    base = price_program(problem, with_allreduce_codecs(placement, plain)).step_ms
    best = price_program(problem, with_allreduce_codecs(placement, codecs)).step_ms
    if best >= base * (1 - AUTO_SLACK):
        return with_allreduce_codecs(placement, plain)
    for k in replicated:   # back to a less lossy codec wherever the step does not grow
        for codec in ALLREDUCE_CODECS[:ALLREDUCE_CODECS.index(codecs[k])]:
            trial = codecs[:k] + [codec] + codecs[k + 1:]
            if _fits(problem, placement, k, codec) and \
                    price_program(problem, with_allreduce_codecs(placement, trial)).step_ms <= best:
                codecs = trial
                break
    return with_allreduce_codecs(placement, codecs)


def _stage_allreduce_ms(problem: Problem, st: StagePlacement, codec: str) -> float:
    return allreduce_ms(problem, dataclasses.replace(st, allreduce_codec=codec))


def _fits(problem: Problem, placement: Placement, k: int, codec: str = "powersgd") -> bool:
    """Whether stage ``k``'s replicas still fit their memory with ``codec``'s error-feedback buffer."""
    st = dataclasses.replace(placement.stages[k], allreduce_codec=codec)
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
