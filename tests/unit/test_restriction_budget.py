"""The work each restriction of a pool is searched with (``restrictions.part_budget_s``): an even share of the
restrictions' time; the trusted hosts alone at least ``PART_MIN_S``, never more than the whole pool's search."""
from __future__ import annotations

import numpy as np
import pytest

from cost_models.precision import resolve_dtype
from cost_models.training import TrainingConfig
from planner.api import RESTRICTIONS_SHARE
from planner.rivals import restricted
from planner.solver.api import microbatch_candidates
from planner.solver.policy import VerificationPolicy
from planner.solver.restrictions import PART_MIN_S, part_budget_s, restrictions
from tests.unit.solver_fixtures import random_chain
from tests.unit.test_monotone_pools import _pools


@pytest.fixture(scope="module")
def seed_14():
    """The pool plus a host of ``test_monotone_pools`` at seed 14 (as drawn with up to 3 volunteers), its chain and
    its restrictions."""
    rng = np.random.default_rng(14)
    plus_host = _pools(rng, most=3)[1]
    chain = random_chain(rng, int(rng.integers(6, 12)), param_scale=5e7, act_scale=5e7,
                         out_scale=float(rng.choice([1e6, 1e7])))
    return plus_host, chain, restrictions(plus_host)


def test_a_long_limit_shares_evenly(seed_14):
    parts = seed_14[2]
    assert [part_budget_s(p, 12.0, 4, 39.0) for p in parts] == pytest.approx([3.0] * len(parts))


def test_a_short_limit_raises_the_trusted_hosts_alone_to_the_floor(seed_14):
    parts = seed_14[2]
    assert parts[0].name == "trusted hosts only" and len(parts) > 1
    budgets = [part_budget_s(p, 0.2, len(parts), 0.65) for p in parts]
    assert budgets[0] == PART_MIN_S
    assert budgets[1:] == pytest.approx([0.2 / len(parts)] * (len(parts) - 1))


def test_the_trusted_hosts_alone_never_get_more_than_the_pool_search(seed_14):
    assert part_budget_s(seed_14[2][0], 0.04, 2, 0.13) == pytest.approx(0.13)


def test_the_trusted_hosts_of_seed_14_find_their_replicated_plan_at_a_one_second_limit(seed_14):
    """At the work ``plan_chain`` gives them under ``--time-limit 1``, the trusted hosts alone find the small
    pool's plan (2 replicas, then 1), which the pool's own search misses."""
    plus_host, chain, parts = seed_14
    dtype = resolve_dtype("auto", plus_host)
    config = TrainingConfig(global_batch=16, microbatch_size=1, dtype=dtype, mixed_precision=dtype != "float32")
    even_s = RESTRICTIONS_SHARE * 1.0 / len(parts)  # its even share of the restrictions' time at 1 s
    (found,) = restricted(parts[:1], chain, config, VerificationPolicy(), workers=1, recompute="auto",
                          sizes=microbatch_candidates(16), share_s=even_s, pool_s=0.65)  # the pool's search: 1 s less the rivals' 0.35 s
    assert [len(st.devices) for st in found.stages] == [2, 1]
    assert found.report.method.endswith("on trusted hosts only")
