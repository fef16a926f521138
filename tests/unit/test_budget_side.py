"""``Work.side``: a budget beside a step's own, which the steps after it do not pay for (review: the grid seeds'
pricing, charged to the count's work, took the Lagrangian bound's and cut swarm-t4's bound from 195.5 to 36.0 ms)."""
from __future__ import annotations

from planner.solver.search.budget import UNITS_PER_S, Work


def test_a_side_budget_is_spent_apart_and_keeps_the_ceiling():
    now = [0.0]
    work = Work(1.0, clock=lambda: now[0])
    side = work.side(0.5, "priced")
    side.charge(0.5 * UNITS_PER_S)
    assert side.passed() and not work.passed() and work.left_s() == 1.0
    assert side.ceiling_at == work.ceiling_at
    now[0] = work.ceiling_at
    assert Work(0.0, clock=lambda: 0.0).passed() and work.side(9.0, "late").passed()
