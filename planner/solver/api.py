"""Entry points: :func:`solve`, :func:`solve_or_explain` (the baselines': ``baseline_plans``).

A solve, for each candidate microbatch count ``M`` (decomposition: ``M`` is
fixed in an outer loop, the time split evenly among the counts ``explain.precheck``
does not rule out; what they leave unused hill-climbs the best count's plan, ``count_solve.polish_best``):

1. builds the cost tables (``problem_build.build_problem``) and rejects what totals
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
   cost (``polish``) and bounds it with free links (``problem.comm_free_for_bound``)
   in the ``VALID_BOUND_SHARE`` of the time held back (``POLISH_SHARE`` of it for the hill-climb).

What the search's bound bounds (kept in the notes): the closed form
``objective.evaluate`` of every plan of the search space described in
``planner.solver.cpsat.model``: per ``M`` ``max(fluid, sequence DP, merged sequence DP,
min(best one-stage plan, CP-SAT bound))``. That closed form counts sends as busy
time, which the compiled programs overlap, so it does not bound what they cost;
the reported bound does: the fluid LP and the Lagrangian bound with free links,
the minimum over ``M``. With ``stages``/``replicas`` the plans are the grids of
that shape (``grid.shaped``).

Every time here is nominal seconds of work (``search.budget``: counted, not timed), so the same inputs and seed
give the same plan on a loaded machine; the wall clock only stops a search at a ceiling, which the notes report.

Here: the candidate counts, their triage and the time split among them. One count's search (steps 2-5)
is ``count_search``, its plan (step 6) ``count_solve``; ``outcome`` holds a count's result and turns the
chosen one into the :class:`Solution`.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

from cost_models.cluster import ClusterSpec
from cost_models.training import TrainingConfig
from planner.errors import InfeasiblePlanError, InvalidInputError
from planner.ir import BlockChain
from planner.solver import recompute
from planner.solver.bound.counts import TERMS, CountBound, raised_with_terms
from planner.solver.bound.sequence_dp_kernel import warm as warm_kernels
from planner.solver.count_search import SLOT_CAP
from planner.solver.count_solve import beyond, polish_best, solve_count
from planner.solver.cpsat.model import solve_cpsat
from planner.solver.explain import explain_infeasible, precheck
from planner.solver.objective import price_program, program_memory, violations
from planner.solver.outcome import Outcome, Progress, ruled_out, to_solution
from planner.solver.policy import VerificationPolicy
from planner.solver.problem import Problem, recompute_problem
from planner.solver.problem_build import build_problem, scale_chain
from planner.solver.search import baselines as base
from planner.solver.search.budget import UNITS_PER_S, Work, compile_units, watch_ceiling
from planner.solver.search.seq_partition_kernel import warm as warm_partition
from planner.solver.search.sequences import search_sequences
from planner.solver.solution import Solution, gap_of
from planner.solver.warm import WarmStart

# A plan within this share of the bound is reported OPTIMAL and ends the search for its M: the costs
# are models (a few percent off a measured step), and proving the last 0.01% can take the whole budget.
GAP_TOLERANCE = 1e-4
# Microbatches per step a plan may have: the runtime's message tags hold 13 bits of microbatch index
# (planner.runtime.wire.comm.MAX_MICROBATCHES), and pricing a program costs time in proportion to its count.
MAX_MICROBATCHES = 8192
DEFAULT_POLICY = VerificationPolicy()  # the policy's defaults (frozen: one shared instance)
MIN_SHARE_S = 0.2  # nominal seconds of work each problem (a microbatch count, with or without recompute) gets at least


def microbatch_candidates(global_batch: int, *, max_count: int = 6) -> tuple[int, ...]:
    """Microbatch sizes worth trying: divisors of the global batch that leave at most ``MAX_MICROBATCHES``
    per step, spread from the smallest to the whole batch (found in at most that many steps, any batch)."""
    counts = [m for m in range(1, min(global_batch, MAX_MICROBATCHES) + 1) if global_batch % m == 0]
    divisors = sorted(global_batch // m for m in counts)
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


def solve(chain: BlockChain, cluster: ClusterSpec, config: TrainingConfig,
          policy: VerificationPolicy = DEFAULT_POLICY, *, time_limit_s: float = 30.0, workers: int = 2,
          microbatch_sizes: Sequence[int] | None = None, max_replicas: int | None = None,
          progress: Progress | None = None, gap_tolerance: float = GAP_TOLERANCE,
          stages: int | None = None, replicas: int | None = None, recompute_mode: str = "auto",
          warm_start: WarmStart | None = None, seed: int = 0, after_plans: int = 0) -> Solution:
    """The best placement within ``time_limit_s`` with a proven bound (see the module docstring).

    ``microbatch_sizes``: candidates for the microbatch size (each must divide
    ``config.global_batch``); default: ``config.microbatch_size`` only. The
    returned solution's ``num_microbatches`` tells which one won. ``stages`` /
    ``replicas``: fix the pipeline's depth / every stage's replica count.
    ``recompute_mode``: ``auto`` searches activation recomputation too where memory is tight
    (``planner.solver.recompute``), ``never`` / ``always`` as named. ``warm_start``: an old plan's stages
    (a re-plan's), repaired to this cluster and tried first (``planner.solver.warm``). ``seed``: the randomised
    steps' and CP-SAT's. The search is budgeted in work (``search.budget``), ``time_limit_s`` nominal seconds of it:
    the same inputs and seed give the same plan on a quiet or a loaded machine, unless the wall-clock ceiling
    (``budget.CEILING_FACTOR`` times the limit) stops it first, which the notes then say. ``after_plans``: plans the
    caller compiles and simulates once the search is done (its plan and rivals): their predicted work is kept from
    the search's (``_after_s``). The counts' bounds are raised after it in a budget of their own
    (``_counts_bound_s``: 5% of the limit, at least 2 s, at most half the limit): the plan is the search's alone.
    Raises :class:`InfeasiblePlanError` with the reason when no plan exists.
    """
    result = solve_or_explain(chain, cluster, config, policy, time_limit_s=time_limit_s, workers=workers,
                              microbatch_sizes=microbatch_sizes, max_replicas=max_replicas, progress=progress,
                              gap_tolerance=gap_tolerance, stages=stages, replicas=replicas,
                              recompute_mode=recompute_mode, warm_start=warm_start, seed=seed,
                              after_plans=after_plans)
    if isinstance(result, InfeasiblePlanError):
        raise result
    return result


def solve_or_explain(chain: BlockChain, cluster: ClusterSpec, config: TrainingConfig,
                     policy: VerificationPolicy = DEFAULT_POLICY, *, time_limit_s: float = 30.0,
                     workers: int = 2, microbatch_sizes: Sequence[int] | None = None,
                     max_replicas: int | None = None, progress: Progress | None = None,
                     gap_tolerance: float = GAP_TOLERANCE, stages: int | None = None,
                     replicas: int | None = None, recompute_mode: str = "auto",
                     warm_start: WarmStart | None = None, seed: int = 0,
                     after_plans: int = 0, bounded: bool = True) -> Solution | InfeasiblePlanError:
    """Like :func:`solve`, but returns the explained :class:`InfeasiblePlanError` instead of raising it.
    ``bounded`` False: a rival for another solve's plan, whose bound no one reads: none is raised past the cheap
    ones (the fluid LP), and the work the bounds would take goes to its plan's climb."""
    with watch_ceiling() as cut:
        result = _solve(chain, cluster, config, policy, time_limit_s, workers, microbatch_sizes, max_replicas,
                        progress, gap_tolerance, (stages, replicas), recompute_mode, warm_start, seed,
                        after_plans, bounded)
    if cut and isinstance(result, Solution):
        note = (f"stopped by the wall-clock ceiling ({', '.join(cut)}): plan may differ from a quiet machine's",)
        report = dataclasses.replace(result.report, notes=result.report.notes + note)
        result = dataclasses.replace(result, report=report)
    return result


def _solve(chain: BlockChain, cluster: ClusterSpec, config: TrainingConfig, policy: VerificationPolicy,
           time_limit_s: float, workers: int, microbatch_sizes: Sequence[int] | None, max_replicas: int | None,
           progress: Progress | None, gap_tolerance: float, shape: tuple[int | None, int | None],
           recompute_mode: str, warm_start: WarmStart | None, seed: int,
           after_plans: int = 0, bounded: bool = True) -> Solution | InfeasiblePlanError:
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
    outcomes: list[Outcome] = []
    errors: list[InfeasiblePlanError] = []
    auto = recompute_mode == "auto"
    # What totals rule out is set aside first, so the time is shared among the problems that can have plans.
    jobs = _triaged([p for mb in sizes for p in recompute.variants(
        problem_for(chain, cluster, config, policy, mb, max_replicas=max_replicas)[0], recompute_mode)],
        auto, outcomes, errors)
    # Each problem gets at least MIN_SHARE_S, past the limit where there are many: the ceiling allows for that.
    work = Work(time_limit_s, what="search", ceiling_s=max(time_limit_s, MIN_SHARE_S * len(jobs)))
    freed_s = 0.0  # the shares of counts not searched: kept for the bounds after the search
    for i, problem in enumerate(jobs):
        share = (work.left_s() - freed_s - _after_s(outcomes, jobs, after_plans, time_limit_s,
                                                    last=i == len(jobs) - 1)) / (len(jobs) - i)
        # a count whose cheap bounds already reach the best plan found is not searched (the later counts' shares
        # stay as they were: the last one's side budgets run past its share, and past the limit with a larger one)
        incumbent_ms = min((o.program_ms for o in outcomes if o.placement is not None), default=math.inf)
        if shape == (None, None) and (skipped := beyond(problem, incumbent_ms, work, mixes=auto)) is not None:
            outcomes.append(skipped)  # under ``auto`` its bounds hold for its recomputing twin too: not searched
            freed_s += max(0.0, share)
            continue
        try:
            outcome = solve_count(problem, max(MIN_SHARE_S, share), workers, f"M={problem.num_microbatches}", progress,
                                  gap_tolerance, shape, warm_start, within=work, seed=seed, bounded=bounded)
        except InfeasiblePlanError as exc:
            errors.append(exc)
            outcome = ruled_out(problem)
        outcomes.append(outcome)
        if auto and not problem.recompute and (outcome.placement is None or _memory_tight(outcome)):
            # Nothing fits without recomputation, or memory shaped the plan: with it, other shapes may fit.
            jobs += _triaged([recompute_problem(problem)], auto, outcomes, errors)
    found = [o for o in outcomes if o.placement is not None]
    if not found:
        if errors:
            return errors[0]
        return explain_infeasible(outcomes[0].problem, _quick_feasible(workers))
    # the climb gets what the searched counts left, not the shares of those dismissed: with them, a pool planned
    # alone climbed further than the same pool planned as a restriction of a larger one, in its small share
    # (pools.py: sentinel-1g-v0 1,220.6 ms, with a CPU verifier host 1,235.5)
    left_s = work.left_s() - freed_s - _after_s(outcomes, jobs, after_plans, time_limit_s)
    best = polish_best(min(found, key=lambda o: o.program_ms), left_s, cuts_only=shape != (None, None), within=work)
    # Each count bounds the compiled programs' cost at its M; the least is raised after the search, in a budget
    # of its own (``bound.counts``) and what the search left unused (the shares of counts its bounds dismissed, a
    # climb that converged): a count whose work could not pay for its fill test or its Lagrangian bound gets them
    # now; the notes show each count's bound so raised.
    unused_s = max(0.0, work.left_s() - _after_s(outcomes, jobs, after_plans, time_limit_s))
    counts = [CountBound(o.problem, o.valid_bound_ms, o.program_ms if o.placement is not None else math.inf,
                         o.bound_by) for o in outcomes]
    raised = raised_with_terms(counts, best.program_ms, Work(_counts_bound_s(time_limit_s) + unused_s,
                                                             what="bounds after the search")) \
        if bounded else [(min(c.bound_ms, c.program_ms), c.by) for c in counts]
    least = min(range(len(raised)), key=lambda k: raised[k][0])
    bound = raised[least][0]
    status = "OPTIMAL" if gap_of(best.program_ms, bound) <= gap_tolerance else "FEASIBLE"
    M = best.problem.num_microbatches
    notes = (f"microbatches {M} (size {config.global_batch // M})",
             f"best plan from {best.method}",
             _bound_note(outcomes[least], *raised[least]),
             *(_count_note(o, b) for o, (b, _) in zip(outcomes, raised)))
    return to_solution(best, bound, notes, time.perf_counter() - start, "cpsat", status)


# How the report's note on what set its bound starts (``planner.rivals.choose_by_simulation`` keeps the solve's own
# where a plan of a sub-pool, whose bound it is not, wins).
BOUND_NOTE = "the bound: "


def _bound_note(o: Outcome, bound_ms: float, by: str) -> str:
    """What set the reported bound: the least count's, and the bound that count's is."""
    return f"{BOUND_NOTE}{bound_ms:.3f} ms, set at M={o.problem.num_microbatches} by {TERMS.get(by, 'a bound')}"


def _count_note(o: Outcome, bound_ms: float) -> str:
    """One microbatch count's line of the report: its plan's cost and its bound as raised after the search."""
    count = f"M={o.problem.num_microbatches}{' recompute' if o.problem.recompute else ''}"
    if o.method == "beyond":
        return (f"{count}: not searched, bound {bound_ms:.3f} ms ({TERMS.get(o.bound_by, 'a bound')}): "
                f"CP-SAT {o.cpsat_status}")
    program = f"{o.program_ms:.3f} ms" if o.placement else "no plan"
    return (f"{count}: program {program}, bound {bound_ms:.3f} ms; search closed form {o.step_ms:.3f} ms, "
            f"its bound {o.bound_ms:.3f} ms, CP-SAT {o.cpsat_status}")


# The counts' bounds raised after the search: 5% of the limit, at least 2 s (DT-FM regional's two counts at 20 s),
# at most half the limit (the tests' 1 s plans).
COUNTS_BOUND_SHARE, COUNTS_BOUND_MIN_S = 0.05, 2.0


def _counts_bound_s(limit_s: float) -> float:
    return min(0.5 * limit_s, max(COUNTS_BOUND_MIN_S, COUNTS_BOUND_SHARE * limit_s))


# Of the search's work, at most, kept for the plans compiled and simulated after it (``after_plans``; DT-FM worldwide:
# 4 plans of 512 x 8 stage passes, 5.3 nominal s, 21% of its search at 30 s): where the limit is too short for them,
# the search keeps the rest.
AFTER_MAX_SHARE = 0.25


def _after_s(outcomes: Sequence[Outcome], jobs: Sequence[Problem], plans: int, limit_s: float, *,
             last: bool = True) -> float:
    """Nominal seconds of the search's work kept for ``plans`` plans compiled and simulated after it
    (``budget.compile_units``), at the size of the cheapest plan found so far (deterministic: no clock read); before
    any, none while other problems follow (not ``last``: the reserve is sized once a plan is found, and the largest
    plan the problems allow, a stage per block at their most microbatches, kept the cap, 6.4 of DT-FM worldwide's
    25.5 nominal s at 30 s, from its first count's share), else that largest; at most ``AFTER_MAX_SHARE`` of the
    search's ``limit_s``."""
    if plans <= 0 or not jobs:
        return 0.0
    found = [o for o in outcomes if o.placement is not None]
    if not found and not last:
        return 0.0
    if found:
        best = min(found, key=lambda o: o.program_ms).placement
        M, S = best.num_microbatches, best.num_stages
    else:
        M = max(p.num_microbatches for p in jobs)
        S = max(min(p.num_blocks, sum(c.count for c in p.classes if c.stage_capable)) for p in jobs)
    return min(AFTER_MAX_SHARE * limit_s, plans * compile_units(M, S) / UNITS_PER_S)


# A plan holding this share of some device's memory was shaped by memory: the search also tries recomputation,
# which frees activations for shapes that do not fit without it (llama-7b at 2048 tokens on 40 24-GB GPUs: 34
# single-device stages 10.4 s a step, 20 stages of 2 recomputing 7.4 s).
MEMORY_TIGHT = 0.8


def _memory_tight(outcome: Outcome) -> bool:
    problem, placement = outcome.problem, outcome.placement
    in_flight = price_program(problem, placement).in_flight
    return any(used >= MEMORY_TIGHT * problem.classes[problem.class_of(dev)].mem_bytes
               for dev, used in program_memory(problem, placement, in_flight))


def _triaged(problems: list[Problem], auto: bool, outcomes: list[Outcome],
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
            outcomes.append(ruled_out(problem))
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
