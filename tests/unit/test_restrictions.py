"""The natural restrictions of a pool: whole hosts dropped, device ids kept, the trusted hosts in every one."""
from __future__ import annotations

from benchmarks.pools import sentinel
from cost_models.cluster_file import parse_cluster
from planner.solver.restrictions import MAX_RESTRICTIONS, restrictions


def test_a_sentinel_pool_is_restricted_to_its_trusted_hosts_then_by_volunteer_type():
    pool = sentinel(1.0, 1, trusted_hosts=2, volunteers=8, per_host=2)
    parts = restrictions(pool)
    names = [p.name for p in parts]
    assert names[0] == "trusted hosts only"
    assert {"trusted + RTX4090", "trusted + A10G", "trusted + RTX3090", "trusted + T4"} <= set(names)
    assert len(parts) <= MAX_RESTRICTIONS
    assert names[1] == "without CPU verifier hosts" and parts[1].dropped == {"chk0"}
    for part in parts:
        kept = {h.name for h in part.cluster.hosts}
        assert {"dc0", "dc1"} | ({"chk0"} if part is not parts[1] else set()) <= kept  # verifier hosts stay but in one
        assert kept | part.dropped == {h.name for h in pool.hosts}
        for d in part.cluster.devices:                               # a plan of the part runs on the pool
            assert pool.device(d.id).type == d.type
    only = parts[0].cluster
    assert all(h.trusted for h in only.hosts)


def test_a_pool_without_untrusted_hosts_or_without_trusted_ones_has_no_restrictions():
    assert restrictions(sentinel(1.0, 0, trusted_hosts=2, volunteers=0)) == ()
    assert restrictions(sentinel(1.0, 0, trusted_hosts=0, volunteers=4)) == ()


def test_regions_without_trusted_hosts_are_dropped_one_at_a_time():
    hosts = [{"name": "dc", "region": "dc", "trust": "op", "trusted": True, "devices": [{"type": "A100-80GB"}]}]
    hosts += [{"name": f"v{i}", "region": f"home{i % 3}", "trust": f"v{i}", "devices": [{"type": "T4"}]}
              for i in range(6)]
    pool = parse_cluster({"name": "p", "hosts": hosts, "links": {"default": {"bandwidth_gbps": 1}}})
    parts = {p.name: p for p in restrictions(pool)}
    assert set(parts) == {"trusted hosts only", "without region home0", "without region home1",
                          "without region home2"}
    assert parts["without region home1"].dropped == {"v1", "v4"}


def test_a_random_pool_planned_whole_is_never_slower_than_its_restrictions():
    """Monotone by construction: each restriction's plan is a rival of the whole pool's, chosen by simulation,
    so the pool's plan simulates no slower than that of its trusted hosts alone or any other part."""
    import numpy as np

    from planner.api import plan_chain
    from planner.simulate import simulate
    from tests.unit.program_fixtures import untrusted_pool
    from tests.unit.solver_fixtures import random_chain
    for seed in range(3):
        rng = np.random.default_rng(200 + seed)
        pool = untrusted_pool(rng)
        chain = random_chain(rng, 10, param_scale=5e7, act_scale=5e7, out_scale=1e6)
        whole = simulate(plan_chain(chain, pool, spec="tests:chain", global_batch=16, microbatch_size=1,
                                    time_limit_s=2, workers=1)).step_ms
        for part in restrictions(pool)[:2]:
            alone = simulate(plan_chain(chain, part.cluster, spec="tests:chain", global_batch=16,
                                        microbatch_size=1, time_limit_s=2 * 0.2 / len(restrictions(pool)),
                                        workers=1)).step_ms
            assert whole <= alone * (1 + 1e-9), (seed, part.name, whole, alone)


def _pool(volunteers: int, verifiers: int, *, trusted: bool = True):
    hosts = [{"name": "dc", "region": "dc", "trust": "op", "trusted": True, "devices": [{"type": "A100-80GB"}]}] \
        if trusted else []
    hosts += [{"name": f"v{i}", "region": "home", "trust": f"v{i}", "devices": [{"type": "T4"}]}
              for i in range(volunteers)]
    hosts += [{"name": f"chk{i}", "region": "dc", "trust": "op", "trusted": True, "role": "verifier"}
              for i in range(verifiers)]
    return parse_cluster({"name": "p", "hosts": hosts, "links": {"default": {"bandwidth_gbps": 1}}})


def test_a_small_pool_is_planned_without_each_untrusted_or_verifier_host_a_larger_one_not():
    from planner.solver.restrictions import DROP_EACH_UP_TO, droppable
    assert droppable(_pool(2, 1)) == ("v0", "v1", "chk0")
    assert droppable(_pool(0, 2)) == ("chk0", "chk1")                  # trusted workers are never dropped
    assert droppable(_pool(DROP_EACH_UP_TO, 1)) == ()                  # past the bound: none
    assert droppable(_pool(1, 1, trusted=False)) == ("chk0",)          # the last host with devices stays


def test_a_lone_untrusted_host_with_a_verifier_host_plans_without_dropping_its_only_devices():
    import numpy as np

    from planner.api import plan_chain
    from planner.solver.policy import VerificationPolicy
    from tests.unit.solver_fixtures import random_chain
    chain = random_chain(np.random.default_rng(0), 6, param_scale=5e7, act_scale=5e7, out_scale=1e6)
    plan = plan_chain(chain, _pool(1, 1, trusted=False), spec="tests:chain", global_batch=16, time_limit_s=0.5,
                      workers=1, policy=VerificationPolicy(trusted_endpoints=False))
    assert plan.predicted.step_ms > 0


def test_a_small_pools_sub_pools_share_its_limit(monkeypatch):
    """Each of a small pool's 2 ** n sub-pools, the pool itself included, solves with ``SUB_POOL_SHARE`` of the
    limit: their solves together stay within it (with the whole limit each, 3 volunteers took 3x it)."""
    import numpy as np

    from planner import api
    from planner.solver.restrictions import SUB_POOL_SHARE
    from tests.unit.solver_fixtures import random_chain
    budgets: list[float] = []
    solve = api.solver_api.solve
    monkeypatch.setattr(api.solver_api, "solve", lambda *a, **k: budgets.append(k["time_limit_s"]) or solve(*a, **k))
    chain = random_chain(np.random.default_rng(0), 6, param_scale=5e7, act_scale=5e7, out_scale=1e6)
    api.plan_chain(chain, _pool(2, 1), spec="tests:chain", global_batch=16, time_limit_s=2.0, workers=1)
    assert len(budgets) == 8                                            # v0, v1, chk0: every subset once
    assert all(b <= 2.0 * SUB_POOL_SHARE + 1e-9 for b in budgets) and sum(budgets) <= 2.0
