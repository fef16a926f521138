"""The bound over microbatch counts raised after the search (``bound.counts``) and the fill bound's cap
(``fill_bound_ms(cap_ms=...)``): on random small pools at several counts, each count's raised bound stays below
every enumerated plan of that count and the least over counts below the cheapest plan of any; a capped bound is
the full one where the cap is above it and at most the cap otherwise; only the least count is raised, a count
above the cap is never tested, and a budget that affords nothing leaves the bounds as they were."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from cost_models.cluster_file import parse_cluster
from cost_models.training import TrainingConfig
from planner.solver.bound.counts import LAGRANGE_REL_TOL, REL_TOL, CountBound, raised_bounds, raised_with_terms
from planner.solver.bound.fill import fill_bound_ms
from planner.solver.bound.lagrange import program_bound_ms
from planner.solver.policy import VerificationPolicy
from planner.solver.problem import recompute_problem
from planner.solver.problem_build import build_problem, scale_chain
from planner.solver.search.budget import Work
from tests.unit.solver_fixtures import random_chain
from tests.unit.test_bound_fill_route import _pool, _prices, pool_cluster

HAIR = 1 + 1e-9


def _counts(rng: np.random.Generator, kind: str):
    """A pool as ``test_bound_fill_route``'s ``_pool`` (``swarm2``: a trusted host of 2 T4s and 2-4 volunteers,
    trusted ends, verifiers; ``hosts``: 3-5 one-T4 hosts, no verification) at each microbatch count its global
    batch of 8 allows (sizes 1, 2, 4), with the recompute variant of size 1: (problem, cheapest enumerated plan)
    per count."""
    cluster, policy = pool_cluster(rng, kind)
    chain = random_chain(rng, int(rng.integers(4, 7)), param_scale=float(rng.choice([2e6, 3e7, 2e8])),
                         flop_scale=float(rng.choice([5e10, 5e11])), act_scale=5e7,
                         out_scale=float(rng.choice([1e6, 8e6, 4e7])))
    out = []
    for mb in (1, 2, 4):
        config = TrainingConfig(global_batch=8, microbatch_size=mb)
        p = build_problem(scale_chain(chain, mb), cluster, config, policy)
        for q in (p, recompute_problem(p)) if mb == 1 else (p,):
            prices = _prices(q, cluster, max_stages=4)
            out.append((q, min(prices) if prices else math.inf))
    return out


@pytest.mark.parametrize("kind", ["swarm2", "hosts"])
def test_raised_bounds_stay_below_every_enumerated_plan_of_each_count(kind):
    checked = raised = 0
    for seed in range(6):
        rng = np.random.default_rng(7300 + seed + (100 if kind == "hosts" else 0))
        counts = _counts(rng, kind)
        cheapest = [ms for _, ms in counts]
        if not any(math.isfinite(ms) for ms in cheapest):
            continue
        incumbent = min(cheapest)
        # as counts whose budget paid no fill test, their plans' costs unknown (no cap but the incumbent's), so
        # each count's raised bound below its cheapest enumerated plan is the fill bound's validity, not the cap
        weak = [CountBound(q, 0.0) for q, _ in counts]
        rich = Work(1e3, what="bounds")
        bounds = raised_bounds(weak, incumbent, rich)
        assert rich.spent > 0
        for b, ms in zip(bounds, cheapest):
            assert 0.0 <= b <= ms * HAIR and b <= incumbent * HAIR, (seed, b, ms)
        assert min(bounds) <= incumbent * HAIR
        # the least over counts is what the fill bound of every count gives, up to the cap
        full = min(min(fill_bound_ms(q), incumbent) for q, _ in counts)
        assert min(bounds) >= full * (1 - 2 * REL_TOL), (seed, min(bounds), full)
        checked += 1
        raised += min(bounds) > 0
    assert checked >= 4 and raised == checked


def test_a_capped_bound_is_the_full_one_below_the_cap_and_at_most_the_cap_above():
    for seed in range(6):
        problem = _pool(np.random.default_rng(7500 + seed), "swarm2")[0]
        full = fill_bound_ms(problem)
        assert full > 0
        above = fill_bound_ms(problem, cap_ms=2 * full)
        assert full * (1 - 2 * REL_TOL) <= above <= full * HAIR
        below = fill_bound_ms(problem, cap_ms=0.5 * full)
        assert 0.5 * full * (1 - 1e-8) <= below <= 0.5 * full
        assert fill_bound_ms(problem, 0.7 * full, cap_ms=0.6 * full) == 0.7 * full  # the floor, untested


def test_only_the_least_count_is_raised_and_a_count_at_the_cap_is_never_tested():
    rng = np.random.default_rng(7600)
    counts = [q for q, _ in _counts(rng, "hosts")]
    assert len(counts) >= 3
    fills = [fill_bound_ms(q) for q in counts]
    low = int(np.argmin(fills))
    # every count but ``low`` already at a bound above ``low``'s fill: only ``low`` is tested, once
    high = max(fills) * 2
    given = [CountBound(q, 0.0 if k == low else high) for k, q in enumerate(counts)]
    budget = Work(1e3, what="bounds")
    named = raised_with_terms([dataclasses.replace(c, by="links") for c in given], 10 * high, budget)
    bounds = [ms for ms, _ in named]
    assert bounds[low] == pytest.approx(fills[low], rel=2 * REL_TOL)
    # the term that set each: the fill bound where it raised one, the count's own elsewhere
    assert [by for _, by in named] == ["fill" if k == low else "links" for k in range(len(counts))]
    assert [b for k, b in enumerate(bounds) if k != low] == [high] * (len(counts) - 1)
    # every count at the cap: nothing tested, nothing charged
    capped = Work(1e3, what="bounds")
    assert raised_bounds(given, incumbent_ms=0.0, within=capped) == [0.0 if k == low else high
                                                                     for k in range(len(counts))]
    assert capped.spent == 0


def test_no_plan_known_bounds_as_without_a_cap():
    """No plan of any count (an infinite incumbent): each count is bisected as without a cap."""
    problem = _pool(np.random.default_rng(7800), "swarm2")[0]
    full = fill_bound_ms(problem)
    assert fill_bound_ms(problem, cap_ms=math.inf) == full
    bounds = raised_bounds([CountBound(problem, 0.0)], math.inf, Work(1e3, what="bounds"))
    assert full * (1 - 2 * REL_TOL) <= bounds[0] <= full * HAIR


def test_a_budget_that_affords_no_test_leaves_the_bounds():
    problem = _pool(np.random.default_rng(7700), "swarm2")[0]
    given = [CountBound(problem, 1.0, 1e9)]
    poor = Work(1e-9, what="bounds")
    assert raised_bounds(given, 1e9, poor) == [1.0] and poor.spent == 0


def test_a_bound_never_passes_its_own_counts_plan():
    """A count's plan cost below the incumbent caps that count (as ``count_solve`` caps its bound)."""
    hosts = [{"name": f"h{i}", "region": "r", "trust": "op", "trusted": True,
              "devices": [{"type": "T4", "count": 1}]} for i in range(3)]
    cluster = parse_cluster({"name": "h", "hosts": hosts,
                             "links": {"intra_host": {"bandwidth_gbps": 100, "latency_ms": 0.01},
                                       "default": {"bandwidth_gbps": 1.0, "latency_ms": 5.0}}})
    chain = random_chain(np.random.default_rng(3), 5, param_scale=3e7, flop_scale=5e11, act_scale=5e7,
                         out_scale=8e6)
    problem = build_problem(scale_chain(chain, 1), cluster, TrainingConfig(global_batch=4, microbatch_size=1),
                            VerificationPolicy(enabled=False))
    full = fill_bound_ms(problem)
    bounds = raised_bounds([CountBound(problem, 0.0, 0.5 * full)], 10 * full, Work(1e3, what="bounds"))
    assert len(bounds) == 1 and 0.5 * full * (1 - 1e-8) <= bounds[0] <= 0.5 * full


def test_the_lagrangian_bound_raises_what_fill_and_tails_leave(monkeypatch):
    """Where the fill and tail bounds raise nothing (as where a count's climb spent the work its own Lagrangian
    bound needed: the README's main job, M = 16), ``raised_bounds`` raises the least count by the Lagrangian bound
    (``lagrange.program_bound_ms``): above 0, below every enumerated plan of that count, and only up to the cap."""
    for name in ("fill_bound_ms", "tail_bound_ms"):
        monkeypatch.setattr(f"planner.solver.bound.counts.{name}", lambda problem, floor_ms, **_: floor_ms)
    lifted = 0
    for seed in range(4):
        counts = _counts(np.random.default_rng(7300 + seed), "swarm2")
        cheapest = [ms for _, ms in counts]
        if not any(math.isfinite(ms) for ms in cheapest):
            continue
        incumbent = min(cheapest)
        named = raised_with_terms([CountBound(q, 0.0) for q, _ in counts], incumbent, Work(1e3, what="bounds"))
        bounds = [ms for ms, _ in named]
        assert named[int(np.argmin(bounds))][1] == "lagrange", named
        for b, ms in zip(bounds, cheapest):
            assert 0.0 <= b <= ms * HAIR and b <= incumbent * HAIR, (seed, b, ms)
        # the least over counts is each count's own Lagrangian bound's least (each sought to the same target)
        own = [min(program_bound_ms(q, cap_ms=incumbent, within=Work(1e3, what="one"), rel_tol=LAGRANGE_REL_TOL),
                   incumbent) for q, _ in counts]
        assert min(bounds) > 0 and min(bounds) == pytest.approx(min(own), rel=1e-6), (seed, bounds, own)
        lifted += 1
    assert lifted >= 3
    # nothing left to seek with: the floor, nothing charged
    poor = Work(0.01, what="poor")
    assert program_bound_ms(counts[0][0], 7.0, cap_ms=incumbent, within=poor, rel_tol=LAGRANGE_REL_TOL) == 7.0
    assert poor.spent == 0
