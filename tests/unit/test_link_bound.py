"""The link-aware bound (``bound.links``) is below the compiled programs' cost of every valid plan drawn on random
wide-area and volunteer pools (1F1B and GPipe, recomputing stages mixed in, trusted ends with verifiers), and
above the compute-only fluid LP where the model must cross slow links."""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from cost_models.cluster_file import parse_cluster
from cost_models.training import TrainingConfig
from planner.solver.bound.links import link_lower_bound, link_lower_bound_ms
from planner.solver.objective import (
    Placement,
    price_program,
    program_lower_bound_ms,
    violations,
)
from planner.solver.policy import VerificationPolicy
from planner.solver.problem import bound_problem, recompute_problem
from planner.solver.problem_build import build_problem, scale_chain
from planner.solver.verifiers import assign_verifiers
from tests.unit.bruteforce import brute_force
from tests.unit.program_fixtures import (
    POLICY,
    random_placement,
    stages_of,
    untrusted_pool,
    wide_area_cluster,
)
from tests.unit.solver_fixtures import random_chain
from tests.unit.test_solver_bruteforce import TWIST_SEEDS, instance

DRAWS = 12  # placements per problem


def _problems(seed: int):
    """A random wide-area pool (trusted ends off) and a volunteer pool (trusted ends on), each model too big for
    most single devices, on 1F1B or GPipe, with codecs allowed or not; the recomputing twin of each too."""
    rng = np.random.default_rng(seed)
    schedule = "gpipe" if seed % 3 == 2 else "1f1b"
    chain = random_chain(rng, int(rng.integers(5, 12)), param_scale=float(rng.choice([3e8, 1e9])), act_scale=3e8,
                         out_scale=float(rng.choice([1e6, 2e7])))
    compress = "auto" if seed % 2 else "none"  # codecs shrink the boundary the link terms charge
    config = TrainingConfig(global_batch=int(rng.choice([4, 8, 16])), microbatch_size=1, schedule=schedule,
                            compress=compress)
    for cluster, policy in ((wide_area_cluster(rng, int(rng.integers(4, 12))), POLICY),
                            (untrusted_pool(rng), VerificationPolicy())):
        base = build_problem(scale_chain(chain, 1), cluster, config, policy)
        yield base, cluster, rng
        yield recompute_problem(base), cluster, rng


def _draws(problem, cluster, rng):
    """Valid placements: random contiguous stages on shuffled devices; trusted devices at the ends with verifiers
    where the policy asks; some stages recomputing where the problem allows."""
    L, M = problem.num_blocks, problem.num_microbatches
    ends = problem.policy.enabled and problem.policy.trusted_endpoints
    for _ in range(DRAWS):
        if ends:
            placement = _trusted_ends(problem, cluster, rng)
        else:
            placement = random_placement(rng, problem, cluster)
            if placement is None:  # often over memory: try fewer blocks per stage on more devices
                continue
        if placement is not None and problem.recompute:
            flags = rng.random(placement.num_stages) < 0.5
            stages = tuple(dataclasses.replace(st, recompute=bool(f)) for st, f in zip(placement.stages, flags))
            placement = dataclasses.replace(placement, stages=stages)
        if placement is not None and not violations(problem, placement):
            yield placement
    gpus = [d for c in problem.classes if c.stage_capable for d in c.device_ids]
    for S in range(1, min(L, len(gpus)) + 1):  # every device on one stage, even cuts: the likely best
        if ends:
            break
        cuts = [round(L * i / S) for i in range(1, S)]
        if len(set(cuts)) != len(cuts) or 0 in cuts:
            continue
        counts = [len(gpus) // S] * S
        stages = tuple(stages_of(cuts, counts, gpus, L, M))
        placement = Placement(stages=stages, verifiers=(), num_microbatches=M)
        if not violations(problem, placement):
            yield placement


def _trusted_ends(problem, cluster, rng):
    L, M = problem.num_blocks, problem.num_microbatches
    trusted = [d.id for d in cluster.hosts[0].devices]
    untrusted = [d.id for h in cluster.hosts[1:] for d in h.devices]
    S = int(rng.integers(2, min(5, L) + 1))
    cuts = sorted(rng.choice(np.arange(1, L), size=S - 1, replace=False).tolist())
    split = int(rng.integers(1, len(trusted)))
    middle = [list(g) for g in np.array_split(rng.permutation(untrusted), S - 2)] if S > 2 else []
    groups = [trusted[:split], *middle, trusted[split:]]
    if any(not g for g in groups):
        return None
    stages = tuple(stages_of(cuts, [len(g) for g in groups], [str(d) for g in groups for d in g], L, M))
    verifiers = assign_verifiers(problem, stages, M)
    return None if verifiers is None else Placement(stages=stages, verifiers=verifiers, num_microbatches=M)


@pytest.mark.parametrize("seed", range(6))
def test_the_bound_is_below_every_plan_drawn(seed):
    priced = 0
    for problem, cluster, rng in _problems(700 + seed):
        bound = link_lower_bound_ms(problem)
        for placement in _draws(problem, cluster, rng):
            assert bound <= price_program(problem, placement).step_ms * (1 + 1e-9), placement
            priced += 1
    assert priced >= 3  # the draws did reach valid plans


@pytest.mark.parametrize("twists", [False, True])
def test_the_bound_is_below_the_enumerated_optimum(twists):
    """Against the least program cost over every plan (``bruteforce``) of the brute-force instances."""
    for seed in (TWIST_SEEDS if twists else range(28)):
        chain, cluster, config, policy = instance(seed, twists=twists)
        problem = build_problem(scale_chain(chain, config.microbatch_size), cluster, config, policy)
        best, _ = brute_force(problem, program=True)
        assert link_lower_bound_ms(problem) <= best * (1 + 1e-9)
        assert program_lower_bound_ms(problem) <= best * (1 + 1e-9)  # the valid bound's compute term


def _comm_bound_case():
    """Four one-GPU hosts on 0.1 Gb/s links; a model none holds alone, with large boundary tensors."""
    hosts = [{"name": f"h{i}", "region": "r", "trust": "op", "trusted": True,
              "devices": [{"type": "A100-40GB", "count": 1}]} for i in range(4)]
    cluster = parse_cluster({"name": "slow", "hosts": hosts,
                             "links": {"intra_host": {"bandwidth_gbps": 100, "latency_ms": 0.01},
                                       "default": {"bandwidth_gbps": 0.1, "latency_ms": 30.0}}})
    chain = random_chain(np.random.default_rng(5), 8, param_scale=6e8, act_scale=2e8, out_scale=5e7, uniform=True)
    config = TrainingConfig(global_batch=8, microbatch_size=1)
    return build_problem(scale_chain(chain, 1), cluster, config, VerificationPolicy(enabled=False)), cluster


def _two_hosts(gbps: float, schedule: str):
    """Two hosts of two GPUs, NVLink inside, ``gbps`` between; a model that one host holds but one GPU may not."""
    hosts = [{"name": f"h{i}", "region": f"r{i}", "trust": "op", "trusted": True,
              "devices": [{"type": kind, "count": 2}]} for i, kind in enumerate(("A100-40GB", "V100-16GB"))]
    cluster = parse_cluster({"name": "two", "hosts": hosts,
                             "links": {"intra_host": {"bandwidth_gbps": 2400, "latency_ms": 0.005},
                                       "default": {"bandwidth_gbps": gbps, "latency_ms": 10.0}}})
    chain = random_chain(np.random.default_rng(7), 6, param_scale=4e8, act_scale=3e8, out_scale=1e8)
    config = TrainingConfig(global_batch=8, microbatch_size=1, schedule=schedule)
    return build_problem(scale_chain(chain, 1), cluster, config, VerificationPolicy(enabled=False))


def _every_plan(problem, max_stages: int = 4):
    """Every contiguous split into at most ``max_stages`` stages, every replica count per stage, devices taken
    in host order and in reverse (both hosts' ends), microbatches split evenly: the valid ones."""
    L, M = problem.num_blocks, problem.num_microbatches
    gpus = [d for c in problem.classes if c.stage_capable for d in c.device_ids]
    for S in range(1, min(L, max_stages, len(gpus)) + 1):
        for cuts in itertools.combinations(range(1, L), S - 1):
            for counts in itertools.product(range(1, len(gpus) - S + 2), repeat=S):
                if sum(counts) > len(gpus):
                    continue
                for order in (gpus, gpus[::-1]):
                    stages = tuple(stages_of(list(cuts), list(counts), order, L, M))
                    placement = Placement(stages=stages, verifiers=(), num_microbatches=M)
                    if not violations(problem, placement):
                        yield placement


@pytest.mark.parametrize("gbps,schedule", [(0.5, "1f1b"), (5.0, "1f1b"), (0.5, "gpipe")])
def test_the_bound_is_below_every_plan_of_a_small_pool(gbps, schedule):
    for problem in (_two_hosts(gbps, schedule), _comm_bound_case()[0]):
        for p in (problem, recompute_problem(problem)):
            bound = link_lower_bound_ms(p)
            prices = [price_program(p, placement).step_ms for placement in _every_plan(p)]
            assert prices and bound <= min(prices) * (1 + 1e-9)


def test_the_bound_sees_the_links_where_the_model_must_cross_them():
    problem, cluster = _comm_bound_case()
    found = link_lower_bound(problem)
    compute = program_lower_bound_ms(bound_problem(problem))
    assert found.bound_ms > 1.5 * compute
    assert found.limit in ("links", "memory", "fill")
    rng = np.random.default_rng(0)
    for placement in _draws(problem, cluster, rng):
        assert found.bound_ms <= price_program(problem, placement).step_ms
