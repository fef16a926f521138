"""Entry points: :func:`solve`, :func:`baseline`, :func:`solve_or_explain`.

A solve, for each candidate microbatch count ``M`` (decomposition: ``M`` is
fixed in an outer loop, the time split evenly among the counts ``explain.precheck``
does not rule out; what they leave unused hill-climbs the best count's plan, ``_polished``):

1. builds the cost tables (``problem.build_problem``) and rejects what totals
   already rule out (``explain.precheck``);
2. when one class of trusted devices without replication is the whole
   search space, the exact DP (``chain_dp.homogeneous_dp``) is the answer;
3. else prices every one-stage plan exactly (pure data parallelism) and finds
   a good pipeline with the baselines and a sequence search (``search.sequences``);
4. computes the sequence DP's Lagrangian bound (``lagrange``): it sees the
   communication, verifier copies, 1F1B in-flight memory and all-reduce
   that the fluid LP cannot (branching on block classes where it stalls), and
   every relaxed plan it meets is repaired, re-partitioned (``seq_partition``) and
   priced, often improving the incumbent
   (``LAGRANGE_SHARE`` of the time; a short look on models small enough
   for CP-SAT to prove optimality alone); when several classes share a
   device type (many hosts), half of that time bounds the problem with
   them merged (``bound.relax``), which the DP, cubic in the classes, can afford;
   then a local search over stage sequences from the best plan
   (``search.local``, at most ``LOCAL_SHARE`` of the time);
5. runs the CP-SAT model (``cpsat``) hinted with the best plan so far: over
   every stage count when ``blocks x slots <= MODEL_SIZE_LIMIT``, else
   (decomposition by stage count) over pipelines of at most ``SLOT_CAP``
   stages, where its search improves the incumbent far better than on the
   full model (tuning history: benchmarks/README.md).

6. keeps, of every valid plan the steps above met (and every uniform pp x dp
   grid, ``grid``), the one whose compiled programs cost least
   (``objective.price_program``: the reported objective), hill-climbs on that
   cost (``polish``) and bounds it with free links (``bound.relax.comm_free_for_bound``)
   in the ``VALID_BOUND_SHARE`` of the time held back (``POLISH_SHARE`` of it for the hill-climb).

What the search's bound bounds (kept in the notes): the closed form
``objective.evaluate`` of every plan of the search space described in
``planner.solver.cpsat.model``: per ``M`` ``max(fluid, sequence DP, merged sequence DP,
min(best one-stage plan, CP-SAT bound))``. That closed form counts sends as busy
time, which the compiled programs overlap, so it does not bound what they cost;
the reported bound does: the fluid LP and the Lagrangian bound with free links,
the minimum over ``M``. With ``stages``/``replicas`` the plans are the grids of
that shape (``grid.shaped``).
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
from planner.solver import recompute
from planner.solver.bound.lagrange import lagrange_bound
from planner.solver.bound.relax import comm_free_for_bound, merged_for_bound
from planner.solver.bound.sequence_dp_kernel import warm as warm_kernels
from planner.solver.cpsat.model import num_slots, solve_cpsat
from planner.solver.explain import explain_infeasible, precheck
from planner.solver.idle import idle_reasons
from planner.solver.link_tests import keep_link_tests, lost_link_tests
from planner.solver.objective import (
    Placement,
    evaluate,
    price_program,
    program_memory,
    simple_lower_bound_ms,
    violations,
)
from planner.solver.policy import VerificationPolicy
from planner.solver.problem import (
    Problem,
    build_problem,
    recompute_problem,
    scale_chain,
)
from planner.solver.search import baselines as base
from planner.solver.search.chain_dp import homogeneous_dp
from planner.solver.search.deadline import Deadline
from planner.solver.search.grid import best_grid, cheapest, grid_candidates, shaped
from planner.solver.search.local import improve
from planner.solver.search.polish import polish
from planner.solver.search.seq_partition_kernel import warm as warm_partition
from planner.solver.search.sequences import search_sequences
from planner.solver.solution import Solution, SolveReport, StagePlacement
from planner.solver.warm import WarmStart, warm_placements

# (label, objective ms or None, bound ms or None, elapsed s): called while solving.
Progress = Callable[[str, float | None, float | None, float], None]

# Of each M's time budget, for the sequence search that seeds the bound and CP-SAT: small, as the bound's first
# DPs soon find far better plans than it does (tuning history: benchmarks/README.md).
HEURISTIC_SHARE = 0.05
# The uniform grids that seed the search get twice the sequence search's time (every shape: ~4 s at 176 devices).
GRID_BUDGET_FACTOR = 2.0
MODEL_SIZE_LIMIT = 4_000  # blocks x stage slots up to which the CP-SAT model covers every stage count
SLOT_CAP = 20  # slots of the smaller model beyond that: CP-SAT improves plans far better there
LAGRANGE_SHARE = 0.75  # of each M's time budget on large models, for the sequence-DP bound and its plans
# At most, for the local search from the best plan after it (``search.local``), before CP-SAT: per second the
# most productive step there (tuning history: benchmarks/README.md).
LOCAL_SHARE = 0.1
LAGRANGE_SMALL_S = 1.0  # at most this on models small enough for CP-SAT to prove optimality alone
# A plan within this share of the bound is reported OPTIMAL and ends the search for its M: the costs
# are models (a few percent off a measured step), and proving the last 0.01% can take the whole budget.
GAP_TOLERANCE = 1e-4
CPSAT_PROVES_LIMIT = 600  # blocks x stage slots up to which CP-SAT proves optimality within a solve's budget
# Blocks x stage slots above which CP-SAT's last seconds go to the local search: at that size CP-SAT finds no
# plan within a solve's budget, where the local search keeps improving.
CPSAT_HOPELESS = 10_000
# Of each M's time budget, held back to hill-climb on the cost of the compiled programs (``polish``: the
# objective itself; on DT-FM's spot case it needs ~2 s of a 7 s share to converge) and bound that cost (the
# search's bounds are on its closed form, which prices sends as busy time: ``bound.relax.comm_free_for_bound``).
VALID_BOUND_SHARE = 0.3
POLISH_SHARE = 2 / 3  # of the time held back


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
    """One M's result: the best plan found (or None), bounds, and what produced them.

    ``step_ms`` and ``bound_ms``: the search's closed form (``objective.evaluate``) of the plan and a bound on
    it; ``program_ms``: the cost of the plan's compiled programs (``objective.price_program``), the plan
    chosen among every valid plan the search met by it; ``valid_bound_ms``: a bound on that cost of any plan.
    """

    problem: Problem
    placement: Placement | None
    step_ms: float
    bound_ms: float
    method: str
    cpsat_status: str
    solve_s: float
    program_ms: float = math.inf
    valid_bound_ms: float = 0.0


def _best(cands: Sequence[tuple[Placement, float, str]]) -> tuple[Placement | None, float, str]:
    best: tuple[Placement | None, float, str] = (None, math.inf, "none")
    for placement, step, how in cands:
        if step < best[1] - 1e-12:
            best = (placement, step, how)
    return best


def _incumbents(problem: Problem, budget_s: float) -> list[tuple[Placement, float, str]]:
    """One-stage plans, the baselines and the sequence search: valid plans with their step times. The ``dp``
    baseline's DP stops at ``budget_s``, the grids at ``GRID_BUDGET_FACTOR`` times it (the best found by then)."""
    deadline = Deadline.after(budget_s)
    out = []
    for placement in base.single_stage_placements(problem):
        ev = evaluate(problem, placement)
        if not violations(problem, placement, ev):
            out.append((placement, ev.step_ms, "data-parallel"))
    for name in base.BASELINES:
        try:
            placement = base.baseline_placement(name, problem, deadline)
        except InfeasiblePlanError:
            continue
        ev = evaluate(problem, placement)
        if not violations(problem, placement, ev):
            out.append((placement, ev.step_ms, f"baseline:{name}"))
    # Every uniform pp x dp grid, the cheapest few also with their blocks split for their devices: the
    # search starts no worse than ppdp or a fixed shape would.
    for placement in grid_candidates(problem, deadline=Deadline.after(GRID_BUDGET_FACTOR * budget_s)):
        out.append((placement, evaluate(problem, placement).step_ms, "baseline:ppdp"))
    found = search_sequences(problem, time_budget_s=budget_s)
    if found is not None:
        out.append((found[0], found[1], "sequence-search"))
    return out


def _homogeneous_exact(problem: Problem) -> Placement | None:
    """The exact DP's plan when it covers the whole search space, else None.

    That is: one class of stage devices, nothing to verify, and no replication
    allowed (one replica choice). The DP then minimises ``F`` over every plan.
    """
    stage = [c for c in problem.classes if c.stage_capable]
    if len(stage) != 1:
        return None
    c, pol = stage[0], problem.policy
    if problem.replica_choices(c.index) != (1,) or (pol.enabled and not c.trusted):
        return None
    part = homogeneous_dp(problem, c.index, c.count)
    if part is None:
        return None
    M = problem.num_microbatches
    stages = tuple(StagePlacement(index=k, first_block=a, last_block=b, devices=(c.device_ids[k],),
                                  microbatches=(M,)) for k, (a, b) in enumerate(part.ranges))
    return Placement(stages=stages, verifiers=(), num_microbatches=M)


def _solve_problem(problem: Problem, time_limit_s: float, workers: int, label: str,
                   progress: Progress | None, gap_tolerance: float = GAP_TOLERANCE,
                   shape: tuple[int | None, int | None] = (None, None), warm: WarmStart | None = None) -> _Outcome:
    """Search (``_search``), then keep the plan whose compiled programs cost least among every valid plan the
    search met, and bound that cost (``bound.relax.comm_free_for_bound``) in the time held back for it. With a
    ``shape`` (stages, replicas per stage) the plans are the grids of that shape (``grid.shaped``)."""
    start = time.perf_counter()
    relaxed = recompute.bound_problem(problem)  # bounds every mix of stages with and without recompute
    if shape != (None, None):
        precheck(problem)
        placement = shaped(problem, stages=shape[0], replicas=shape[1], time_budget_s=time_limit_s / 2)
        found = _Outcome(problem=problem, placement=placement, step_ms=evaluate(problem, placement).step_ms,
                         bound_ms=0.0, method=f"grid {shape[0] or 'any'} x {shape[1] or 'any'}",
                         cpsat_status="SKIPPED (fixed shape)", solve_s=0.0)
        seen = [placement]
    else:
        seen = []
        found = _search(problem, (1 - VALID_BOUND_SHARE) * time_limit_s, workers, label, progress, gap_tolerance,
                        seen, warm)
    if found.placement is None:
        return dataclasses.replace(found, valid_bound_ms=simple_lower_bound_ms(relaxed))
    pick = cheapest(problem, seen + [found.placement])[0]
    program_ms = price_program(problem, pick).step_ms
    left = time_limit_s - (time.perf_counter() - start)
    placement, polished_ms = polish(problem, pick, time_budget_s=max(0.05, POLISH_SHARE * left),
                                    cuts_only=shape != (None, None))
    how = found.method if pick is found.placement else f"{found.method}, repriced"
    if polished_ms < program_ms:
        program_ms, how = polished_ms, f"{how}, polished"
    placement, program_ms = recompute.mix(problem, placement)
    # The search's own bound holds for its problem; with recomputation, only the relaxation's hold for a mix.
    valid = max(simple_lower_bound_ms(relaxed), found.valid_bound_ms if relaxed is problem else 0.0)
    left = time_limit_s - (time.perf_counter() - start)
    if program_ms - valid > gap_tolerance * program_ms and left > 0.05:
        free = comm_free_for_bound(merged_for_bound(relaxed) or relaxed)
        valid = max(valid, lagrange_bound(free, incumbent_ms=program_ms, time_budget_s=left, target_gap=gap_tolerance,
                                          plans=False).bound_ms)
    return dataclasses.replace(found, placement=placement, method=how, program_ms=program_ms,
                               valid_bound_ms=min(valid, program_ms), solve_s=time.perf_counter() - start)


def _search(problem: Problem, time_limit_s: float, workers: int, label: str, progress: Progress | None,
            gap_tolerance: float, seen: list[Placement], warm: WarmStart | None = None) -> _Outcome:
    """The search for ``problem`` under the closed form, adding every valid plan it meets to ``seen``; a
    ``warm`` start (an old plan repaired, ``solver.warm``) joins the first incumbents."""
    start = time.perf_counter()
    precheck(problem)
    exact = _homogeneous_exact(problem)
    if exact is not None:
        ev = evaluate(problem, exact)
        assert not violations(problem, exact, ev), "the homogeneous DP returned an invalid plan"
        if progress is not None:
            progress(label, ev.step_ms, ev.step_ms, time.perf_counter() - start)
        seen.append(exact)
        return _Outcome(problem=problem, placement=exact, step_ms=ev.step_ms, bound_ms=ev.step_ms,
                        method="dp-exact", cpsat_status="SKIPPED", solve_s=time.perf_counter() - start)
    cands = _incumbents(problem, max(0.2, HEURISTIC_SHARE * time_limit_s))
    cands += warm_placements(problem, warm) if warm is not None else []
    seen.extend(p for p, _, _ in cands)
    one_stage = min((s for p, s, _ in cands if p.num_stages == 1), default=math.inf)
    placement, step, how = _best(cands)
    if progress is not None and placement is not None:
        progress(label, step, None, time.perf_counter() - start)

    def report(obj: float | None, bound: float | None, elapsed: float) -> None:
        if progress is not None:
            progress(label, obj, None if bound is None else min(bound, one_stage), time.perf_counter() - start)

    lb_all = simple_lower_bound_ms(problem)  # valid for every plan of this M
    K_full = num_slots(problem)
    large = problem.num_blocks * K_full > MODEL_SIZE_LIMIT
    exhaustive = problem.num_blocks * K_full <= CPSAT_PROVES_LIMIT
    # The sequence DP's Lagrangian bound sees communication, which the fluid LP cannot; on small
    # models CP-SAT usually proves optimality by itself, so the DP gets only a short look there.
    lag_budget = min(LAGRANGE_SMALL_S, 0.1 * time_limit_s) if exhaustive else LAGRANGE_SHARE * time_limit_s
    # Many hosts of one device type make many classes, and the DP cubic in them: half of the time then
    # goes to the bound of the problem with like classes merged (a relaxation, valid for bounds only).
    coarse = None if exhaustive else merged_for_bound(problem)
    if coarse is not None:
        lb_all = max(lb_all, lagrange_bound(coarse, incumbent_ms=step, time_budget_s=lag_budget / 2,
                                            target_gap=gap_tolerance, plans=False).bound_ms)
        lag_budget /= 2
    lag = lagrange_bound(problem, incumbent_ms=step, time_budget_s=lag_budget, target_gap=gap_tolerance,
                         workers=workers)
    lb_all = max(lb_all, lag.bound_ms)
    if lag.placement is not None:
        seen.append(lag.placement)
    if lag.placement is not None and lag.step_ms < step - 1e-12:
        placement, step, how = lag.placement, lag.step_ms, "sequence-dp"
        report(step, None, 0.0)
    # Decomposition by stage count: the full model when it is small enough to build and search;
    # else a model with fewer slots that can still improve the incumbent (then its bound only
    # covers pipelines of at most K stages, so the reported bound falls back to the fluid LP).
    K = min(K_full, SLOT_CAP) if large else K_full
    hopeless = problem.num_blocks * K > CPSAT_HOPELESS  # CP-SAT's time goes to the local search instead

    def proven(step_ms: float) -> bool:  # within the tolerance of the bound: nothing left to search
        return step_ms - lb_all <= gap_tolerance * step_ms

    if placement is not None and not exhaustive and not proven(step):  # small models: CP-SAT proves it alone
        left = time_limit_s - (time.perf_counter() - start) - 0.5  # a re-partition can outlast the deadline
        better = improve(problem, placement, step, time_budget_s=left if hopeless else LOCAL_SHARE * time_limit_s,
                         target_ms=lb_all / (1 - gap_tolerance))
        if better is not None:
            seen.append(better[0])
            placement, step, how = better[0], better[1], "local-search"
            report(step, None, 0.0)
        if hopeless and not proven(step):
            return _Outcome(problem=problem, placement=placement, step_ms=step, bound_ms=min(lb_all, step),
                            method=how, cpsat_status="SKIPPED (model too large to improve the plan)",
                            solve_s=time.perf_counter() - start)
    hint = placement if placement is not None and placement.num_stages > 1 else None
    if K < K_full and (hint is None or hint.num_stages > K):
        # The slot model cannot hold the incumbent: seed it with the best plan that fits.
        found = search_sequences(problem, time_budget_s=max(0.2, HEURISTIC_SHARE * time_limit_s), max_stages=K)
        hint = found[0] if found is not None else None
    left = time_limit_s - (time.perf_counter() - start)
    status, cp_bound = "SKIPPED", math.inf if K_full < 2 else 0.0
    if placement is not None and proven(step):
        return _Outcome(problem=problem, placement=placement, step_ms=step, bound_ms=min(lb_all, step),
                        method=how, cpsat_status="SKIPPED (within the gap tolerance)",
                        solve_s=time.perf_counter() - start)
    if K >= 2 and left > 0.5 and (K == K_full or hint is not None):
        res = solve_cpsat(problem, time_limit_s=left, workers=workers, hint=hint, max_slots=K, progress=report,
                          gap_tolerance=gap_tolerance)
        status = res.status if K == K_full else f"{res.status} (<= {K} stages)"
        if K == K_full:
            cp_bound = res.bound_ms
        if res.placement is not None:
            ev = evaluate(problem, res.placement)
            bad = violations(problem, res.placement, ev)
            assert not bad, f"CP-SAT returned an invalid plan: {bad}"
            seen.append(res.placement)
            if ev.step_ms < step - 1e-12:
                placement, step, how = res.placement, ev.step_ms, "cpsat"
    bound = max(min(one_stage, cp_bound), lb_all)
    return _Outcome(problem=problem, placement=placement, step_ms=step, bound_ms=min(bound, step),
                    method=how, cpsat_status=status, solve_s=time.perf_counter() - start)


def _to_solution(outcome: _Outcome, bound_ms: float, notes: tuple[str, ...], solve_s: float,
                 method: str, status: str) -> Solution:
    assert outcome.placement is not None
    placement = keep_link_tests(outcome.problem, outcome.placement)
    priced = price_program(outcome.problem, placement)
    gap = None if bound_ms is None else max(0.0, (priced.step_ms - bound_ms) / priced.step_ms) \
        if priced.step_ms > 0 else 0.0
    notes = notes + idle_reasons(outcome.problem, placement, priced.step_ms) + \
        lost_link_tests(outcome.problem, placement)
    report = SolveReport(method=method, status=status, objective_ms=priced.step_ms, bound_ms=bound_ms, gap=gap,
                         solve_s=solve_s, notes=notes)
    stages = tuple(dataclasses.replace(st, in_flight=n, recompute=outcome.problem.tables(st.recompute).recompute)
                   for st, n in zip(placement.stages, priced.in_flight))
    return Solution(stages=stages, verifiers=placement.verifiers,
                    num_microbatches=placement.num_microbatches, schedule=outcome.problem.schedule,
                    predicted_step_ms=priced.step_ms,
                    memory_bytes=program_memory(outcome.problem, placement, priced.in_flight), report=report)


def solve(chain: BlockChain, cluster: ClusterSpec, config: TrainingConfig,
          policy: VerificationPolicy = VerificationPolicy(), *, time_limit_s: float = 30.0, workers: int = 2,
          microbatch_sizes: Sequence[int] | None = None, max_replicas: int | None = None,
          progress: Progress | None = None, gap_tolerance: float = GAP_TOLERANCE,
          stages: int | None = None, replicas: int | None = None, recompute_mode: str = "auto",
          warm_start: WarmStart | None = None) -> Solution:
    """The best placement within ``time_limit_s`` with a proven bound (see the module docstring).

    ``microbatch_sizes``: candidates for the microbatch size (each must divide
    ``config.global_batch``); default: ``config.microbatch_size`` only. The
    returned solution's ``num_microbatches`` tells which one won. ``stages`` /
    ``replicas``: fix the pipeline's depth / every stage's replica count.
    ``recompute_mode``: ``auto`` searches activation recomputation too where memory is tight
    (``planner.solver.recompute``), ``never`` / ``always`` as named. ``warm_start``: an old plan's stages
    (a re-plan's), repaired to this cluster and tried first (``planner.solver.warm``).
    Raises :class:`InfeasiblePlanError` with the reason when no plan exists.
    """
    result = solve_or_explain(chain, cluster, config, policy, time_limit_s=time_limit_s, workers=workers,
                              microbatch_sizes=microbatch_sizes, max_replicas=max_replicas, progress=progress,
                              gap_tolerance=gap_tolerance, stages=stages, replicas=replicas,
                              recompute_mode=recompute_mode, warm_start=warm_start)
    if isinstance(result, InfeasiblePlanError):
        raise result
    return result


def solve_or_explain(chain: BlockChain, cluster: ClusterSpec, config: TrainingConfig,
                     policy: VerificationPolicy = VerificationPolicy(), *, time_limit_s: float = 30.0,
                     workers: int = 2, microbatch_sizes: Sequence[int] | None = None,
                     max_replicas: int | None = None, progress: Progress | None = None,
                     gap_tolerance: float = GAP_TOLERANCE, stages: int | None = None,
                     replicas: int | None = None, recompute_mode: str = "auto",
                     warm_start: WarmStart | None = None) -> Solution | InfeasiblePlanError:
    """Like :func:`solve`, but returns the explained :class:`InfeasiblePlanError` instead of raising it."""
    start = time.perf_counter()
    # The first call on a machine compiles the DP kernels (seconds; numba's cache after): part of the budget.
    warm_kernels()
    warm_partition()
    if not 0.0 <= gap_tolerance < 1.0:
        raise InvalidInputError("gap tolerance", expected="a relative gap in [0, 1), e.g. 1e-4",
                                found=repr(gap_tolerance), fix="pass a small non-negative number")
    sizes = tuple(microbatch_sizes or (config.microbatch_size,))
    for mb in sizes:
        if mb < 1 or config.global_batch % mb:
            raise InvalidInputError(f"microbatch size {mb}", expected=f"a divisor of the global batch "
                                    f"{config.global_batch}", fix="pick sizes that divide the global batch")
    outcomes: list[_Outcome] = []
    errors: list[InfeasiblePlanError] = []
    auto = recompute_mode == "auto"
    # What totals rule out is set aside first, so the time is shared among the problems that can have plans.
    jobs = _triaged([p for mb in sizes for p in recompute.variants(
        problem_for(chain, cluster, config, policy, mb, max_replicas=max_replicas)[0], recompute_mode)],
        auto, outcomes, errors)
    for i, problem in enumerate(jobs):
        share = (time_limit_s - (time.perf_counter() - start)) / (len(jobs) - i)
        try:
            outcome = _solve_problem(problem, max(0.2, share), workers, f"M={problem.num_microbatches}", progress,
                                     gap_tolerance, (stages, replicas), warm_start)
        except InfeasiblePlanError as exc:
            errors.append(exc)
            outcome = _ruled_out(problem)
        outcomes.append(outcome)
        if outcome.placement is None and auto and not problem.recompute:
            # Nothing fits without recomputation: it may with it.
            jobs += _triaged([recompute_problem(problem)], auto, outcomes, errors)
    found = [o for o in outcomes if o.placement is not None]
    if not found:
        if errors:
            return errors[0]
        return explain_infeasible(outcomes[0].problem, _quick_feasible(workers))
    best = _polished(min(found, key=lambda o: o.program_ms), time_limit_s - (time.perf_counter() - start),
                     cuts_only=(stages, replicas) != (None, None))
    bound = min(o.valid_bound_ms for o in outcomes)  # bounds the compiled programs' cost at every M
    gap = (best.program_ms - bound) / best.program_ms if best.program_ms > 0 else 0.0
    status = "OPTIMAL" if gap <= gap_tolerance else "FEASIBLE"
    M = best.problem.num_microbatches
    notes = (f"microbatches {M} (size {config.global_batch // M})",
             f"best plan from {best.method}",
             *(f"M={o.problem.num_microbatches}{' recompute' if o.problem.recompute else ''}: program {'%.3f ms' % o.program_ms if o.placement else 'no plan'}"
               f", bound {o.valid_bound_ms:.3f} ms; search closed form {o.step_ms:.3f} ms, its bound "
               f"{o.bound_ms:.3f} ms, CP-SAT {o.cpsat_status}" for o in outcomes))
    return _to_solution(best, bound, notes, time.perf_counter() - start, "cpsat", status)


def _polished(best: _Outcome, left_s: float, *, cuts_only: bool) -> _Outcome:
    """``best`` hill-climbed further in the time the microbatch counts left unused (those ruled out or proven
    early): each count's own hill-climb gets a small share, and the best count is where it pays."""
    if left_s <= 0.1:
        return best
    placement, ms = polish(best.problem, best.placement, time_budget_s=left_s, cuts_only=cuts_only)
    if ms >= best.program_ms:
        return best
    how = best.method if best.method.endswith("polished") else f"{best.method}, polished"
    return dataclasses.replace(best, placement=placement, program_ms=ms, method=how,
                               valid_bound_ms=min(best.valid_bound_ms, ms))


def _ruled_out(problem: Problem) -> _Outcome:
    return _Outcome(problem=problem, placement=None, step_ms=math.inf, bound_ms=math.inf, method="precheck",
                    cpsat_status="INFEASIBLE", solve_s=0.0, valid_bound_ms=math.inf)


def _triaged(problems: list[Problem], auto: bool, outcomes: list[_Outcome],
             errors: list[InfeasiblePlanError]) -> list[Problem]:
    """The problems ``explain.precheck`` passes; each one it rules out joins ``outcomes`` and ``errors`` (under
    ``auto``, with its recomputing twin triaged in turn)."""
    kept = []
    for problem in problems:
        try:
            precheck(problem)
            kept.append(problem)
        except InfeasiblePlanError as exc:
            errors.append(exc)
            outcomes.append(_ruled_out(problem))
            if auto and not problem.recompute:
                kept += _triaged([recompute_problem(problem)], auto, outcomes, errors)
    return kept


def _quick_feasible(workers: int) -> Callable[[Problem], bool]:
    """Whether a relaxed problem has a plan (a few seconds: heuristics, then a small CP-SAT model)."""
    def feasible(problem: Problem) -> bool:
        try:
            precheck(problem)
        except InfeasiblePlanError:
            return False
        if any(not violations(problem, p) for p in base.single_stage_placements(problem)):
            return True
        if search_sequences(problem, time_budget_s=1.0) is not None:
            return True
        return solve_cpsat(problem, time_limit_s=5.0, workers=workers, max_slots=SLOT_CAP).placement is not None
    return feasible


BASELINE_NAMES = (*base.BASELINES, "ppdp")


def baseline(name: str, chain: BlockChain, cluster: ClusterSpec, config: TrainingConfig,
             policy: VerificationPolicy = VerificationPolicy(), *, deadline: Deadline | None = None) -> Solution:
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
              policy: VerificationPolicy = VerificationPolicy(), *, deadline: Deadline | None = None,
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


def _baseline_outcome(name: str, problem: Problem, deadline: Deadline | None) -> _Outcome:
    placement = best_grid(problem, deadline) if name == "ppdp" else base.baseline_placement(name, problem, deadline)
    ev = evaluate(problem, placement)
    bad = violations(problem, placement, ev)
    if bad:
        raise InfeasiblePlanError(f"the {name} baseline has no valid plan here", found="; ".join(bad[:3]),
                                  fix="use the solver (it places stages to fit memory and the policy)")
    return _Outcome(problem=problem, placement=placement, step_ms=ev.step_ms, bound_ms=math.inf,
                    method=f"baseline:{name}", cpsat_status="", solve_s=0.0,
                    program_ms=price_program(problem, placement).step_ms)


def _baseline_solution(outcome: _Outcome, start: float) -> Solution:
    name = outcome.method.removeprefix("baseline:")
    return _to_solution(outcome, None, (f"baseline {name}",), time.perf_counter() - start, outcome.method, "FEASIBLE")
