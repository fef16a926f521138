"""The uniform grids' work charge (``budget.grid_try_units``, ``grid_check_units``, ``evaluate_units``): a grid is
charged by how far ``grid._grid`` took it, shapes out of reach are never tried, the closed form's ranking in
``grid.cheapest`` is charged, and the grids seeding a count's search spend a budget beside the count's (issue 36:
the old flat charge billed the 1000-block x 176-device pool 83 s for 3.7 s of CPU)."""
from __future__ import annotations

import numpy as np
import pytest

from cost_models.training import TrainingConfig
from planner.solver import count_search
from planner.solver.policy import VerificationPolicy
from planner.solver.problem_build import build_problem, scale_chain
from planner.solver.search import grid
from planner.solver.search.budget import (
    UNITS_PER_S,
    Work,
    evaluate_units,
    grid_check_units,
    grid_rank_units,
    grid_setup_units,
    grid_try_units,
    placement_units,
)
from tests.unit.program_fixtures import wide_area_cluster
from tests.unit.solver_fixtures import random_chain


@pytest.fixture(scope="module")
def problem():
    """12 devices in 2-4 regions, some untrusted, trusted end stages wanted; 6 microbatches (fewer than the devices:
    shapes of more replicas are out of reach)."""
    rng = np.random.default_rng(7)
    cluster = wide_area_cluster(rng, 12)
    chain = random_chain(rng, 10, param_scale=2e7, act_scale=5e7, out_scale=1e6)
    return build_problem(scale_chain(chain, 1), cluster, TrainingConfig(global_batch=6, microbatch_size=1),
                         VerificationPolicy())


def _stage_devices(problem) -> int:
    return sum(c.count for c in problem.classes if c.stage_capable)


def _trusted(problem) -> int:
    return sum(c.count for c in problem.classes if c.stage_capable and c.trusted)


def test_shapes_out_of_reach_are_never_tried(problem, monkeypatch):
    tried: list[tuple[int, int]] = []
    inner = grid._grid

    def spy(p, pp, dp, **kw):
        tried.append((pp, dp))
        return inner(p, pp, dp, **kw)

    monkeypatch.setattr(grid, "_grid", spy)
    found = grid.grids(problem) + grid.tapered(problem)
    M, L = problem.num_microbatches, problem.num_blocks
    assert found and tried
    assert max(dp for _, dp in tried) == M < _stage_devices(problem)  # the widest in reach, none wider
    assert all(pp <= L for pp, _ in tried)


def test_a_grid_is_charged_by_how_far_it_got(problem):
    D, M, fastest = _stage_devices(problem), problem.num_microbatches, grid._by_speed(problem)
    work = Work(100.0)
    assert grid._grid(problem, 2, M + 1, together="replicas", fastest=fastest, work=work) is None
    assert work.spent == 0.0  # out of reach: refused before anything is done
    refused_dp = _trusted(problem) // 2 + 1  # the two end stages need more trusted devices than there are
    assert refused_dp <= M and 2 * refused_dp <= D
    assert grid._grid(problem, 2, refused_dp, together="replicas", fastest=fastest, work=work) is None
    assert work.spent == pytest.approx(grid_try_units(D, 2, 0))
    work = Work(100.0)
    built = grid._grid(problem, 2, 1, together="replicas", fastest=fastest, work=work)
    assert built is not None
    untrusted = sum(1 for st in built.stages for d in st.devices
                    if not problem.classes[problem.class_of(d)].trusted)
    assert work.spent == pytest.approx(grid_try_units(D, 2, 2) + grid_check_units(D, 2, untrusted,
                                                                                  M * len(built.verifiers)))
    assert grid_try_units(D, 2, 0) < grid_try_units(D, 2, 2) < work.spent


def test_the_grids_charge_their_setup_and_every_shape_ranked(problem, monkeypatch):
    work = Work(100.0)
    found = grid.grids(problem, deadline=work)
    assert found == grid.grids(problem)  # a budget never spent changes nothing
    monkeypatch.setattr(grid, "grid_try_units", lambda *a: 0.0)  # the grids tried aside: the ranking alone
    monkeypatch.setattr(grid, "grid_check_units", lambda *a: 0.0)
    ranking = Work(100.0)
    grid.grids(problem, deadline=ranking)
    D, L, M = _stage_devices(problem), problem.num_blocks, problem.num_microbatches
    assert ranking.spent == pytest.approx(grid_setup_units(D) + sum(
        grid_rank_units(pp) for pp in range(1, min(D, L) + 1) for _ in range(1, min(D // pp, M) + 1)))
    assert 0 < ranking.spent < work.spent


def test_cheapest_charges_its_ranking_and_each_pricing(problem):
    found = grid.grids(problem)
    work = Work(100.0)
    best = grid.cheapest(problem, found, count=1, within=work)
    assert len(best) == 1
    assert work.spent == pytest.approx(sum(evaluate_units(p) for p in found) + placement_units(best[0]))


def test_the_grids_seeding_a_count_spend_beside_its_budget(problem, monkeypatch):
    """However much the grids cost (here a budget's worth), the count's later steps get what they had; the solve
    pays (its later counts: the whole stays within its limit)."""
    def dear(p, *, deadline, priced):
        deadline.charge(10 * UNITS_PER_S)
        return []

    monkeypatch.setattr(count_search, "grid_candidates", dear)
    solve = Work(20.0)
    work = solve.sub(1.0, "count")
    count_search._incumbents(problem, 0.2, work, seed=0)
    assert 0.5 < work.left_s() < 1.0
    assert solve.left_s() < 20.0 - 10.0
