"""``Work.side``: a budget beside a step's own, which the steps after it do not pay for (review: the grid seeds'
pricing, charged to the count's work, took the Lagrangian bound's and cut swarm-t4's bound from 195.5 to 36.0 ms),
but the outermost budget (the solve's) does: the whole stays within its limit (issue 36)."""
from __future__ import annotations

from planner.solver.search.budget import UNITS_PER_S, Work


def test_a_side_budget_is_spent_apart_and_keeps_the_ceiling():
    now = [0.0]
    solve = Work(2.0, clock=lambda: now[0])
    count = solve.sub(1.0, "count")
    side = count.side(0.5, "priced")
    side.charge(0.5 * UNITS_PER_S)
    assert side.passed() and not count.passed() and count.left_s() == 1.0
    assert side.ceiling_at == count.ceiling_at == solve.ceiling_at
    now[0] = solve.ceiling_at
    assert Work(0.0, clock=lambda: 0.0).passed() and count.side(9.0, "late").passed()


def test_the_solve_pays_for_its_sides_and_their_sides():
    solve = Work(2.0, clock=lambda: 0.0)
    count = solve.sub(1.0, "count")
    inner = count.sub(0.5, "step")
    side = inner.side(1.0, "grids")
    side.side(1.0, "re-split").charge(0.25 * UNITS_PER_S)
    side.charge(0.25 * UNITS_PER_S)
    assert side.top() is solve and count.top() is solve and solve.top() is solve
    assert (inner.left_s(), count.left_s(), side.left_s()) == (0.5, 1.0, 0.75)
    assert solve.left_s() == 1.5


def test_a_side_of_a_lone_budget_charges_it():
    alone = Work(1.0, clock=lambda: 0.0)
    alone.side(1.0, "priced").charge(0.5 * UNITS_PER_S)
    assert alone.left_s() == 0.5
