"""The fill bound (``bound.fill``) is below the compiled programs' cost of every plan: the enumerated optimum of
small random problems (devices, classes, trust, verifier hosts), every plan of one-GPU hosts on slow links, random
plans of wide-area pools, and random plans, hill-climbed, of pools of a fast and a slow kind (stages of either kind
or both, uneven shares, trusted ends or not); above the fluid LP where the slow kind must run stages deep in the
chain."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from cost_models.cluster_file import parse_cluster
from cost_models.training import TrainingConfig
from planner.solver.bound.fill import fill_bound_ms
from planner.solver.bound.links import link_lower_bound_ms
from planner.solver.bound.replicas import replica_bound_ms
from planner.solver.objective import (
    Placement,
    price_program,
    program_lower_bound_ms,
    violations,
)
from planner.solver.policy import VerificationPolicy
from planner.solver.problem import recompute_problem
from planner.solver.problem_build import build_problem, scale_chain
from planner.solver.search.polish import polish
from planner.solver.solution import StagePlacement
from tests.unit.bruteforce import brute_force
from tests.unit.program_fixtures import random_placement, wide_area_cluster
from tests.unit.solver_fixtures import random_chain
from tests.unit.test_bound_replicas import (
    _every_plan,
    _slow_pool,
    _small_swarm,
    _swarm_prices,
)
from tests.unit.test_solver_bruteforce import TWIST_SEEDS, instance

HAIR = 1 + 1e-9


@pytest.mark.parametrize("twists", [False, True])
def test_below_the_enumerated_optimum(twists):
    for seed in (TWIST_SEEDS if twists else range(28)):
        chain, cluster, config, policy = instance(seed, twists=twists)
        problem = build_problem(scale_chain(chain, config.microbatch_size), cluster, config, policy)
        best, _ = brute_force(problem, program=True)
        assert fill_bound_ms(problem) <= best * HAIR, seed


@pytest.mark.parametrize("gbps,schedule", [(0.5, "1f1b"), (50.0, "1f1b"), (2.0, "gpipe")])
def test_below_every_plan_of_one_gpu_hosts(gbps, schedule):
    problem = _slow_pool(gbps, 4, 3e8, schedule)
    for p in (problem, recompute_problem(problem)):
        prices = [price_program(p, placement).step_ms for placement in _every_plan(p)]
        assert prices and 0 < fill_bound_ms(p) <= min(prices) * HAIR


def test_below_random_plans_of_wide_area_pools():
    priced = 0
    for seed in range(5):
        rng = np.random.default_rng(700 + seed)
        chain = random_chain(rng, int(rng.integers(4, 9)), param_scale=float(rng.choice([1e8, 6e8])),
                             act_scale=2e8, out_scale=float(rng.choice([1e6, 2e7])))
        config = TrainingConfig(global_batch=int(rng.choice([4, 8, 16])), microbatch_size=1,
                                schedule="gpipe" if seed % 3 == 2 else "1f1b")
        cluster = wide_area_cluster(rng, int(rng.integers(4, 10)))
        for policy in (VerificationPolicy(enabled=False), VerificationPolicy()):
            problem = build_problem(scale_chain(chain, 1), cluster, config, policy)
            bound = fill_bound_ms(problem)
            for _ in range(12):
                placement = random_placement(rng, problem, cluster)
                if placement is not None:
                    assert bound <= price_program(problem, placement).step_ms * HAIR, placement
                    priced += 1
    assert priced >= 10


def _two_kinds(rng: np.random.Generator, *, ends: bool):
    """Hosts of a fast and a slow GPU type (1-4 each, NVLink inside, 10-50 Gb/s between, a slow zone link),
    a uniform chain with a heavy head, 8-32 microbatches: the fill bound's problem (all trusted, or with trusted
    ends where ``ends``: a random half of the hosts untrusted)."""
    fast, slow = ("A100-40GB", "V100-16GB") if rng.random() < 0.5 else ("A100-80GB", "T4")
    hosts = []
    for i in range(int(rng.integers(3, 6))):
        trusted = not ends or i < 2 or rng.random() < 0.5
        hosts.append({"name": f"h{i}", "region": f"z{i % 2}", "trust": "op" if trusted else f"v{i}",
                      "trusted": bool(trusted),
                      "devices": [{"type": fast if i % 2 == 0 else slow, "count": int(rng.integers(1, 5))}],
                      "intra_host": {"bandwidth_gbps": 1200, "latency_ms": 0.005}})
    if ends:
        hosts.append({"name": "verifier", "region": "z0", "trust": "op", "trusted": True, "role": "verifier",
                      "devices": [{"type": "CPU", "count": 1}]})
    links = {"intra_host": {"bandwidth_gbps": 100, "latency_ms": 0.01},
             "default": {"bandwidth_gbps": float(rng.choice([10, 50])), "latency_ms": 0.1},
             "regions": [{"between": ["z0", "z1"], "bandwidth_gbps": float(rng.choice([2, 16])),
                          "latency_ms": float(rng.choice([1, 15]))}]}
    cluster = parse_cluster({"name": "two-kinds", "hosts": hosts, "links": links})
    L = int(rng.integers(4, 10))
    chain = random_chain(rng, L, param_scale=float(rng.choice([5e7, 2e8])), flop_scale=float(rng.choice([5e11, 3e12])),
                         act_scale=5e7, out_scale=float(rng.choice([1e6, 1e7])), uniform=True)
    head = chain.blocks[-1]
    blocks = chain.blocks[:-1] + (dataclasses.replace(head, fwd_flops=2 * head.fwd_flops,
                                                      bwd_flops=2 * head.bwd_flops),)
    config = TrainingConfig(global_batch=int(rng.choice([8, 16, 32])), microbatch_size=1,
                            schedule="gpipe" if rng.random() < 0.25 else "1f1b")
    policy = VerificationPolicy() if ends else VerificationPolicy(enabled=False)
    problem = build_problem(scale_chain(dataclasses.replace(chain, blocks=blocks), 1), cluster, config, policy)
    return problem, cluster


def _uneven(rng: np.random.Generator, placement: Placement) -> Placement:
    """The placement with each replicated stage's microbatches split at random (each replica one at least)."""
    M, stages = placement.num_microbatches, []
    for st in placement.stages:
        r = len(st.devices)
        cuts = sorted(rng.choice(np.arange(1, M), size=r - 1, replace=False).tolist()) if 1 < r <= M else []
        shares = tuple(b - a for a, b in zip([0] + cuts, cuts + [M])) if cuts or r == 1 else st.microbatches
        stages.append(dataclasses.replace(st, microbatches=shares))
    return dataclasses.replace(placement, stages=tuple(stages))


@pytest.mark.parametrize("ends", [False, True])
def test_below_hill_climbed_plans_of_two_kinds(ends):
    """Random plans (even and uneven shares), each hill-climbed on the programs' cost: the bound stays below."""
    priced = 0
    for seed in range(8):
        rng = np.random.default_rng(1300 + seed + (50 if ends else 0))
        problem, cluster = _two_kinds(rng, ends=ends)
        for p in (problem, recompute_problem(problem)):
            bound = fill_bound_ms(p)
            assert bound > 0
            for _ in range(6):
                placement = random_placement(rng, p, cluster)
                if placement is None:
                    continue
                for draw in (placement, _uneven(rng, placement)):
                    if violations(p, draw):
                        continue
                    assert bound <= price_program(p, draw).step_ms * HAIR, draw
                    priced += 1
                climbed, ms = polish(p, placement, time_budget_s=0.05)
                assert bound <= ms * HAIR, climbed
    assert priced >= 20


def _fast_and_slow():
    """One host of 2 A100s, one of 4 V100s (the A100s alone run the chain far slower), 8 uniform blocks."""
    hosts = [{"name": "a", "region": "z", "trust": "op", "trusted": True,
              "devices": [{"type": "A100-40GB", "count": 2}]},
             {"name": "v", "region": "z", "trust": "op", "trusted": True,
              "devices": [{"type": "V100-16GB", "count": 4}]}]
    cluster = parse_cluster({"name": "fast-slow", "hosts": hosts,
                             "links": {"intra_host": {"bandwidth_gbps": 1200, "latency_ms": 0.005},
                                       "default": {"bandwidth_gbps": 50, "latency_ms": 0.1}}})
    chain = random_chain(np.random.default_rng(5), 8, param_scale=5e7, flop_scale=3e12, act_scale=5e7,
                         out_scale=1e6, uniform=True)
    config = TrainingConfig(global_batch=16, microbatch_size=1)
    return build_problem(scale_chain(chain, 1), cluster, config, VerificationPolicy(enabled=False))


def test_the_slow_kind_pays_its_fill():
    """The fluid LP lets the V100s run 4/9 of every block with no fill; here each stage's replicas wait for the
    path before them: the bound rises above the fluid LP and the link bound, and stays below a plan."""
    problem = _fast_and_slow()
    bound = fill_bound_ms(problem)
    assert bound > 1.08 * max(program_lower_bound_ms(problem), replica_bound_ms(problem))
    assert link_lower_bound_ms(problem) >= bound
    a = [d for c in problem.classes if c.spec.name.startswith("A100") for d in c.device_ids]
    v = [d for c in problem.classes if c.spec.name.startswith("V100") for d in c.device_ids]
    M = problem.num_microbatches
    stages = (StagePlacement(index=0, first_block=0, last_block=2, devices=tuple(a[:1]), microbatches=(M,)),
              StagePlacement(index=1, first_block=3, last_block=5, devices=tuple(v), microbatches=(4, 4, 4, 4)),
              StagePlacement(index=2, first_block=6, last_block=7, devices=tuple(a[1:]), microbatches=(M,)))
    plan = Placement(stages=stages, verifiers=(), num_microbatches=M)
    assert not violations(problem, plan)
    assert bound <= price_program(problem, plan).step_ms * HAIR
    assert math.isfinite(bound)


@pytest.mark.parametrize("M", [1, 4])
def test_on_one_gpu_the_bound_is_its_one_plan(M):
    """One A100 beside a CPU verifier host: the only plan runs every block there and then its optimizer step
    (``step >= pipe + optim_0``). The bound was the passes alone (a tiny model's plan of 0.48 ms, bounded by
    0.31: a gap of 36% where there is no other plan); now it is that plan's price."""
    hosts = [{"name": "a", "region": "z", "trust": "op", "trusted": True,
              "devices": [{"type": "A100-80GB", "count": 1}]},
             {"name": "verifier", "region": "z", "trust": "op", "trusted": True, "role": "verifier",
              "devices": [{"type": "CPU", "count": 1}]}]
    cluster = parse_cluster({"name": "one", "hosts": hosts,
                             "links": {"intra_host": {"bandwidth_gbps": 100, "latency_ms": 0.01},
                                       "default": {"bandwidth_gbps": 10, "latency_ms": 1.0}}})
    chain = random_chain(np.random.default_rng(2), 6, param_scale=2e6, flop_scale=2e8, act_scale=1e6, out_scale=1e5)
    problem = build_problem(scale_chain(chain, 1), cluster, TrainingConfig(global_batch=M, microbatch_size=1),
                            VerificationPolicy())
    gpu = next(c for c in problem.classes if c.stage_capable).device_ids[0]
    only = Placement(stages=(StagePlacement(index=0, first_block=0, last_block=problem.num_blocks - 1,
                                            devices=(gpu,), microbatches=(M,)),), verifiers=(), num_microbatches=M)
    price = price_program(problem, only).step_ms
    assert price * (1 - 1e-4) <= link_lower_bound_ms(problem) <= price * HAIR


@pytest.mark.parametrize("gpus,gbps", [(2, 100.0), (3, 10.0), (4, 1.0)])
def test_within_a_fifth_of_every_plan_of_one_host(gpus, gbps):
    """A tiny model on one host: stage 0 replicated pays its all-reduce and optimizer step after its passes; the
    bound stays below every plan (at most 3 stages, any replicas) and within 20% of the best."""
    hosts = [{"name": "a", "region": "z", "trust": "op", "trusted": True,
              "devices": [{"type": "A100-80GB", "count": gpus}]}]
    cluster = parse_cluster({"name": "one-host", "hosts": hosts,
                             "links": {"intra_host": {"bandwidth_gbps": gbps, "latency_ms": 0.01},
                                       "default": {"bandwidth_gbps": 10, "latency_ms": 1.0}}})
    chain = random_chain(np.random.default_rng(2), 5, param_scale=2e6, flop_scale=2e8, act_scale=1e6, out_scale=1e5)
    for M in (1, 2, 4):
        problem = build_problem(scale_chain(chain, 1), cluster, TrainingConfig(global_batch=M, microbatch_size=1),
                                VerificationPolicy(enabled=False))
        best = min(price_program(problem, placement).step_ms for placement in _every_plan(problem))
        assert 0.8 * best <= fill_bound_ms(problem) <= best * HAIR, M


@pytest.mark.parametrize("kw", [{}, {"param_scale": 1e8, "flop_scale": 5e11, "out_scale": 4e6}])
def test_below_every_plan_of_a_small_swarm(kw):
    """Trusted ends on a host of two: each end stage holds one of its GPUs at most (the other end holds the
    other); the bound stays below every plan with volunteers between them."""
    problem, cluster = _small_swarm(**kw)
    prices = _swarm_prices(problem, cluster)
    assert prices and 0 < fill_bound_ms(problem) <= min(prices) * HAIR
