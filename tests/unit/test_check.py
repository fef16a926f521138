"""The independent checker: accepts valid solutions, names every broken memory or verification rule."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from cost_models.cluster_file import parse_cluster
from cost_models.training import TrainingConfig
from planner.check import assert_valid, check_solution
from planner.errors import InvalidInputError
from planner.solver import api
from planner.solver.policy import VerificationPolicy
from planner.solver.solution import (
    Solution,
    SolveReport,
    StagePlacement,
    VerifierPlacement,
)
from tests.unit.solver_fixtures import random_chain

torch.set_num_threads(1)
LINKS = {"intra_host": {"bandwidth_gbps": 100, "latency_ms": 0.01}, "default": {"bandwidth_gbps": 10, "latency_ms": 1}}
CONFIG = TrainingConfig(global_batch=4, microbatch_size=1)
REPORT = SolveReport(method="test", status="FEASIBLE", objective_ms=1.0, bound_ms=None, gap=None, solve_s=0.0)


@pytest.fixture(scope="module")
def setup():
    cl = parse_cluster({"name": "c", "links": LINKS, "hosts": [
        {"name": "dc", "region": "r", "trust": "operator", "trusted": True,
         "devices": [{"type": "A100-80GB", "count": 2}]},
        {"name": "vol", "region": "r", "trust": "vol", "devices": [{"type": "T4", "count": 1}]},
        {"name": "lab", "region": "r", "trust": "vol", "trusted": True, "devices": [{"type": "L4", "count": 1}]},
        {"name": "ver", "region": "r", "trust": "operator", "trusted": True, "role": "verifier",
         "devices": [{"type": "CPU", "count": 1}]}]})
    chain = random_chain(np.random.default_rng(0), 6, param_scale=3e8, act_scale=1e8, uniform=True)
    return cl, chain


def solution(stages, verifiers=(), M=4):
    sts = tuple(StagePlacement(index=k, first_block=a, last_block=b, devices=devs,
                               microbatches=(M,) if len(devs) == 1 else (M // 2, M - M // 2))
                for k, (a, b, devs) in enumerate(stages))
    return Solution(stages=sts, verifiers=tuple(verifiers), num_microbatches=M, schedule="1f1b",
                    predicted_step_ms=1.0, memory_bytes=(), report=REPORT)


def test_valid_three_stage_plan(setup):
    cl, chain = setup
    sol = solution([(0, 1, ("dc/0",)), (2, 3, ("vol/0",)), (4, 5, ("dc/1",))],
                   [VerifierPlacement(boundary=0, device="dc/0", directions=("grad",)),
                    VerifierPlacement(boundary=1, device="dc/1", directions=("act",))])
    report = check_solution(sol, chain, cl, CONFIG, VerificationPolicy())
    assert report.ok, report.problems
    assert {m.device for m in report.memory} == {"dc/0", "vol/0", "dc/1"}


def test_memory_overflow_is_named(setup):
    cl, chain = setup
    sol = solution([(0, 0, ("dc/0",)), (1, 5, ("vol/0",))])  # 5 blocks of 3e8 params x 16 B on a 16 GB T4
    report = check_solution(sol, chain, cl, CONFIG, VerificationPolicy(enabled=False))
    assert any("vol/0 needs" in p for p in report.problems)


def test_missing_and_misplaced_verifiers(setup):
    cl, chain = setup
    stages = [(0, 1, ("dc/0",)), (2, 3, ("vol/0",)), (4, 5, ("dc/1",))]
    report = check_solution(solution(stages), chain, cl, CONFIG, VerificationPolicy())
    assert "boundary 0 (grad) has an untrusted sender and no verifier" in report.problems
    assert "boundary 1 (act) has an untrusted sender and no verifier" in report.problems
    same_domain = [VerifierPlacement(boundary=0, device="lab/0", directions=("grad",)),
                   VerifierPlacement(boundary=1, device="vol/0", directions=("act",))]
    report = check_solution(solution(stages, same_domain), chain, cl, CONFIG, VerificationPolicy())
    joined = " | ".join(report.problems)
    assert "lab/0 of boundary 0 is inside the sender's trust domain vol" in joined
    assert "verifier vol/0 of boundary 1 is not trusted" in joined


def test_policy_rules(setup):
    cl, chain = setup
    stages = [(0, 1, ("vol/0",)), (2, 5, ("dc/0",))]
    verifiers = [VerifierPlacement(boundary=0, device="dc/0", directions=("act",))]
    report = check_solution(solution(stages, verifiers), chain, cl, CONFIG, VerificationPolicy())
    assert any("endpoint but runs on untrusted vol/0" in p for p in report.problems)
    cpu_only = VerificationPolicy(trusted_endpoints=False, verifier_placement="cpu")
    report = check_solution(solution(stages, verifiers), chain, cl, CONFIG, cpu_only)
    assert report.problems == ("verifier dc/0 is not on a CPU verifier host (policy: cpu)",)
    three = [(0, 1, ("dc/0",)), (2, 2, ("vol/0",)), (3, 5, ("dc/1",))]
    both = [VerifierPlacement(boundary=0, device="ver/0", directions=("grad",)),
            VerifierPlacement(boundary=1, device="ver/0", directions=("act",))]
    capped = VerificationPolicy(max_boundaries_per_verifier=1)
    report = check_solution(solution(three, both), chain, cl, CONFIG, capped)
    assert report.problems == ("verifier ver/0 checks 2 boundaries (at most 1)",)


def test_structure_errors(setup):
    cl, chain = setup
    twice = solution([(0, 2, ("dc/0",)), (3, 5, ("dc/0",))])
    assert "device dc/0 runs more than one stage" in check_solution(twice, chain, cl, CONFIG,
                                                                     VerificationPolicy(enabled=False)).problems
    on_verifier = solution([(0, 5, ("ver/0",))])
    assert any("verifier-only host" in p for p in check_solution(on_verifier, chain, cl, CONFIG,
                                                                 VerificationPolicy(enabled=False)).problems)
    with pytest.raises(InvalidInputError, match="solution check failed"):
        assert_valid(twice, chain, cl, CONFIG, VerificationPolicy(enabled=False))


def test_solver_memory_never_undercounts_the_checker(setup):
    cl, chain = setup
    config = dataclasses.replace(CONFIG, global_batch=8)
    sol = api.solve(chain, cl, config, VerificationPolicy(), time_limit_s=10, workers=1,
                    microbatch_sizes=(1, 2))
    mb = config.global_batch // sol.num_microbatches
    cfg = dataclasses.replace(config, microbatch_size=mb)
    scaled = api.scale_chain(chain, mb)
    report = check_solution(sol, scaled, cl, cfg, VerificationPolicy())
    assert report.ok, report.problems
    solver_mem = dict(sol.memory_bytes)
    for m in report.memory:
        assert solver_mem[m.device] >= m.used_bytes
        assert solver_mem[m.device] - m.used_bytes <= 64 * len(chain.blocks)  # rounding up, per block
