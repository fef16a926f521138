"""``make_plan``: model -> trace -> coarsen -> solve -> check -> compile, in one call.

:func:`plan_chain` does the same from an already coarsened chain (the CLI
traces with ``planner.model_io.load_chain`` and calls it).
"""
from __future__ import annotations

import contextvars
import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cost_models.cluster import DEFAULT_CLUSTER_PATH, ClusterSpec
from cost_models.cluster_file import cluster_source, load_cluster
from cost_models.memory import trace_dtype
from cost_models.precision import resolve_dtype
from cost_models.training import TrainingConfig
from models import hf
from planner.check import assert_valid
from planner.coarsen import coarsen
from planner.compile import compile_plan
from planner.errors import InfeasiblePlanError, InvalidInputError
from planner.ir import BlockChain
from planner.meta_twin import on_meta
from planner.plan_history import HistoryEntry, utc_stamp
from planner.plan_values import ModelRef
from planner.rivals import (
    RIVAL_MARGIN,
    choose_by_simulation,
    compiled_rivals,
    distinct,
    reordered_rival,
    restricted,
    shaped_rival,
    shared_rivals,
)
from planner.simulate import predict
from planner.solver import api as solver_api
from planner.solver import baseline_plans
from planner.solver.idle import idle_reasons
from planner.solver.objective import Placement
from planner.solver.policy import VerificationPolicy
from planner.solver.problem import recompute_problem
from planner.solver.problem_build import scale_chain
from planner.solver.restrictions import (
    SUB_POOL_SHARE,
    droppable,
    restrictions,
)
from planner.solver.search.budget import Work
from planner.solver.search.deadline import Deadline
from planner.solver.warm import WarmStart
from planner.trace import trace

DEFAULT_MICROBATCHES = 8  # global batch = this many traced microbatches when not given
# Of the time limit, kept back from the solve for the baselines that follow it (their enumerations, compiling
# and simulating those that can win), at most RIVALS_MAX_S: 176 devices need about 3 s.
RIVALS_SHARE = 0.1
RIVALS_MAX_S = 5.0
# Of the time limit, shared by the plans of the pool's restrictions (``planner.solver.restrictions``; the trusted
# hosts alone get at least ``restrictions.PART_MIN_S``): a pool planned whole is never slower than its trusted
# hosts alone, one device type, or the pool less a region.
RESTRICTIONS_SHARE = 0.2
SHAPED_SHARE = 0.05  # of the time limit: the ppdp grid's shape solved as a fixed shape (``rivals.shaped_rival``)
# Plans compiled and simulated after a free solve (its plan and the rivals that can still win; plan_time's cases
# compile 4 and 5): their predicted work is kept from the search's (``solver_api.solve``'s ``after_plans``), since
# no other budget counts it (DT-FM worldwide: ~0.5 s of CPU each). A fixed shape compiles its plan alone.
AFTER_PLANS = 4
# The plans of the smaller pools of one call (``_smaller``), by their hosts' names: (solution, config, origin, ms).
_SMALLER: contextvars.ContextVar[dict[frozenset[str], Any] | None] = contextvars.ContextVar(
    "stagewise_smaller_pools", default=None)


def _cluster(cluster: ClusterSpec | str | Path | None) -> ClusterSpec:
    if isinstance(cluster, ClusterSpec):
        return cluster
    return load_cluster(DEFAULT_CLUSTER_PATH if cluster is None else cluster)


def plan_chain(chain: BlockChain, cluster: ClusterSpec | str | Path | None, *, spec: str, seq: int | None = None,
               schedule: str = "1f1b", global_batch: int | None = None, microbatch_size: int | None = None,
               policy: VerificationPolicy | None = None, time_limit_s: float = 30.0, baseline: str | None = None,
               optimizer: str = "adam", dtype: str = "auto", workers: int = 2,
               progress: Any = None, gap_tolerance: float | None = None, stages: int | None = None,
               replicas: int | None = None, recompute: str = "auto", warm_start: WarmStart | None = None,
               started_s: float | None = None, model: ModelRef | None = None, seed: int = 0,
               compress: str = "none") -> Any:
    """Solve (or run a baseline) for ``chain`` and compile the plan.

    ``global_batch`` defaults to ``DEFAULT_MICROBATCHES`` traced microbatches.
    With ``microbatch_size`` None the solver chooses it among the divisors of
    the global batch (``planner.solver.api.microbatch_candidates``); a
    baseline then uses the traced microbatch size. ``gap_tolerance``: the
    solver stops once its plan is proven within this share of optimal
    (default ``planner.solver.api.GAP_TOLERANCE``, 0.01%). ``stages`` /
    ``replicas``: a fixed shape (pp stages of dp replicas each), else the
    solver's plan is compared with every baseline by simulating their
    programs and the fastest is returned (``choose_by_simulation``).
    ``dtype``: the compute dtype (``bf16``/``fp16``/``fp32`` or the full names); ``auto`` takes
    ``cost_models.precision.default_dtype`` of the cluster. Low precision trains with fp32 master weights.
    ``recompute``: activation recomputation per stage where memory binds (``auto``), ``never`` or ``always``.
    ``compress``: boundary codecs (``cost_models.codecs``): ``none``, one codec everywhere, or ``auto``
    (``planner.solver.codec_choice``).
    ``warm_start``: an old plan's stages for the solver to start from (``planner.solver.warm``; a re-plan's).
    ``model``: the plan's model reference when ``chain`` is not a fresh trace (a re-plan passes its old plan's
    chain, rescaled to that plan's microbatch, and its model): the fingerprint stays paired with the batch it
    was traced at, which the chain no longer says. By default the chain is the trace: ``spec``, ``seq`` and
    the chain's fingerprint at its own microbatch size.
    The plan's history starts with this plan (``planned``, now).

    Monotone in small pools (issue 36): a free solve over a pool of at most ``restrictions.DROP_EACH_UP_TO``
    untrusted worker and verifier hosts (``restrictions.droppable``) plans each of its sub-pools without some of
    them (recursively, each once a call) with ``restrictions.SUB_POOL_SHARE`` of the limit each, itself included,
    and returns the fastest simulated: at most ``2 ** DROP_EACH_UP_TO`` such plans, so the call keeps its limit.
    A sub-pool's plan is the one that pool's own call makes (the same share, arguments and seed; searches budgeted
    in work, repeatable for any ``workers``) and is compiled on the larger pool (the same devices and links), so a
    host or a verifier host more never plans slower than the smaller pool did, unless the wall-clock ceiling stops
    a search (its notes say so). Not covered: a first untrusted or verifier host beside trusted hosts alone (those
    plan with the whole limit), and pools past the bound.

    ``time_limit_s`` is a budget for the whole call, counted from ``started_s`` (``time.perf_counter``; default
    now: a caller that traced the model first passes when it started): the solve (less ``RIVALS_SHARE`` when
    baselines follow it, and the predicted work of compiling and simulating ``AFTER_PLANS`` plans: its own and the
    rivals'), the baselines' enumerations (the best found by the limit), compiling and simulating.
    Past it come what each step cannot split: one DP or CP-SAT call in the solve, compiling the plans that
    can still win. Its work is counted, not timed: the time before the call (start, imports, the trace) is not.
    """
    spec_cluster = _cluster(cluster)
    memo = _SMALLER.get()
    sub_pools = baseline is None and stages is None and replicas is None and warm_start is None \
        and (memo is not None or bool(droppable(spec_cluster)))
    if sub_pools and memo is None:  # each sub-pool's call, this one's own included, has the same share
        time_limit_s *= SUB_POOL_SHARE
    deadline = Deadline((time.perf_counter() if started_s is None else started_s) + time_limit_s)
    source = cluster_source(cluster)  # recorded: a run checks who is trusted against that file, not the copy
    policy = policy or VerificationPolicy()
    dtype_asked, dtype = dtype, resolve_dtype(dtype, spec_cluster)
    mixed = dtype != "float32"  # low-precision compute keeps fp32 master weights (planner.runtime.rank.precision)
    batch = global_batch or DEFAULT_MICROBATCHES * chain.microbatch_size
    if microbatch_size is not None and (microbatch_size < 1 or batch % microbatch_size):
        raise InvalidInputError(f"microbatch size {microbatch_size}", expected=f"a divisor of the global batch {batch}",
                                fix="choose --microbatches so that it divides --global-batch")
    if baseline is not None:
        mb = microbatch_size or (chain.microbatch_size if batch % chain.microbatch_size == 0 else 1)
        config = TrainingConfig(global_batch=batch, microbatch_size=mb, schedule=schedule, optimizer=optimizer,
                                dtype=dtype, mixed_precision=mixed, compress=compress)
        solution = baseline_plans.baseline(baseline, chain, spec_cluster, config, policy, deadline=deadline)
    else:
        sizes: Sequence[int] = (microbatch_size,) if microbatch_size else solver_api.microbatch_candidates(batch)
        config = TrainingConfig(global_batch=batch, microbatch_size=sizes[0], schedule=schedule,
                                optimizer=optimizer, dtype=dtype, mixed_precision=mixed, compress=compress)
        tolerance = solver_api.GAP_TOLERANCE if gap_tolerance is None else gap_tolerance
        free = stages is None and replicas is None
        kept = min(RIVALS_SHARE * time_limit_s, RIVALS_MAX_S) if free else 0.0
        # a small pool's restrictions are among the smaller pools it plans whole (``_smaller``)
        parts = restrictions(spec_cluster) if free and warm_start is None and not droppable(spec_cluster) else ()
        kept += (RESTRICTIONS_SHARE * time_limit_s if parts else 0.0) + (SHAPED_SHARE * time_limit_s if free else 0.0)
        solve_s = max(0.0, time_limit_s - kept)  # work, not what the clock left
        solution = solver_api.solve(chain, spec_cluster, config, policy, workers=workers, time_limit_s=solve_s,
                                    microbatch_sizes=sizes, progress=progress, gap_tolerance=tolerance,
                                    stages=stages, replicas=replicas, recompute_mode=recompute,
                                    warm_start=warm_start, seed=seed, after_plans=AFTER_PLANS if free else 1)
    mb = batch // solution.num_microbatches
    config = dataclasses.replace(config, microbatch_size=mb)
    scaled = scale_chain(chain, mb)
    ref = model or ModelRef(spec=spec, name=chain.model_name, fingerprint=chain.fingerprint,
                            batch=chain.microbatch_size, seq=seq, dtype=trace_dtype(chain))

    first = (HistoryEntry(event="planned", when_utc=utc_stamp(), reason=f"planned on {spec_cluster.name}"),)

    at_size = {(mb, config.dtype): (config, scaled)}
    hosts = frozenset(h.name for h in spec_cluster.hosts)
    made: dict[int, tuple[Any, TrainingConfig, frozenset[str]]] = {}  # each compiled plan's solution, config, origin

    def compiled(sol: Any, like: TrainingConfig = config, origin: frozenset[str] = hosts) -> Any:
        size = batch // sol.num_microbatches  # a restriction's plan may have its own microbatch size
        if (size, like.dtype) not in at_size:  # a smaller pool's plan, its own dtype (auto resolved there)
            at_size[size, like.dtype] = (dataclasses.replace(like, microbatch_size=size), scale_chain(chain, size))
        cfg, sc = at_size[size, like.dtype]
        assert_valid(sol, sc, spec_cluster, cfg, policy)  # independent memory/coverage check
        out = dataclasses.replace(predict(compile_plan(sol, sc, spec_cluster, cfg, policy, ref)),
                                  history=first, cluster_source=source)
        made[id(out)] = (sol, cfg, origin)  # origin: the hosts of the pool whose search made it
        return out

    plan = compiled(solution)
    if baseline is not None or stages is not None or replicas is not None:
        return plan
    token = _SMALLER.set({}) if memo is None and sub_pools else None
    try:
        smaller = [] if not sub_pools else _smaller(spec_cluster, lambda pool: plan_chain(
            chain, pool, spec=spec, seq=seq, schedule=schedule, global_batch=global_batch,
            microbatch_size=microbatch_size, policy=policy, time_limit_s=time_limit_s, optimizer=optimizer,
            dtype=dtype_asked, workers=workers, gap_tolerance=gap_tolerance, recompute=recompute, model=model,
            seed=seed, compress=compress))
    finally:
        if token is not None:
            _SMALLER.reset(token)
    found = restricted(parts, chain, config, policy, workers=workers, recompute=recompute, sizes=sizes,
                       share_s=RESTRICTIONS_SHARE * time_limit_s, pool_s=solve_s, seed=seed)
    found += reordered_rival(solution, chain, spec_cluster, config, policy)
    found += shared_rivals([solution, *found], chain, spec_cluster, config, policy)
    # The baselines' enumerations get the rivals' share in work (the same rivals on a loaded machine).
    found += baseline_plans.baselines(baseline_plans.BASELINE_NAMES, chain, spec_cluster, config, policy,
                                      deadline=Work(min(RIVALS_SHARE * time_limit_s, RIVALS_MAX_S), what="rivals"),
                                      within_ms=RIVAL_MARGIN * plan.predicted.step_ms)
    found += shaped_rival(found, chain, spec_cluster, config, policy, workers=workers, recompute=recompute,
                          time_limit_s=SHAPED_SHARE * time_limit_s, seed=seed)
    rivals = compiled_rivals(plan, distinct(solution, found), compiled)
    best_ms = min(p.predicted.step_ms for p in [plan, *rivals])
    # a smaller pool's plan simulates here as there (the same devices and links): compiled only if it can win
    rivals += [compiled(sol if memo is not None else _labeled(sol, hosts - origin), cfg, origin)
               for sol, cfg, origin, ms in smaller if ms < best_ms]
    best = min([plan, *rivals], key=lambda p: p.predicted.step_ms)
    if memo is not None:  # a smaller pool's call inside a larger one's: what it chose, to compile there
        memo[hosts] = (*made[id(best)], best.predicted.step_ms)
    chosen = choose_by_simulation(plan, rivals)
    if best is plan or memo is not None:
        return chosen
    sol, cfg, _ = made[id(best)]  # planned on part of the pool (a restriction, a sub-pool): why the rest idles
    return _with_idle_reasons(chosen, sol, solver_api.problem_for(chain, spec_cluster, cfg, policy,
                                                                  cfg.microbatch_size)[0])


def _labeled(solution: Any, dropped: frozenset[str]) -> Any:
    """``solution``'s report saying the pool it was planned on: this one without ``dropped`` hosts."""
    method = f"{solution.report.method} on the pool without {', '.join(sorted(dropped))}"
    return dataclasses.replace(solution, report=dataclasses.replace(solution.report, method=method))


def _with_idle_reasons(plan: Any, solution: Any, problem: Any) -> Any:
    """``plan`` (compiled from ``solution``, planned on part of the pool) with its idle lines made on the whole
    pool's ``problem``: its own search knew only that part, so the rest of the pool had no line (issue 36, item 6:
    SENTINEL's volunteers beside the trusted hosts' plan)."""
    if any(st.recompute for st in solution.stages):
        problem = recompute_problem(problem)
    stages = tuple(dataclasses.replace(st, in_flight=()) for st in solution.stages)
    placement = Placement(stages=stages, verifiers=solution.verifiers, num_microbatches=solution.num_microbatches)
    lines = idle_reasons(problem, placement, plan.predicted.step_ms)
    kept = [n for n in plan.report.notes if not n.startswith("idle:")]
    notes = (*kept[:-2], *lines, *kept[-2:])  # before the simulation's two lines (``choose_by_simulation``)
    return dataclasses.replace(plan, report=dataclasses.replace(plan.report, notes=notes))


def _smaller(cluster: ClusterSpec,
             plan_pool: Callable[[ClusterSpec], Any]) -> list[tuple[Any, TrainingConfig, frozenset[str], float]]:
    """The solution, config, origin (the hosts of the pool whose search made it) and simulated step (ms) of the plan
    ``plan_pool`` chooses for ``cluster`` without each of its ``droppable`` hosts, each smaller pool planned once a
    call (``_SMALLER``: a pool two hosts smaller is reached twice); those without a plan are left out."""
    memo = _SMALLER.get()
    assert memo is not None
    out = []
    for name in droppable(cluster):
        pool = cluster.without_hosts({name})
        key = frozenset(h.name for h in pool.hosts)
        if key not in memo:
            try:
                plan_pool(pool)
            except InfeasiblePlanError:
                memo[key] = None
        if memo[key] is not None:
            out.append(memo[key])
    return out


def make_plan(model: Any, example_inputs: Any, cluster: ClusterSpec | str | Path | None = None, *,
              schedule: str = "1f1b", global_batch: int | None = None, microbatch_size: int | None = None,
              policy: VerificationPolicy | None = None, time_limit_s: float = 30.0, baseline: str | None = None,
              optimizer: str = "adam", dtype: str = "auto", workers: int = 2, name: str | None = None,
              spec: str | None = None, gap_tolerance: float | None = None, stages: int | None = None,
              replicas: int | None = None, recompute: str = "auto") -> Any:
    """Trace ``model`` at ``example_inputs`` (their batch is the traced microbatch), solve, compile.

    A stock transformers ``PreTrainedModel`` is adapted in place first (``models.hf.adapt``, as for ``hf:``
    specs). The trace runs on meta copies of the weights (``planner.meta_twin``): real or meta, the same plan.
    Returns a :class:`planner.plan.Plan`; ``plan.save(path)`` writes it.
    Raises :class:`planner.errors.InfeasiblePlanError` with the reason when
    no plan fits the cluster and policy.
    """

    started = time.perf_counter()  # the time limit counts the trace too
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    hf.adapt_if_hf(model)  # a stock transformers model, adapted as the CLI adapts hf: specs
    with on_meta(model, inputs) as meta_inputs:  # the graph every rank exports, whatever the weights are on
        graph = trace(model, meta_inputs, name=name or type(model).__name__)
    chain = coarsen(graph)
    first = inputs[0] if inputs else None
    seq = int(first.shape[1]) if first is not None and getattr(first, "ndim", 0) == 2 \
        and not first.dtype.is_floating_point else None
    return plan_chain(chain, cluster, spec=spec or f"python:{type(model).__module__}.{type(model).__name__}",
                      seq=seq, schedule=schedule, global_batch=global_batch, microbatch_size=microbatch_size,
                      policy=policy, time_limit_s=time_limit_s, baseline=baseline, optimizer=optimizer,
                      dtype=dtype, workers=workers, gap_tolerance=gap_tolerance, stages=stages, replicas=replicas,
                      recompute=recompute, started_s=started)
