"""More devices never plan slower (issue 36): a small untrusted pool, the same pool plus one volunteer host, and
plus one trusted CPU verifier host, planned with the same arguments (a free microbatch size, 1 s, seed 0); the larger
pools' plans must simulate no slower than the small pool's.

Structural, not by luck: a pool of at most ``restrictions.DROP_EACH_UP_TO`` (3) untrusted worker and verifier hosts
is planned as its sub-pools without some of them, each with ``restrictions.SUB_POOL_SHARE`` of the limit
(``planner.api.plan_chain``), so the larger pool's call holds the smaller pool's own plan. The pools here stay within
that: 1 or 2 volunteer hosts, then one host more. Before (restrictions alone), seeds 0-23 of these pools: seed 13
planned 2,412 ms with a verifier host more against 2,367 (free size), seed 17 2,450 against 2,419 (size 1); after,
none of seeds 0-13 (free size). Pools of up to 3 volunteers, as drawn before: seeds 15, 17, 21 (size 1), 7 (2,070
against 1,845 ms) and 13 (free); 4 volunteers plus one host is past the bound and not covered. Seeds 0-13 here:
~95 s on 2 shared cores.
"""
from __future__ import annotations

import numpy as np
import pytest

from cost_models.cluster_file import parse_cluster
from planner.api import plan_chain
from planner.simulate import simulate
from tests.unit.solver_fixtures import GPU_TYPES, random_chain


def _pools(rng: np.random.Generator, most: int = 2):
    """(the pool of 1 to ``most`` volunteer hosts, plus a volunteer host, plus a CPU verifier host)."""
    hosts = [{"name": "dc", "region": "dc", "trust": "op", "trusted": True,
              "devices": [{"type": str(rng.choice(["A100-80GB", "A100-40GB", "RTX3090"])),
                           "count": int(rng.integers(1, 4))}]}]
    kinds = list(rng.choice(GPU_TYPES, size=2, replace=False))
    for i in range(int(rng.integers(1, most + 1))):
        hosts.append({"name": f"v{i}", "region": f"r{i % 2}", "trust": f"v{i}",
                      "devices": [{"type": str(rng.choice(kinds)), "count": int(rng.integers(1, 3))}]})
    new = {"name": "new", "region": "r0", "trust": "vnew",
           "devices": [{"type": str(rng.choice(kinds)), "count": int(rng.integers(1, 3))}]}
    checker = {"name": "chk", "region": "dc", "trust": "op", "trusted": True, "role": "verifier"}
    links = {"intra_host": {"bandwidth_gbps": 100.0, "latency_ms": 0.01},
             "default": {"bandwidth_gbps": float(rng.choice([0.2, 1.0, 5.0])),
                         "latency_ms": float(rng.choice([1.0, 5.0]))}}
    return tuple(parse_cluster({"name": "pool", "hosts": h, "links": links})
                 for h in (hosts, hosts + [new], hosts + [checker]))


def _step_ms(chain, cluster) -> float:
    plan = plan_chain(chain, cluster, spec="tests:chain", global_batch=16, time_limit_s=1, workers=1, seed=0)
    return simulate(plan).step_ms


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(14))
def test_a_host_or_a_verifier_host_more_never_plans_slower(seed):
    rng = np.random.default_rng(seed)
    small, plus_host, plus_verifier = _pools(rng)
    chain = random_chain(rng, int(rng.integers(6, 12)), param_scale=5e7, act_scale=5e7,
                         out_scale=float(rng.choice([1e6, 1e7])))
    base = _step_ms(chain, small)
    more = {"host": _step_ms(chain, plus_host), "verifier host": _step_ms(chain, plus_verifier)}
    assert all(ms <= base * (1 + 1e-9) for ms in more.values()), (base, more)
