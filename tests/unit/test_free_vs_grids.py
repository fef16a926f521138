"""A free search is never dearer than a forced ``--stages/--replicas`` grid it could have returned: every grid it
meets is priced whatever its closed form, and each shape's cheapest gets its cuts polished as the forced shape's do.

Seed 9 is a pool where the forced 5 x 2 grid (2,888 ms) beat the free search's 2,905 ms before that. Verification
is off here: ``link_tests.keep_link_tests`` re-places verifiers after the search, outside what it ranks.
"""
from __future__ import annotations

import numpy as np
import pytest

from cost_models.training import TrainingConfig
from planner.errors import InfeasiblePlanError
from planner.solver import api
from planner.solver.policy import VerificationPolicy
from tests.unit.program_fixtures import untrusted_pool
from tests.unit.solver_fixtures import random_chain, random_cluster

OFF = VerificationPolicy(enabled=False)


def _case(seed: int):
    rng = np.random.default_rng(seed)
    cluster = untrusted_pool(rng) if seed % 2 else random_cluster(rng, int(rng.integers(4, 8)), untrusted=False)
    chain = random_chain(rng, int(rng.integers(6, 12)), param_scale=5e7, act_scale=5e7,
                         out_scale=float(rng.choice([1e6, 1e7])))
    return chain, cluster, TrainingConfig(global_batch=16, microbatch_size=1)


@pytest.mark.parametrize("seed", [9, 13])
def test_the_free_search_is_no_dearer_than_any_forced_grid(seed):
    chain, cluster, config = _case(seed)
    free = api.solve(chain, cluster, config, OFF, time_limit_s=1.0, workers=1).report.objective_ms
    devices = sum(1 for d in cluster.devices if not d.cpu_only)
    forced = {}
    for pp in range(1, min(devices, len(chain.blocks)) + 1):
        for dp in range(1, devices // pp + 1):
            found = api.solve_or_explain(chain, cluster, config, OFF, time_limit_s=0.5, workers=1, stages=pp,
                                         replicas=dp)
            if not isinstance(found, InfeasiblePlanError):
                forced[pp, dp] = found.report.objective_ms
    assert forced
    assert all(free <= ms * (1 + 1e-9) for ms in forced.values()), \
        (free, {s: ms for s, ms in forced.items() if ms < free})


@pytest.mark.parametrize("seed", [9, 13, 21])
def test_a_shaped_rival_unbounded_is_no_dearer_than_the_bounded_solve(seed):
    """``planner.rivals.shaped_rival``'s solve (``bounded=False``): the work the bounds would take goes to its cuts'
    climb, run once from the cheapest grid (the bounded solve polishes the grid, then climbs again from there), and
    only the fluid LP bounds it."""
    chain, cluster, config = _case(seed)
    devices = sum(1 for d in cluster.devices if not d.cpu_only)
    shape = dict(stages=2, replicas=max(1, devices // 2))
    kw = dict(time_limit_s=0.5, workers=1, microbatch_sizes=(1,), **shape)
    bounded = api.solve_or_explain(chain, cluster, config, OFF, **kw)
    rival = api.solve_or_explain(chain, cluster, config, OFF, bounded=False, **kw)
    assert not isinstance(bounded, InfeasiblePlanError) and not isinstance(rival, InfeasiblePlanError)
    assert rival.report.objective_ms <= bounded.report.objective_ms * (1 + 1e-9)
    assert rival.report.bound_ms <= bounded.report.bound_ms * (1 + 1e-9)
    assert [len(st.devices) for st in rival.stages] == [shape["replicas"]] * 2
