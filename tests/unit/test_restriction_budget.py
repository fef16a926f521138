"""The work each restriction of a pool is searched with (``restrictions.part_budget_s``): an even share of the
restrictions' time, at least ``PART_MIN_S``, never more than the whole pool's search."""
from __future__ import annotations

import numpy as np
import pytest

from cost_models.precision import resolve_dtype
from cost_models.training import TrainingConfig
from planner.api import RESTRICTIONS_SHARE, _restricted
from planner.solver.policy import VerificationPolicy
from planner.solver.restrictions import PART_MIN_S, part_budget_s, restrictions
from tests.unit.solver_fixtures import random_chain
from tests.unit.test_monotone_pools import _pools


def test_a_long_limit_shares_evenly():
    assert part_budget_s(12.0, 4, 39.0) == pytest.approx(3.0)


def test_a_short_limit_gives_each_part_the_floor():
    assert part_budget_s(0.2, 3, 0.65) == PART_MIN_S


def test_a_part_never_gets_more_than_the_pool_search():
    assert part_budget_s(0.04, 2, 0.13) == pytest.approx(0.13)


def test_the_trusted_hosts_of_seed_14_find_their_replicated_plan_at_a_one_second_limit():
    """The pool plus a host of ``test_monotone_pools`` at seed 14: its trusted hosts' part, at the budget
    ``plan_chain`` gives it under ``--time-limit 1``, finds the small pool's plan (2 replicas, then 1)."""
    rng = np.random.default_rng(14)
    plus_host = _pools(rng)[1]
    chain = random_chain(rng, int(rng.integers(6, 12)), param_scale=5e7, act_scale=5e7,
                         out_scale=float(rng.choice([1e6, 1e7])))
    parts = restrictions(plus_host)
    assert parts[0].name == "trusted hosts only"
    dtype = resolve_dtype("auto", plus_host)
    config = TrainingConfig(global_batch=16, microbatch_size=1, dtype=dtype, mixed_precision=dtype != "float32")
    budget_s = part_budget_s(RESTRICTIONS_SHARE * 1.0, len(parts), 0.65)
    (found,) = _restricted(parts[:1], chain, config, VerificationPolicy(), workers=1, recompute="auto",
                           time_limit_s=budget_s)
    assert [len(st.devices) for st in found.stages] == [2, 1]
    assert found.report.method.endswith("on trusted hosts only")
