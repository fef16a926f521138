"""The rivals a free plan is simulated against, and the choice among them (``planner.api.plan_chain``).

The solver's plan is compiled and simulated beside: the plans of the pool's restrictions (:func:`restricted`), the
solver's plan with its stage groups reordered across regions (:func:`reordered_rival`) or its boundaries' replicas
split over several verifier sites (:func:`shared_rivals`), the baselines, and the ppdp grid's shape solved as
``--stages/--replicas`` would (:func:`shaped_rival`). Those that can still win are compiled (:func:`compiled_rivals`,
each placement once: :func:`distinct`) and the fastest simulated is returned (:func:`choose_by_simulation`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from cost_models.cluster import ClusterSpec
from cost_models.training import TrainingConfig
from planner.errors import InfeasiblePlanError
from planner.ir import BlockChain
from planner.solver import api as solver_api
from planner.solver.outcome import reordered, shared
from planner.solver.policy import VerificationPolicy
from planner.solver.problem import recompute_problem
from planner.solver.restrictions import TRUSTED_ONLY, Restriction, part_budget_s
from planner.solver.solution import gap_of

# Baselines priced within this factor of the fastest simulated plan are compiled and simulated. Measured 2026-12-06
# at 1.2 on 55 plans (test_one_cost's and test_restrictions' random pools, benchmarks/pools.py at 5 s, plan_time's
# cases at 2-10 s): 99 rivals compiled, each simulated within 2.3e-7 of its price; none of the 84 priced above the
# best simulated so far (58 of them over 1.05x) won or improved it; at 1.05 at most 4 plans a call are compiled
# (AFTER_PLANS), at 1.2 up to 8, 1.1 s of the 2.5 s of CPU compiling rivals spent on those over 1.05x.
RIVAL_MARGIN = 1.05


def shaped_rival(found: Sequence[Any], chain: BlockChain, cluster: ClusterSpec, config: TrainingConfig,
                 policy: VerificationPolicy, *, workers: int, recompute: str, time_limit_s: float,
                 seed: int) -> list[Any]:
    """The ppdp baseline's shape solved as ``--stages/--replicas`` would (its blocks re-split for its devices,
    its cuts polished), at the free plan's microbatch size (the grid's own) and unbounded (``bounded=False``: its
    share, 1.5 s at a 30 s limit, all goes to its cuts' climb): the free plan is no slower than that forced grid
    (DT-FM spot's 8 x 8: 15,293.6 ms both, where the share spread over every count and their bounds gave 15,396.5)."""
    grid = next((s for s in found if s.report.method == "baseline:ppdp"), None)
    if grid is None or len({len(st.devices) for st in grid.stages}) != 1:
        return []
    shaped = solver_api.solve_or_explain(chain, cluster, config, policy, workers=workers, time_limit_s=time_limit_s,
                                         stages=len(grid.stages), replicas=len(grid.stages[0].devices),
                                         microbatch_sizes=(config.microbatch_size,), recompute_mode=recompute,
                                         seed=seed, bounded=False)
    if isinstance(shaped, InfeasiblePlanError):
        return []
    method = f"{shaped.report.method} on the ppdp grid's shape"
    return [dataclasses.replace(shaped, report=dataclasses.replace(shaped.report, method=method))]


def reordered_rival(solution: Any, chain: BlockChain, cluster: ClusterSpec, config: TrainingConfig,
                    policy: VerificationPolicy) -> list[Any]:
    """The solver's plan with its stage groups in their best order across regions (``search.stage_order``),
    if that differs, as a rival (plans whose stages recompute keep their order)."""
    if any(st.recompute for st in solution.stages):
        return []
    problem = solver_api.problem_for(chain, cluster, config, policy, config.microbatch_size)[0]
    found = reordered(problem, solution)
    return [] if found is None else [found]


def shared_rivals(solutions: Sequence[Any], chain: BlockChain, cluster: ClusterSpec, config: TrainingConfig,
                  policy: VerificationPolicy) -> list[Any]:
    """Each of ``solutions`` (the solver's plan, its restrictions' and reordered ones) with its boundaries'
    replicas split over several of the whole pool's verifier sites where that prices faster
    (``solver.shared_verifiers``), as rivals."""
    base = solver_api.problem_for(chain, cluster, config, policy, config.microbatch_size)[0]
    out = []
    for solution in solutions:
        if solution.num_microbatches != base.num_microbatches:
            continue
        # priced with the recomputing tables where it recomputes, as it was planned
        problem = recompute_problem(base) if any(st.recompute for st in solution.stages) else base
        found = shared(problem, solution)
        if found is not None:
            out.append(found)
    return out


def restricted(parts: Sequence[Restriction], chain: BlockChain, config: TrainingConfig,
               policy: VerificationPolicy, *, workers: int, recompute: str, sizes: Sequence[int],
               share_s: float, pool_s: float, seed: int = 0) -> list[Any]:
    """The solver's plan of each restriction of the pool (``planner.solver.restrictions``), sharing ``share_s`` of
    work (``part_budget_s``; ``pool_s``: the whole pool's search): rivals the full pool's plan must beat in
    simulation. The trusted hosts alone (inside every other part, and few) are planned at every microbatch size
    the pool's search tried (``sizes``: with a verifier host more the pool's plan took size 2, where they make
    1,498 ms against 1,236 at size 1); the others at the pool's plan's size (``config``'s) and the trusted hosts'
    best (a smaller pool's plan may take another size than the pool's: at every size, 176 devices took 40 s of
    CPU at a 30 s limit)."""
    out: list[Any] = []
    hint: tuple[int, ...] = ()
    for part in parts:
        at = tuple(sizes) if part.name == TRUSTED_ONLY else tuple(dict.fromkeys((config.microbatch_size, *hint)))
        found = solver_api.solve_or_explain(chain, part.cluster, config, policy, workers=workers,
                                            time_limit_s=part_budget_s(part, share_s, len(parts), pool_s),
                                            recompute_mode=recompute, seed=seed, microbatch_sizes=at)
        if not isinstance(found, InfeasiblePlanError):
            if part.name == TRUSTED_ONLY:
                hint = (config.global_batch // found.num_microbatches,)
            method = f"{found.report.method} on {part.name}"
            out.append(dataclasses.replace(found, report=dataclasses.replace(found.report, method=method)))
    return out


def compiled_rivals(plan: Any, found: Sequence[Any], compiled: Callable[[Any], Any]) -> list[Any]:
    """The baselines' plans (``found``: solutions) that can still beat ``plan`` in simulation, compiled and
    simulated, cheapest first: those priced within ``RIVAL_MARGIN`` of the fastest simulated so far (a
    program priced 5% dearer does not simulate faster: objectives are their simulation, test_one_cost within 5%)."""
    best_ms, out = plan.predicted.step_ms, []
    for rival in sorted(found, key=lambda s: s.predicted_step_ms):
        if rival.predicted_step_ms > RIVAL_MARGIN * best_ms:
            break
        out.append(compiled(rival))
        best_ms = min(best_ms, out[-1].predicted.step_ms)
    return out


def distinct(solution: Any, found: Sequence[Any]) -> list[Any]:
    """``found`` less the rivals placed as ``solution`` or as a rival before them (DT-FM worldwide at 60 s: the
    ppdp grid's shape solved gave the solver's plan): compiled again, each would simulate the same and lose the tie."""
    seen, out = {_placed(solution)}, []
    for rival in found:
        if _placed(rival) not in seen:
            seen.add(_placed(rival))
            out.append(rival)
    return out


def _placed(solution: Any) -> tuple[Any, ...]:
    """What a solution's compiled programs depend on: its stages, verifiers, microbatch count and schedule."""
    return solution.stages, solution.verifiers, solution.num_microbatches, solution.schedule


def choose_by_simulation(plan: Any, rivals: Sequence[Any]) -> Any:
    """The fastest simulated of the solver's ``plan`` and the ``rivals`` (baselines at the same microbatch
    size), its report saying what was simulated: a returned plan is never slower than a baseline it knows."""
    best = min([plan, *rivals], key=lambda p: p.predicted.step_ms)
    r = best.report
    diff = (r.objective_ms - best.predicted.step_ms) / best.predicted.step_ms if best.predicted.step_ms > 0 else 0.0
    notes = ((f"simulated step {best.predicted.step_ms:.3f} ms, objective {r.objective_ms:.3f} ms "
              f"({100 * diff:+.1f}%)"),
             "chosen by simulation: " + ", ".join(f"{p.report.method} {p.predicted.step_ms:.3f} ms"
                                                  for p in [plan, *rivals]))
    # A rival that wins takes the solve's bound (a plan of the same pool at one of the solve's microbatch counts:
    # sub-pools and baselines are planned at those), its gap to it, and the note saying what set it.
    if best is not plan:
        own = tuple(n for n in r.notes if not n.startswith(solver_api.BOUND_NOTE))
        solves = tuple(n for n in plan.report.notes if n.startswith(solver_api.BOUND_NOTE))
        r = dataclasses.replace(r, bound_ms=plan.report.bound_ms, gap=gap_of(r.objective_ms, plan.report.bound_ms),
                                status="FEASIBLE", notes=own + solves)
    return dataclasses.replace(best, report=dataclasses.replace(r, notes=r.notes + notes))
