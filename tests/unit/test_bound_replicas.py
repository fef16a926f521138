"""The replicas' bound (``bound.replicas``) and the trusted island's crossing pairs (``bound.links``) are below
the compiled programs' cost of every plan: the enumerated optimum of small random problems (devices, classes,
trust, verifier hosts), every valid plan of one-GPU hosts on slow links (replicated last stages included), and
random plans of wide-area pools (trusted ends and verifiers or not); positive wherever a plan exists; above the fluid LP where a heavy
last block sits behind slow links."""
from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest

from cost_models.cluster_file import parse_cluster
from cost_models.training import TrainingConfig
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
from planner.solver.verifiers import assign_verifiers
from tests.unit.bruteforce import brute_force
from tests.unit.program_fixtures import random_placement, stages_of, wide_area_cluster
from tests.unit.solver_fixtures import random_chain
from tests.unit.test_solver_bruteforce import TWIST_SEEDS, instance


@pytest.mark.parametrize("twists", [False, True])
def test_below_the_enumerated_optimum_and_positive_where_a_plan_exists(twists):
    for seed in (TWIST_SEEDS if twists else range(28)):
        chain, cluster, config, policy = instance(seed, twists=twists)
        problem = build_problem(scale_chain(chain, config.microbatch_size), cluster, config, policy)
        best, _ = brute_force(problem, program=True)
        bound = replica_bound_ms(problem)
        assert bound <= best * (1 + 1e-9), seed
        if math.isfinite(best):
            assert bound > 0, seed


def _slow_pool(gbps: float, hosts: int, head_params: float, schedule: str = "1f1b"):
    """One-GPU hosts on ``gbps`` links (as DT-FM's), a chain whose last block holds ``head_params`` parameters."""
    spec = [{"name": f"h{i}", "region": "r", "trust": "op", "trusted": True,
             "devices": [{"type": "V100-16GB", "count": 1}]} for i in range(hosts)]
    cluster = parse_cluster({"name": "slow", "hosts": spec,
                             "links": {"intra_host": {"bandwidth_gbps": 100, "latency_ms": 0.01},
                                       "default": {"bandwidth_gbps": gbps, "latency_ms": 5.0}}})
    chain = random_chain(np.random.default_rng(11), 5, param_scale=5e7, act_scale=1e8, out_scale=4e6, uniform=True)
    blocks = list(chain.blocks)
    head = blocks[-1]
    blocks[-1] = dataclasses.replace(head, param_count=int(head_params), param_bytes=int(4 * head_params),
                                     fwd_flops=3 * head.fwd_flops, bwd_flops=3 * head.bwd_flops)
    chain = dataclasses.replace(chain, blocks=tuple(blocks))
    config = TrainingConfig(global_batch=8, microbatch_size=1, schedule=schedule)
    return build_problem(scale_chain(chain, 1), cluster, config, VerificationPolicy(enabled=False))


def _every_plan(problem, max_stages: int = 3):
    """Every contiguous split into at most ``max_stages`` stages and every replica count per stage (devices in
    order, microbatches split evenly): the valid ones."""
    L, M = problem.num_blocks, problem.num_microbatches
    gpus = [d for c in problem.classes if c.stage_capable for d in c.device_ids]
    for S in range(1, min(L, max_stages, len(gpus)) + 1):
        for cuts in itertools.combinations(range(1, L), S - 1):
            for counts in itertools.product(range(1, len(gpus) - S + 2), repeat=S):
                if sum(counts) <= len(gpus):
                    placement = Placement(stages=tuple(stages_of(list(cuts), list(counts), gpus, L, M)),
                                          verifiers=(), num_microbatches=M)
                    if not violations(problem, placement):
                        yield placement


@pytest.mark.parametrize("gbps,schedule", [(0.5, "1f1b"), (2.0, "1f1b"), (50.0, "1f1b"), (2.0, "gpipe")])
def test_below_every_plan_of_one_gpu_hosts(gbps, schedule):
    problem = _slow_pool(gbps, 4, 3e8, schedule)
    for p in (problem, recompute_problem(problem)):
        bound = replica_bound_ms(p)
        prices = [price_program(p, placement).step_ms for placement in _every_plan(p)]
        assert prices and 0 < bound <= min(prices) * (1 + 1e-9)
        assert link_lower_bound_ms(p) <= min(prices) * (1 + 1e-9)


def test_a_heavy_last_block_behind_slow_links_lifts_the_bound():
    """One replica runs every head; two or more all-reduce its gradients over 0.5 Gb/s: above the fluid LP."""
    problem = _slow_pool(0.5, 4, 3e8)
    bound = replica_bound_ms(problem)
    assert bound > 1.2 * program_lower_bound_ms(problem)
    assert link_lower_bound_ms(problem) >= bound


def test_below_random_plans_of_wide_area_pools():
    priced = 0
    for seed in range(6):
        rng = np.random.default_rng(900 + seed)
        chain = random_chain(rng, int(rng.integers(4, 9)), param_scale=float(rng.choice([1e8, 6e8])),
                             act_scale=2e8, out_scale=float(rng.choice([1e6, 2e7])))
        config = TrainingConfig(global_batch=int(rng.choice([4, 8, 16])), microbatch_size=1,
                                schedule="gpipe" if seed % 3 == 2 else "1f1b")
        cluster = wide_area_cluster(rng, int(rng.integers(4, 10)))
        for policy in (VerificationPolicy(enabled=False), VerificationPolicy()):
            problem = build_problem(scale_chain(chain, 1), cluster, config, policy)
            bounds = (replica_bound_ms(problem), link_lower_bound_ms(problem))
            for _ in range(15):
                placement = random_placement(rng, problem, cluster)
                if placement is not None:
                    assert max(bounds) <= price_program(problem, placement).step_ms * (1 + 1e-9), placement
                    priced += 1
    assert priced >= 10


def _small_swarm(*, param_scale: float = 4e8, flop_scale: float = 5e10, out_scale: float = 4e7):
    """A trusted host of two GPUs (the ends) and three volunteers' GPUs on 0.2 Gb/s, trusted ends, verifiers."""
    hosts = [{"name": "home", "region": "r", "trust": "op", "trusted": True, "devices": [{"type": "T4", "count": 2}]}]
    hosts += [{"name": f"v{i}", "region": "r", "trust": f"v{i}", "devices": [{"type": "T4", "count": 1}]}
              for i in range(3)]
    cluster = parse_cluster({"name": "swarm", "hosts": hosts,
                             "links": {"intra_host": {"bandwidth_gbps": 100, "latency_ms": 0.01},
                                       "default": {"bandwidth_gbps": 0.2, "latency_ms": 50.0}}})
    chain = random_chain(np.random.default_rng(3), 6, param_scale=param_scale, flop_scale=flop_scale, act_scale=5e7,
                         out_scale=out_scale, uniform=True)
    config = TrainingConfig(global_batch=8, microbatch_size=1)
    return build_problem(scale_chain(chain, 1), cluster, config, VerificationPolicy()), cluster


def _swarm_prices(problem, cluster) -> list[float]:
    """Every plan with the ends on the trusted host, volunteers between (replicated or not), a verifier per checked
    boundary: the valid ones' prices."""
    L, M = problem.num_blocks, problem.num_microbatches
    home = [d.id for d in cluster.hosts[0].devices]
    peers = [d.id for h in cluster.hosts[1:] for d in h.devices]
    prices = []
    for S in range(2, 5):
        for cuts in itertools.combinations(range(1, L), S - 1):
            for counts in itertools.product(range(1, 4), repeat=S - 2):
                if sum(counts) > len(peers):
                    continue
                stages = tuple(stages_of(list(cuts), [1, *counts, 1], [home[0], *peers[:sum(counts)], home[1]], L, M))
                verifiers = assign_verifiers(problem, stages, M)
                placement = Placement(stages=stages, verifiers=verifiers or (), num_microbatches=M)
                if verifiers is not None and not violations(problem, placement):
                    prices.append(price_program(problem, placement).step_ms)
    return prices


def test_the_trusted_islands_crossing_is_below_every_plan_of_a_small_swarm():
    problem, cluster = _small_swarm()
    prices = _swarm_prices(problem, cluster)
    bound = link_lower_bound_ms(problem)
    assert prices and 0 < bound <= min(prices) * (1 + 1e-9)
    # One pair carries every activation out of the trusted host (two pairs, the two largest islands, gave half).
    assert bound >= problem.num_microbatches * 1e3 * problem.wire_bytes(0, None) / 0.2e9 * 8 * (1 - 1e-6)


def test_volunteers_between_trusted_ends_pay_slow_rings_and_hops():
    """Small boundaries, heavy passes: the stages between the ends cannot replicate on the trusted host's fast
    link (the ends hold it), and every hop but one crosses 0.2 Gb/s."""
    problem, cluster = _small_swarm(param_scale=1e8, flop_scale=5e11, out_scale=4e6)
    prices = _swarm_prices(problem, cluster)
    bound = replica_bound_ms(problem)
    assert prices and bound <= min(prices) * (1 + 1e-9)
    assert bound > 1.5 * program_lower_bound_ms(problem)
