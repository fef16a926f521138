"""A placement whose middle stage an audit can check (``planner.solver.audits``), for the audit tests."""
from __future__ import annotations

import dataclasses

from cost_models.cluster_file import parse_cluster
from planner.solver.objective import Placement, violations
from planner.solver.policy import VerificationPolicy
from planner.solver.problem import Problem
from planner.solver.problem_build import build_problem
from planner.solver.solution import StagePlacement, VerifierPlacement
from tests.unit.plan_fixtures import TEST_DEVICE, block, chain, config


def watched(random_in: int | None = None, microbatches: int = 8) -> tuple[Problem, Placement]:
    """Trusted ends on dc, the middle stage (blocks 1-3) on two volunteers taking half the ``microbatches`` each,
    its verifier dc/1 holding both its boundaries over a fast link: auditable, unless block ``random_in`` draws
    random numbers."""
    vol = {**TEST_DEVICE, "name": "TEST-VOL", "peak_flops": {"float32": 1.0e12}}
    hosts = [{"name": "dc", "region": "dc", "trust": "op", "trusted": True,
              "devices": [{"type": "TEST-GPU", "spec": TEST_DEVICE, "count": 2}]}]
    hosts += [{"name": f"v{i}", "region": "home", "trust": f"v{i}", "trusted": False,
               "devices": [{"type": "TEST-VOL", "spec": vol, "count": 1}]} for i in range(2)]
    link = {"bandwidth_gbps": 100.0, "latency_ms": 0.1}
    cl = parse_cluster({"name": "watched", "hosts": hosts, "links": {"intra_host": link, "default": link}})
    blocks = [block(i, params=10**6 if 1 <= i <= 3 else 10**4) for i in range(5)]
    if random_in is not None:
        blocks[random_in] = dataclasses.replace(blocks[random_in], random_ops=("dropout",))
    M = microbatches
    problem = build_problem(chain(blocks, name="watched"), cl, config(M), VerificationPolicy())
    stages = (StagePlacement(index=0, first_block=0, last_block=0, devices=("dc/0",), microbatches=(M,)),
              StagePlacement(index=1, first_block=1, last_block=3, devices=("v0/0", "v1/0"),
                             microbatches=(M // 2, M - M // 2)),
              StagePlacement(index=2, first_block=4, last_block=4, devices=("dc/1",), microbatches=(M,)))
    verifiers = (VerifierPlacement(boundary=0, device="dc/1", directions=("act", "grad"), watch_only=("act",)),
                 VerifierPlacement(boundary=1, device="dc/1", directions=("act", "grad"), watch_only=("grad",)))
    placement = Placement(stages=stages, verifiers=verifiers, num_microbatches=M)
    assert not violations(problem, placement)
    return problem, placement
