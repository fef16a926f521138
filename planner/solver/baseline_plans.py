"""The baselines' plans (uniform, params, greedy, dp, ppdp), priced by the solver's objective: :func:`baseline`
and :func:`baselines`; the planning API compares them with the solver's plan by simulation."""
from __future__ import annotations

import math
import time
from collections.abc import Sequence

from cost_models.cluster import ClusterSpec
from cost_models.training import TrainingConfig
from planner.errors import InfeasiblePlanError, InvalidInputError
from planner.ir import BlockChain
from planner.solver.explain import precheck
from planner.solver.objective import evaluate, price_program, violations
from planner.solver.outcome import Outcome, to_solution
from planner.solver.policy import VerificationPolicy
from planner.solver.problem import Problem
from planner.solver.problem_build import build_problem, scale_chain
from planner.solver.search import baselines as base
from planner.solver.search.budget import Work, evaluate_units, placement_units
from planner.solver.search.deadline import Deadline
from planner.solver.search.grid import best_grid
from planner.solver.solution import Solution

BASELINE_NAMES = (*base.BASELINES, "ppdp")
DEFAULT_POLICY = VerificationPolicy()  # the policy's defaults (frozen: one shared instance)


def baseline(name: str, chain: BlockChain, cluster: ClusterSpec, config: TrainingConfig,
             policy: VerificationPolicy = DEFAULT_POLICY, *, deadline: Deadline | Work | None = None) -> Solution:
    """A baseline's placement priced by the solver's objective (``bound_ms`` and ``gap`` are None); ``deadline``
    as in :func:`baselines`.

    Raises :class:`InfeasiblePlanError` when the baseline's placement breaks memory or the policy.
    """
    start = time.perf_counter()
    problem = build_problem(scale_chain(chain, config.microbatch_size), cluster, config, policy)
    precheck(problem)
    _check_names((name,))
    return _baseline_solution(_baseline_outcome(name, problem, deadline), start)


def baselines(names: Sequence[str], chain: BlockChain, cluster: ClusterSpec, config: TrainingConfig,
              policy: VerificationPolicy = DEFAULT_POLICY, *, deadline: Deadline | Work | None = None,
              within_ms: float = math.inf) -> list[Solution]:
    """The named baselines' plans that exist here, in the order named, priced as :func:`baseline`'s, on one set
    of cost tables; a name whose plan breaks memory or the policy, or is priced above ``within_ms`` (it cannot
    win: its report, which explains every idle device, is not worth the seconds), is left out.

    Past ``deadline``, ppdp's grids and dp's caps stop, each with the best found by then: the first valid grid
    and the smallest bottleneck's partition at least; the other baselines take milliseconds.
    """
    start = time.perf_counter()
    _check_names(names)
    problem = build_problem(scale_chain(chain, config.microbatch_size), cluster, config, policy)
    try:
        precheck(problem)
    except InfeasiblePlanError:
        return []
    out = []
    for name in names:
        try:
            outcome = _baseline_outcome(name, problem, deadline)
        except InfeasiblePlanError:
            continue
        if outcome.program_ms <= within_ms:
            out.append(_baseline_solution(outcome, start))
    return out


def _check_names(names: Sequence[str]) -> None:
    for name in names:
        if name not in BASELINE_NAMES:
            raise InvalidInputError(f"baseline {name!r}", expected=" or ".join(BASELINE_NAMES))


def _baseline_outcome(name: str, problem: Problem, deadline: Deadline | Work | None) -> Outcome:
    placement = best_grid(problem, deadline) if name == "ppdp" else base.baseline_placement(name, problem, deadline)
    if deadline is not None:  # its pricing below: the closed form, the violations and the programs (issue 36)
        deadline.charge(evaluate_units(placement) + placement_units(placement))
    ev = evaluate(problem, placement)
    bad = violations(problem, placement, ev)
    if bad:
        raise InfeasiblePlanError(f"the {name} baseline has no valid plan here", found="; ".join(bad[:3]),
                                  fix="use the solver (it places stages to fit memory and the policy)")
    return Outcome(problem=problem, placement=placement, step_ms=ev.step_ms, bound_ms=math.inf,
                   method=f"baseline:{name}", cpsat_status="", solve_s=0.0,
                   program_ms=price_program(problem, placement).step_ms)


def _baseline_solution(outcome: Outcome, start: float) -> Solution:
    name = outcome.method.removeprefix("baseline:")
    return to_solution(outcome, None, (f"baseline {name}",), time.perf_counter() - start, outcome.method, "FEASIBLE")
