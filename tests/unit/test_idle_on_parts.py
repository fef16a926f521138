"""A plan made on part of the pool (a sub-pool's or a restriction's, chosen by simulation) says why the rest of the
pool idles (issue 36, item 6): its idle lines are made on the whole pool, so every idle device has one. Before,
they came from the part's own search, which did not know the rest (``test_monotone_pools``' seed 13: the pool
without v1 planned 2,366.8 ms against the pool's own 2,490.8, and v1's L4 had no line)."""
from __future__ import annotations

import re

import numpy as np

from planner.api import plan_chain
from tests.unit.solver_fixtures import random_chain
from tests.unit.test_monotone_pools import _pools


def test_a_sub_pools_plan_explains_every_idle_device_and_names_its_pool():
    rng = np.random.default_rng(13)
    small = _pools(rng)[0]
    chain = random_chain(rng, int(rng.integers(6, 12)), param_scale=5e7, act_scale=5e7,
                         out_scale=float(rng.choice([1e6, 1e7])))
    plan = plan_chain(chain, small, spec="tests:chain", global_batch=16, time_limit_s=1, workers=1, seed=0)
    assert plan.report.method.endswith("on the pool without v1")
    used = {r.device for r in plan.ranks if r.stage is not None}
    idle = [d.id for d in small.devices if d.id not in used]
    lines = [n for n in plan.report.notes if n.startswith("idle:")]
    assert idle == ["v1/0"] and sum(int(re.match(r"idle: (\d+) x", n).group(1)) for n in lines) == len(idle)
    assert "L4 (untrusted" in lines[0] and plan.report.notes[-1].startswith("chosen by simulation")
