"""The fill bound's in-flight cap and stage 0's round trip (``bound.fill._per``: a device holds at most the
microbatches its memory has room for in flight, so its passes wait out the round trip after it; ``_Test.feasible``:
an S-stage plan's stage 0 waits for its first gradient over every crossing to the last stage and back) stay below
every enumerated plan of random volunteer swarms and one-GPU hosts on slow links with large activations, with and
without recomputation, and lift the bound there (26.5 -> 29.6 s, 41.3 -> 47.3 s on the swarms); eight times the route's crossings
rise above a swarm's best plan."""
from __future__ import annotations

import numpy as np
import pytest

from cost_models.training import TrainingConfig
from planner.solver.bound import fill, fill_dp, fill_rows
from planner.solver.bound.fill import fill_bound_ms
from planner.solver.problem import recompute_problem
from planner.solver.problem_build import build_problem, scale_chain
from tests.unit.solver_fixtures import random_chain
from tests.unit.test_bound_fill_route import _prices, pool_cluster

HAIR = 1 + 1e-9


def tight_draw(rng: np.random.Generator, kind: str):
    """``test_bound_fill_route``'s pools (a trusted host of two T4s at the ends and 2-4 volunteers', or 3-5 one-T4
    hosts; 0.2-2 Gb/s) with 4-7 blocks whose activations fill most of a T4 (2-6 GB a block), 8 or 16 microbatches:
    (cluster, policy, chain, global batch at one sample a microbatch)."""
    cluster, policy = pool_cluster(rng, kind)
    chain = random_chain(rng, int(rng.integers(4, 8)), param_scale=float(rng.choice([2e7, 2e8])),
                         flop_scale=float(rng.choice([5e11, 2e12])), act_scale=float(rng.choice([2e9, 6e9])),
                         out_scale=float(rng.choice([1e6, 8e6])))
    return cluster, policy, chain, int(rng.choice([8, 16]))


def _pool(rng: np.random.Generator, kind: str):
    """``tight_draw``'s pool as a problem, and its cluster."""
    cluster, policy, chain, batch = tight_draw(rng, kind)
    config = TrainingConfig(global_batch=batch, microbatch_size=1)
    return build_problem(scale_chain(chain, 1), cluster, config, policy), cluster


def _bound(problem, monkeypatch, *, on: bool = True, crossings: float = 1.0) -> float:
    """The fill bound with the in-flight cap and stage 0's round trip (the route's crossings times ``crossings``:
    overstated where above 1), or without both."""
    kept = fill._Test.__init__

    def init(self, problem, *args, **kw):
        kept(self, problem, *args, **kw)
        self.last = self.last * crossings

    with monkeypatch.context() as m:
        m.setattr(fill_rows, "IN_FLIGHT", on)
        m.setattr(fill_dp, "STAGE0_TRIP", on)
        m.setattr(fill._Test, "__init__", init)
        return fill_bound_ms(problem)


@pytest.mark.parametrize("kind", ["swarm2", "hosts"])
def test_below_every_enumerated_plan_and_lifts_the_bound(kind, monkeypatch):
    checked = lifted = over = 0
    for seed in range(10):
        problem, cluster = _pool(np.random.default_rng(6100 + seed + (100 if kind == "hosts" else 0)), kind)
        for p in (problem, recompute_problem(problem)):
            prices = _prices(p, cluster)
            if not prices:
                continue
            best = min(prices)
            bound, before = _bound(p, monkeypatch), _bound(p, monkeypatch, on=False)
            assert before * (1 - 2 * fill.REL_TOL) <= bound <= best * HAIR, (seed, p.recompute, before, bound, best)
            checked += 1
            lifted += bound > before * (1 + 1e-6)
            over += _bound(p, monkeypatch, crossings=8.0) > best * HAIR
    # the swarms' best plans are within reach of an overstated route (eight times its crossings breaks the bound)
    assert checked >= 8 and lifted >= 2 and (over >= 1 or kind == "hosts"), (checked, lifted, over)
