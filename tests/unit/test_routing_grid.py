"""Routing of microbatches across replicas, uniform pp x dp grids, the polish step and the idle-device notes."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cost_models.training import TrainingConfig
from planner.errors import InfeasiblePlanError, InvalidInputError
from planner.solver.idle import idle_reasons
from planner.solver.objective import price_program, violations
from planner.solver.policy import VerificationPolicy
from planner.solver.problem_build import build_problem, scale_chain
from planner.solver.routing import pair_counts, route
from planner.solver.search.grid import best_grid, grids, shaped
from planner.solver.search.polish import polish
from tests.unit.program_fixtures import POLICY, wide_area_cluster
from tests.unit.solver_fixtures import random_chain


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=6))
def test_route_gives_each_replica_its_share_interleaved(shares):
    got = route(tuple(shares))
    M = sum(shares)
    assert [len(ids) for ids in got] == shares
    assert sorted(m for ids in got for m in ids) == list(range(M))
    for ids, share in zip(got, shares):  # spread over the step, not a contiguous block
        first_half = sum(m < M / 2 for m in ids)
        assert abs(first_half - share / 2) <= 1
    assert route(tuple(shares)) == got  # deterministic


def test_pair_counts_match_the_routes():
    counts = pair_counts((3, 3), (2, 2, 2))
    assert sum(counts.values()) == 6
    assert pair_counts((2, 2), (2, 2)) == {(0, 0): 2, (1, 1): 2}  # equal groups pair one to one


@pytest.fixture(scope="module")
def problem():
    rng = np.random.default_rng(3)
    cluster = wide_area_cluster(rng, 8)
    chain = random_chain(rng, 12, param_scale=2e7, act_scale=5e7, out_scale=1e6)
    config = TrainingConfig(global_batch=16, microbatch_size=1)
    return build_problem(scale_chain(chain, 1), cluster, config, POLICY)


def test_grids_are_uniform_and_valid(problem):
    found = grids(problem)
    assert found
    for p in found:
        assert not violations(problem, p)
        assert len({len(s.devices) for s in p.stages}) == 1  # dp replicas on every stage
        sizes = [s.num_blocks for s in p.stages]
        assert max(sizes) - min(sizes) <= 1  # an even layer split
    best = best_grid(problem)
    assert price_program(problem, best).step_ms == min(price_program(problem, p).step_ms for p in found)


def test_a_fixed_shape_is_honoured_or_refused(problem):
    p = shaped(problem, stages=2, replicas=2, time_budget_s=1.0)
    assert p.num_stages == 2 and all(len(s.devices) == 2 for s in p.stages)
    with pytest.raises(InvalidInputError, match="--stages x --replicas"):
        shaped(problem, stages=5, replicas=3, time_budget_s=1.0)
    with pytest.raises(InvalidInputError, match="--stages; expected 1..8"):
        shaped(problem, stages=40, replicas=None, time_budget_s=1.0)
    with pytest.raises(InfeasiblePlanError, match="--replicas 8 needs at least 8 microbatches"):
        shaped(dataclasses.replace(problem, num_microbatches=4), stages=None, replicas=8, time_budget_s=1.0)


def test_polish_never_returns_a_dearer_or_invalid_plan(problem):
    for start in grids(problem)[:6]:
        got, ms = polish(problem, start, time_budget_s=2.0)
        assert not violations(problem, got)
        assert ms <= price_program(problem, start).step_ms * (1 + 1e-12)
        assert ms == pytest.approx(price_program(problem, got).step_ms)


def test_idle_devices_are_explained(problem):
    plan = min(grids(problem, stages=1, replicas=1), key=lambda p: price_program(problem, p).step_ms)
    notes = idle_reasons(problem, plan, price_program(problem, plan).step_ms)
    idle = sum(c.count for c in problem.classes if c.stage_capable) - 1
    assert notes and sum(int(n.split(" x ")[0].split()[-1]) for n in notes) == idle
    assert all(("memory" in n) or ("trust" in n) or ("step would be" in n) for n in notes)


def test_an_untrusted_device_is_idle_for_trust_under_trusted_endpoints():
    rng = np.random.default_rng(3)
    cluster = wide_area_cluster(rng, 8)
    chain = random_chain(rng, 12, param_scale=2e7, act_scale=5e7, out_scale=1e6)
    problem = build_problem(scale_chain(chain, 1), cluster, TrainingConfig(global_batch=16, microbatch_size=1),
                            VerificationPolicy())
    plan = grids(problem, stages=1, replicas=1)[0]
    notes = idle_reasons(problem, plan, price_program(problem, plan).step_ms)
    assert any("untrusted" in n and "trust:" in n for n in notes), notes


def test_polish_shifts_a_stage_by_a_block(problem):
    from planner.solver.search.polish import _neighbours
    start = next(p for p in grids(problem) if p.num_stages >= 3)
    cuts = [s.last_block for s in start.stages]
    moved = [[s.last_block for s in n.stages] for n in _neighbours(problem, start, cuts_only=True)]
    for k in range(1, len(cuts) - 1):  # both of stage k's cuts moved together, either way
        for shift in (-1, 1):
            want = cuts[:k - 1] + [cuts[k - 1] + shift, cuts[k] + shift] + cuts[k + 1:]
            lengths_ok = all(b > a for a, b in zip([-1] + want, want))
            assert (want in moved) == lengths_ok
    for n in _neighbours(problem, start, cuts_only=True):  # every block in exactly one stage, in order
        assert n.stages[0].first_block == 0 and n.stages[-1].last_block == problem.num_blocks - 1
        assert all(a.last_block + 1 == b.first_block for a, b in zip(n.stages, n.stages[1:]))
