"""Forced pp x dp grids on a pool whose fastest devices are untrusted volunteers: the end stages take the
fastest trusted devices, the middle the fastest of the rest; where no grid is valid the error names the
constraint that binds (trusted end stages, verifier sites, memory)."""
from __future__ import annotations

import numpy as np
import pytest

from cost_models.cluster_file import parse_cluster
from cost_models.training import TrainingConfig
from planner.errors import InfeasiblePlanError
from planner.solver.objective import violations
from planner.solver.policy import VerificationPolicy
from planner.solver.problem_build import build_problem, scale_chain
from planner.solver.search.grid import grids, shaped
from tests.unit.solver_fixtures import random_chain


def _pool(verifier_host: bool, trusted_hosts: int = 2) -> dict:
    hosts = [{"name": f"dc{i}", "region": "dc", "trust": "operator", "trusted": True,
              "devices": [{"type": "A100-80GB", "count": 2}]} for i in range(trusted_hosts)]
    hosts += [{"name": f"vol{i}", "region": f"home{i % 2}", "trust": f"vol{i}",
               "devices": [{"type": "RTX4090", "count": 2}]} for i in range(6)]
    if verifier_host:
        hosts.append({"name": "chk", "region": "dc", "trust": "operator", "trusted": True, "role": "verifier"})
    return {"name": "volunteers", "hosts": hosts,
            "links": {"intra_host": {"bandwidth_gbps": 100, "latency_ms": 0.01},
                      "default": {"bandwidth_gbps": 1, "latency_ms": 5}}}


def _problem(cluster: dict, policy: VerificationPolicy = VerificationPolicy()):  # trusted ends by default
    chain = random_chain(np.random.default_rng(5), 12, param_scale=2e7, act_scale=5e7, out_scale=1e6)
    return build_problem(scale_chain(chain, 1), parse_cluster(cluster), TrainingConfig(global_batch=16,
                                                                                      microbatch_size=1), policy)


def _trusted(problem, device: str) -> bool:
    return problem.classes[problem.class_of(device)].trusted


def test_the_fastest_devices_are_volunteers_so_the_ends_take_trusted_ones_and_the_middle_the_fastest():
    problem = _problem(_pool(verifier_host=True))
    fastest = sorted((problem.range_time_ms(0, problem.num_blocks - 1, c.index), _trusted(problem, c.device_ids[0]))
                     for c in problem.classes if c.stage_capable)
    assert not fastest[0][1]                                      # a volunteer's card is the fastest here
    found = grids(problem, stages=4, replicas=2)
    assert found
    for placement in found:
        assert not violations(problem, placement)
        assert all(_trusted(problem, d) for st in (placement.stages[0], placement.stages[-1]) for d in st.devices)
        assert all(not _trusted(problem, d) for st in placement.stages[1:-1] for d in st.devices)
    plan = shaped(problem, stages=4, replicas=2, time_budget_s=1.0)
    assert (plan.num_stages, {len(st.devices) for st in plan.stages}) == (4, {2})


def test_without_a_verifier_host_the_replicated_trusted_ends_verify():
    """No CPU verifier host: the trusted end stages' replicas check the untrusted middle's boundaries."""
    problem = _problem(_pool(verifier_host=False))
    plan = shaped(problem, stages=4, replicas=2, time_budget_s=1.0)
    ends = set(plan.stages[0].devices + plan.stages[-1].devices)
    assert plan.verifiers and all(v.device in ends for v in plan.verifiers)
    assert {v.boundary for v in plan.verifiers} == {0, 1, 2}


@pytest.mark.parametrize("cluster, shape, policy, phrase", [
    (_pool(verifier_host=True, trusted_hosts=1), (3, 2), VerificationPolicy(),
     "need 4 trusted stage devices (2 replicas each), the cluster has 2"),
    (_pool(verifier_host=False), (4, 2), VerificationPolicy(verifier_placement="cpu"),
     "has a verifier for every boundary"),
])
def test_no_grid_names_the_constraint_that_binds(cluster, shape, policy, phrase):
    with pytest.raises(InfeasiblePlanError) as err:
        shaped(_problem(cluster, policy), stages=shape[0], replicas=shape[1], time_budget_s=1.0)
    assert phrase in str(err.value)
