"""The gap tolerance ends a solve once its plan is proven close enough; plans the pricing cap skipped
are not lost."""
from __future__ import annotations

import dataclasses
import math
import re
import types

import numpy as np
import pytest

from cost_models.training import TrainingConfig
from planner.errors import InvalidInputError
from planner.rivals import choose_by_simulation
from planner.solver import api
from planner.solver.bound.counts import TERMS
from planner.solver.bound.lagrange import lagrange_bound
from planner.solver.objective import evaluate, violations
from planner.solver.policy import VerificationPolicy
from planner.solver.search import relaxed_plans
from planner.solver.solution import SolveReport
from tests.unit.bruteforce import brute_force
from tests.unit.solver_fixtures import homogeneous_cluster, random_chain
from tests.unit.test_solver_bruteforce import instance


def _config() -> TrainingConfig:
    return TrainingConfig(global_batch=32, microbatch_size=1)


def _replicated_homogeneous():
    rng = np.random.default_rng(3)
    chain = random_chain(rng, 120, param_scale=1e8, act_scale=2e7, flop_scale=2.4e10, out_scale=2e7, uniform=True)
    return chain, homogeneous_cluster(8, host_size=8)


def test_a_loose_tolerance_reports_optimal_within_it_and_skips_cpsat():
    chain, cluster = _replicated_homogeneous()
    sol = api.solve(chain, cluster, _config(), VerificationPolicy(), time_limit_s=20.0, gap_tolerance=0.05)
    # the search stops once its closed form is within the tolerance of its bound ...
    assert any("within the gap tolerance" in note for note in sol.report.notes), sol.report.notes
    # ... and the plan is OPTIMAL only if its programs' cost is within it of that cost's bound
    assert (sol.report.status == "OPTIMAL") == (sol.report.gap <= 0.05)


@pytest.mark.parametrize("bad", [-0.1, 1.0, math.nan])
def test_bad_tolerance_is_refused(bad):
    chain, cluster = _replicated_homogeneous()
    with pytest.raises(InvalidInputError, match="gap tolerance"):
        api.solve(chain, cluster, _config(), VerificationPolicy(), time_limit_s=1.0, gap_tolerance=bad)


def test_plans_skipped_by_the_pricing_cap_are_priced_before_returning(monkeypatch):
    """With the cap at nothing, every relaxed plan is skipped while the bound runs; the last ones are
    still priced, so the bound comes with a valid plan (without them: none)."""
    monkeypatch.setattr(relaxed_plans, "PLAN_SHARE", -1e9)
    priced = 0
    for seed in range(12):
        chain, cluster, config, policy = instance(seed)
        problem, _, _ = api.problem_for(chain, cluster, config, policy, config.microbatch_size)
        best, _ = brute_force(problem)
        if not math.isfinite(best):
            continue
        res = lagrange_bound(problem, incumbent_ms=best * 1.5, time_budget_s=60.0, max_dps=60)
        if res.placement is not None:
            priced += 1
            assert not violations(problem, res.placement, evaluate(problem, res.placement))
            assert res.step_ms >= best * (1 - 1e-9)
    assert priced >= 6


def test_each_counts_note_shows_its_raised_bound_and_the_least_is_the_reported_bound():
    """The per-count notes show each count's bound as raised after the search (``bound.counts``), so their least
    is the bound the report states (before: a count's own bound, below the headline where the raise lifted it)."""
    chain, cluster = _replicated_homogeneous()
    # three counts, the least's own bound 3,544.6 ms raised to 4,025.8 after the search
    sol = api.solve(chain, cluster, _config(), VerificationPolicy(), time_limit_s=4.0, microbatch_sizes=[1, 2, 4])
    bounds = [float(m.group(1)) for note in sol.report.notes if (m := re.match(r"M=\d+.*?, bound ([\d.]+) ms", note))]
    assert len(bounds) == 3, sol.report.notes
    assert min(bounds) == pytest.approx(sol.report.bound_ms, abs=1e-3)
    # one note says what set it: its value, the least count, and a bound the report knows by name
    said = [n for n in sol.report.notes if n.startswith(api.BOUND_NOTE)]
    assert len(said) == 1, sol.report.notes
    m = re.match(r"the bound: ([\d.]+) ms, set at M=(\d+) by (.+)$", said[0])
    assert m and float(m.group(1)) == pytest.approx(sol.report.bound_ms, abs=1e-3), said
    assert m.group(3) in TERMS.values(), said
    least = next(n for n in sol.report.notes if re.match(rf"M={m.group(2)}: .*, bound {m.group(1)} ms", n))
    assert least, sol.report.notes


@dataclasses.dataclass(frozen=True)
class _Simulated:
    """What ``choose_by_simulation`` reads of a plan: its simulated step and its report."""

    predicted: types.SimpleNamespace
    report: SolveReport


def _simulated(step_ms: float, method: str, bound_ms: float | None, notes: tuple[str, ...]) -> _Simulated:
    report = SolveReport(method=method, status="FEASIBLE", objective_ms=step_ms, bound_ms=bound_ms, gap=None,
                         solve_s=1.0, notes=notes)
    return _Simulated(predicted=types.SimpleNamespace(step_ms=step_ms), report=report)


def test_a_rival_that_wins_keeps_the_solves_bound_and_its_note():
    """A plan of a sub-pool (or a baseline) that simulates faster is returned with the whole pool's bound and its
    gap to it (before: "n/a"); the note on what set the bound is the solve's, not the rival's own (a sub-pool's
    bound holds for it alone)."""
    solve = _simulated(120.0, "cpsat", 60.0, ("M=8: ...", f"{api.BOUND_NOTE}60.000 ms, set at M=8 by x"))
    rival = _simulated(100.0, "cpsat on trusted hosts only", 90.0,
                       ("M=8: ...", f"{api.BOUND_NOTE}90.000 ms, set at M=8 by y"))
    got = choose_by_simulation(solve, [rival])
    assert got.report.method == "cpsat on trusted hosts only" and got.report.bound_ms == 60.0
    assert got.report.gap == pytest.approx(0.4)  # its objective against the solve's bound, as the CLI prints it
    said = [n for n in got.report.notes if n.startswith(api.BOUND_NOTE)]
    assert said == [f"{api.BOUND_NOTE}60.000 ms, set at M=8 by x"], got.report.notes
    # the solve's own plan winning keeps its report as it was
    kept = choose_by_simulation(solve, [_simulated(130.0, "baseline:dp", None, ())])
    assert kept.report.bound_ms == 60.0 and kept.report.notes[:2] == solve.report.notes
    # a solve without a bound (a baseline asked for): no gap
    unbounded = _simulated(120.0, "baseline:uniform", None, ())
    assert choose_by_simulation(unbounded, [rival]).report.gap is None


@pytest.mark.parametrize("limit", ["compute", "memory", "replicas", "fill", "links"])
def test_each_limit_of_the_link_bound_is_a_term_the_report_names(limit):
    """``bound.links`` says what limits its bound; the report names it by a ``TERMS`` key (not "a bound")."""
    from planner.solver import count_solve
    from planner.solver.bound.links import LinkBound
    assert count_solve._named(LinkBound(bound_ms=1.0, limit=limit, threshold_gbps=None, islands=1)) in TERMS
