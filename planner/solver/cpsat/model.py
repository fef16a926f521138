"""The CP-SAT model of partition + placement + replication + verification, for pipelines of >= 2 stages.

Search space (the same one ``tests/unit/bruteforce.py`` enumerates), at a
fixed microbatch count ``M``:

* stage slots: slot 0 is the first stage, slot ``K-1`` the last, and slots
  ``1..K-2`` optional middle stages used as a prefix; each slot ends at a
  block ``e_k`` (contiguous ranges covering the chain);
* each used slot runs on ``r`` devices of one device class
  (``Problem.replica_choices``: the smallest ``r`` for each busiest-replica
  share; a larger ``r`` with the same share never helps), at most the class's
  device count over all slots. Classes already merge interchangeable devices,
  which is the symmetry breaking: a plan that only permutes identical devices
  is one assignment here;
* the verifier of a checked boundary sits on one of its two end stages, on
  the first or the last stage (single-replica stages here, trusted, outside the
  checked senders' trust domain; the greedy of ``planner.solver.verifiers``
  that the other searches use also places them on replicas), or on a CPU verifier host, as the policy's
  ``verifier_placement`` allows, at most ``max_boundaries_per_verifier`` per
  device.

Costs and memory are those of ``planner.solver.objective`` term by term.
Times become integers at ``structure.COST_RESOLUTION`` of the chain's fastest
one-microbatch time, always rounded *down* (a range's time is a difference of
floored prefix sums, minus one unit), so the model never overprices a plan:
CP-SAT's best bound, divided back, is a valid lower bound on the true
objective over this search space. The plan it returns is re-priced exactly by
``objective.evaluate``. Memory is exact integer bytes.

Formulation choices. Cut positions are order-encoded (``ge[k][l] = [e_k >=
l]``) and every per-position table (time prefixes per class, parameters,
activations, boundary bytes, transfer and verify times per link/class) is a
linear sum over them: no value encoding, and the LP sees fractional cuts.
The stage-time constraints are enforced per (class, replicas) choice, which
the LP relaxes to almost nothing, so unconditional floors carry the bound:
each slot takes at least the best class's time of its blocks at the smallest
share plus its cheapest sends; ``T`` is at least the slowest block's best
time and the fluid bottleneck (``objective.fluid_bottleneck_ms``); and a
class's ``n`` devices hold at most ``n * T`` of work. CP-SAT gets a complete
hint (the caller's plan, completed by a solve with the decisions fixed); on
large models presolve is skipped, since it is slow there and drops the hint.

The model's variables and tables are in ``structure``; its costs (transfers, times, memory,
objective) in ``costs``, the verifier-placement part in ``verifiers``, hinting and decoding in
``hint`` (mixins of ``_Builder``).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

from ortools.sat.python import cp_model

from planner.solver.cpsat.costs import CostsMixin
from planner.solver.cpsat.hint import HintMixin, complete_hint, deterministic, stopped
from planner.solver.cpsat.structure import Structure
from planner.solver.cpsat.verifiers import VerificationMixin
from planner.solver.objective import Placement
from planner.solver.problem import Problem
from planner.solver.search.budget import Work

# Above this many (block, slot) pairs CP-SAT starts from the hinted plan without presolve.
PRESOLVE_LIMIT = 2000

Progress = Callable[[float | None, float | None, float], None]  # (objective ms, bound ms, seconds)


@dataclass(frozen=True, slots=True, kw_only=True)
class CpsatResult:
    status: str
    placement: Placement | None
    bound_ms: float
    solve_s: float
    num_slots: int


class _Builder(CostsMixin, VerificationMixin, HintMixin, Structure):
    """Builds the model; one instance per solve (variables from ``Structure``, costs, verification and
    hint/decode from the mixins)."""

    def build(self) -> None:
        self._slots()
        self._tables()
        self._transfers()
        if self.verify:
            self._verification()
        self._times()
        self._memory()
        self._objective()


class _Progress(cp_model.CpSolverSolutionCallback):
    def __init__(self, units_per_ms: float, report: Progress | None) -> None:
        super().__init__()
        self.U, self.report = units_per_ms, report

    def on_solution_callback(self) -> None:
        if self.report is not None:
            self.report(self.objective_value / self.U, self.best_objective_bound / self.U, self.wall_time)


def num_slots(problem: Problem) -> int:
    """Most stages a plan can have: one block and one device each."""
    devices = sum(c.count for c in problem.classes if c.stage_capable)
    return min(problem.num_blocks, devices)


def solve_cpsat(problem: Problem, *, time_limit_s: float, workers: int = 2, hint: Placement | None = None,
                max_slots: int | None = None, progress: Progress | None = None,
                gap_tolerance: float = 0.0, seed: int = 0, within: Work | None = None) -> CpsatResult:
    """Solve the model of the module docstring for pipelines of 2 to ``max_slots`` stages.

    ``bound_ms`` is a valid lower bound over those pipelines (``inf`` when
    proven infeasible); the search stops (OPTIMAL) once its plan is within
    ``gap_tolerance`` of it. ``time_limit_s``: nominal seconds, CP-SAT's deterministic time
    (``deterministic``: the same answer on a loaded machine), charged to ``within`` when given, whose
    wall-clock ceiling stops it too.
    """
    K = min(num_slots(problem), max_slots or num_slots(problem))
    start = time.perf_counter()
    if K < 2:
        return CpsatResult(status="SKIPPED", placement=None, bound_ms=math.inf, solve_s=0.0, num_slots=K)
    b = _Builder(problem, K)
    b.build()
    hinted = False
    work = Work.of(time_limit_s, within, "CP-SAT")
    hint_s = min(5.0, 0.2 * time_limit_s) if hint is not None else 0.0
    if hint is not None:
        b.hint(hint)
        hinted = complete_hint(b.m, hint_s, workers, seed=seed, within=work)
    solver = cp_model.CpSolver()
    deterministic(solver, max(0.05, time_limit_s - hint_s), workers, seed, work)
    solver.parameters.relative_gap_limit = gap_tolerance
    if hinted and problem.num_blocks * K > PRESOLVE_LIMIT:
        # Presolve of a large model is slow and drops the hinted plan; search from the plan instead.
        solver.parameters.cp_model_presolve = False
    if progress is not None:
        solver.best_bound_callback = lambda bound: progress(None, bound / b.U, time.perf_counter() - start)
    status = solver.solve(b.m, _Progress(b.U, progress))
    stopped(solver, status, work)
    name = solver.status_name(status)
    placement = b.decode(solver) if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) else None
    if status == cp_model.INFEASIBLE:
        bound = math.inf
    else:
        bound = max(0.0, solver.best_objective_bound / b.U)
    return CpsatResult(status=name, placement=placement, bound_ms=bound,
                       solve_s=time.perf_counter() - start, num_slots=K)
