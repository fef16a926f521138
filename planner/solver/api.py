"""Entry points: :func:`solve`, :func:`baseline`, :func:`solve_or_explain`.

A solve, for each candidate microbatch count ``M`` (decomposition: ``M`` is
fixed in an outer loop):

1. builds the cost tables (``problem.build_problem``) and rejects what totals
   already rule out (``explain.precheck``);
2. prices every one-stage plan exactly (pure data parallelism) and finds a
   good pipeline with the baselines and a sequence search (``dp``);
3. runs the CP-SAT model (``cpsat``) over every pipeline of 2 or more
   stages, hinted with the best plan so far.

The reported bound is ``min over M of min(best one-stage plan, CP-SAT bound
for >= 2 stages)``: every plan of the search space has some ``M`` and some
stage count, so it is a valid lower bound on the iteration time of the
search space described in ``planner.solver.cpsat``.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from cost_models.cluster import ClusterSpec
from cost_models.training import TrainingConfig
from planner.errors import InfeasiblePlanError, InvalidInputError
from planner.ir import BlockChain
from planner.solver import baselines as base
from planner.solver.cpsat import solve_cpsat
from planner.solver.dp import search_sequences
from planner.solver.explain import explain_infeasible, precheck
from planner.solver.objective import Placement, evaluate, violations
from planner.solver.policy import VerificationPolicy
from planner.solver.problem import Problem, build_problem, scale_chain
from planner.solver.solution import SolveReport, Solution

# (label, objective ms or None, bound ms or None, elapsed s): called while solving.
Progress = Callable[[str, float | None, float | None, float], None]

HEURISTIC_SHARE = 0.15  # of each M's time budget, for the sequence search that seeds CP-SAT


def microbatch_candidates(global_batch: int, *, max_count: int = 6) -> tuple[int, ...]:
    """Microbatch sizes worth trying: divisors of the global batch, spread from 1 to the whole batch."""
    divisors = [d for d in range(1, global_batch + 1) if global_batch % d == 0]
    if len(divisors) <= max_count:
        return tuple(divisors)
    picks = {divisors[round(i * (len(divisors) - 1) / (max_count - 1))] for i in range(max_count)}
    return tuple(sorted(picks))


def problem_for(chain: BlockChain, cluster: ClusterSpec, config: TrainingConfig, policy: VerificationPolicy,
                microbatch_size: int, *, max_replicas: int | None = None) -> tuple[Problem, BlockChain, TrainingConfig]:
    """Cost tables at ``microbatch_size`` and the chain and config they were built from."""
    cfg = dataclasses.replace(config, microbatch_size=microbatch_size)
    scaled = scale_chain(chain, microbatch_size)
    return build_problem(scaled, cluster, cfg, policy, max_replicas=max_replicas), scaled, cfg


@dataclass(frozen=True, slots=True, kw_only=True)
class _Outcome:
    """One M's result: the best plan found (or None), a valid bound, and what produced them."""

    problem: Problem
    placement: Placement | None
    step_ms: float
    bound_ms: float
    method: str
    cpsat_status: str
    solve_s: float


def _best(cands: Sequence[tuple[Placement, float, str]]) -> tuple[Placement | None, float, str]:
    best: tuple[Placement | None, float, str] = (None, math.inf, "none")
    for placement, step, how in cands:
        if step < best[1] - 1e-12:
            best = (placement, step, how)
    return best


def _incumbents(problem: Problem, budget_s: float) -> list[tuple[Placement, float, str]]:
    """One-stage plans, the baselines and the sequence search: valid plans with their step times."""
    out = []
    for placement in base.single_stage_placements(problem):
        ev = evaluate(problem, placement)
        if not violations(problem, placement, ev):
            out.append((placement, ev.step_ms, "data-parallel"))
    for name in base.BASELINES:
        try:
            placement = base.baseline_placement(name, problem)
        except InfeasiblePlanError:
            continue
        ev = evaluate(problem, placement)
        if not violations(problem, placement, ev):
            out.append((placement, ev.step_ms, f"baseline:{name}"))
    found = search_sequences(problem, time_budget_s=budget_s)
    if found is not None:
        out.append((found[0], found[1], "sequence-search"))
    return out


def _solve_problem(problem: Problem, time_limit_s: float, workers: int, label: str,
                   progress: Progress | None) -> _Outcome:
    start = time.perf_counter()
    precheck(problem)
    cands = _incumbents(problem, max(0.2, HEURISTIC_SHARE * time_limit_s))
    one_stage = min((s for p, s, _ in cands if p.num_stages == 1), default=math.inf)
    placement, step, how = _best(cands)
    if progress is not None and placement is not None:
        progress(label, step, None, time.perf_counter() - start)

    def report(obj: float | None, bound: float | None, elapsed: float) -> None:
        if progress is not None:
            progress(label, obj, None if bound is None else min(bound, one_stage), time.perf_counter() - start)

    left = time_limit_s - (time.perf_counter() - start)
    res = solve_cpsat(problem, time_limit_s=max(0.1, left), workers=workers,
                      hint=placement if placement is not None and placement.num_stages > 1 else None,
                      progress=report)
    if res.placement is not None:
        ev = evaluate(problem, res.placement)
        bad = violations(problem, res.placement, ev)
        assert not bad, f"CP-SAT returned an invalid plan: {bad}"
        if ev.step_ms < step - 1e-12:
            placement, step, how = res.placement, ev.step_ms, "cpsat"
    bound = min(one_stage, res.bound_ms)
    return _Outcome(problem=problem, placement=placement, step_ms=step, bound_ms=min(bound, step),
                    method=how, cpsat_status=res.status, solve_s=time.perf_counter() - start)


def _to_solution(outcome: _Outcome, bound_ms: float, notes: tuple[str, ...], solve_s: float,
                 method: str, status: str) -> Solution:
    placement = outcome.placement
    assert placement is not None
    ev = evaluate(outcome.problem, placement)
    gap = None if bound_ms is None else max(0.0, (ev.step_ms - bound_ms) / ev.step_ms) if ev.step_ms > 0 else 0.0
    report = SolveReport(method=method, status=status, objective_ms=ev.step_ms, bound_ms=bound_ms, gap=gap,
                         solve_s=solve_s, notes=notes)
    return Solution(stages=placement.stages, verifiers=placement.verifiers,
                    num_microbatches=placement.num_microbatches, schedule=outcome.problem.schedule,
                    predicted_step_ms=ev.step_ms, memory_bytes=ev.memory_bytes, report=report)


def solve(chain: BlockChain, cluster: ClusterSpec, config: TrainingConfig,
          policy: VerificationPolicy = VerificationPolicy(), *, time_limit_s: float = 30.0, workers: int = 2,
          microbatch_sizes: Sequence[int] | None = None, max_replicas: int | None = None,
          progress: Progress | None = None) -> Solution:
    """The best placement within ``time_limit_s`` with a proven bound (see the module docstring).

    ``microbatch_sizes``: candidates for the microbatch size (each must divide
    ``config.global_batch``); default: ``config.microbatch_size`` only. The
    returned solution's ``num_microbatches`` tells which one won.
    Raises :class:`InfeasiblePlanError` with the reason when no plan exists.
    """
    result = solve_or_explain(chain, cluster, config, policy, time_limit_s=time_limit_s, workers=workers,
                              microbatch_sizes=microbatch_sizes, max_replicas=max_replicas, progress=progress)
    if isinstance(result, InfeasiblePlanError):
        raise result
    return result


def solve_or_explain(chain: BlockChain, cluster: ClusterSpec, config: TrainingConfig,
                     policy: VerificationPolicy = VerificationPolicy(), *, time_limit_s: float = 30.0,
                     workers: int = 2, microbatch_sizes: Sequence[int] | None = None,
                     max_replicas: int | None = None, progress: Progress | None = None
                     ) -> Solution | InfeasiblePlanError:
    """Like :func:`solve`, but returns the explained :class:`InfeasiblePlanError` instead of raising it."""
    start = time.perf_counter()
    sizes = tuple(microbatch_sizes or (config.microbatch_size,))
    for mb in sizes:
        if mb < 1 or config.global_batch % mb:
            raise InvalidInputError(f"microbatch size {mb}", expected=f"a divisor of the global batch "
                                    f"{config.global_batch}", fix="pick sizes that divide the global batch")
    outcomes: list[_Outcome] = []
    first_error: InfeasiblePlanError | None = None
    for i, mb in enumerate(sizes):
        share = (time_limit_s - (time.perf_counter() - start)) / (len(sizes) - i)
        problem, _, _ = problem_for(chain, cluster, config, policy, mb, max_replicas=max_replicas)
        try:
            outcomes.append(_solve_problem(problem, max(0.2, share), workers,
                                           f"M={problem.num_microbatches}", progress))
        except InfeasiblePlanError as exc:
            first_error = first_error or exc
            outcomes.append(_Outcome(problem=problem, placement=None, step_ms=math.inf, bound_ms=math.inf,
                                     method="precheck", cpsat_status="INFEASIBLE", solve_s=0.0))
    found = [o for o in outcomes if o.placement is not None]
    if not found:
        if first_error is not None:
            return first_error
        return explain_infeasible(outcomes[0].problem, _quick_feasible(workers))
    best = min(found, key=lambda o: o.step_ms)
    bound = min(o.bound_ms for o in outcomes)
    proven = all(o.cpsat_status in ("OPTIMAL", "INFEASIBLE", "SKIPPED") for o in outcomes)
    gap = (best.step_ms - bound) / best.step_ms if best.step_ms > 0 else 0.0
    status = "OPTIMAL" if proven or gap <= 1e-9 else "FEASIBLE"
    notes = (f"microbatches {best.problem.num_microbatches} (size {config.global_batch // best.problem.num_microbatches})",
             f"best plan from {best.method}",
             *(f"M={o.problem.num_microbatches}: {'%.3f ms' % o.step_ms if o.placement else 'no plan'}, "
               f"bound {o.bound_ms:.3f} ms, CP-SAT {o.cpsat_status}" for o in outcomes))
    return _to_solution(best, bound, notes, time.perf_counter() - start, "cpsat", status)


def _quick_feasible(workers: int) -> Callable[[Problem], bool]:
    def feasible(problem: Problem) -> bool:
        try:
            precheck(problem)
        except InfeasiblePlanError:
            return False
        if any(not violations(problem, p) for p in base.single_stage_placements(problem)):
            return True
        res = solve_cpsat(problem, time_limit_s=5.0, workers=workers)
        return res.placement is not None
    return feasible


def baseline(name: str, chain: BlockChain, cluster: ClusterSpec, config: TrainingConfig,
             policy: VerificationPolicy = VerificationPolicy()) -> Solution:
    """A baseline's placement priced by the solver's objective (``bound_ms`` and ``gap`` are None).

    Raises :class:`InfeasiblePlanError` when the baseline's placement breaks memory or the policy.
    """
    start = time.perf_counter()
    problem = build_problem(scale_chain(chain, config.microbatch_size), cluster, config, policy)
    precheck(problem)
    placement = base.baseline_placement(name, problem)
    ev = evaluate(problem, placement)
    bad = violations(problem, placement, ev)
    if bad:
        raise InfeasiblePlanError(f"the {name} baseline has no valid plan here", found="; ".join(bad[:3]),
                                  fix="use the solver (it places stages to fit memory and the policy)")
    outcome = _Outcome(problem=problem, placement=placement, step_ms=ev.step_ms, bound_ms=math.inf,
                       method=f"baseline:{name}", cpsat_status="", solve_s=0.0)
    sol = _to_solution(outcome, None, (f"baseline {name}",), time.perf_counter() - start,
                       f"baseline:{name}", "FEASIBLE")
    return sol
