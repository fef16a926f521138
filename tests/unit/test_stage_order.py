"""Stage order across regions: the DP over subsets puts the groups where the slow links carry no boundary."""
from __future__ import annotations

import itertools

import numpy as np

from cost_models.cluster_file import parse_cluster
from cost_models.training import TrainingConfig
from planner.solver.objective import Placement, even_split, price_program
from planner.solver.policy import VerificationPolicy
from planner.solver.problem_build import build_problem, scale_chain
from planner.solver.search.stage_order import best_order, reorder
from planner.solver.solution import StagePlacement
from tests.unit.solver_fixtures import random_chain

REGIONS = ("east", "middle", "west", "far")


def _line():
    """Four one-host regions in a line (east-middle-west-far, 10 Gb/s between neighbours, 0.1 Gb/s else)."""
    hosts = [{"name": r, "region": r, "trust": "op", "trusted": True, "devices": [{"type": "A100-80GB", "count": 2}]}
             for r in REGIONS]
    pairs = [{"between": [a, b], "bandwidth_gbps": 10.0 if abs(i - j) == 1 else 0.1, "latency_ms": 5.0}
             for (i, a), (j, b) in itertools.combinations(enumerate(REGIONS), 2)]
    return parse_cluster({"name": "line", "hosts": hosts, "links": {"default": {"bandwidth_gbps": 1},
                                                                     "regions": pairs}})


def _problem(seed: int):
    chain = random_chain(np.random.default_rng(seed), 12, param_scale=2e7, act_scale=5e7, out_scale=3e7)
    return build_problem(scale_chain(chain, 1), _line(), TrainingConfig(global_batch=8, microbatch_size=1),
                         VerificationPolicy(enabled=False))


def _placement(problem, regions: tuple[str, ...]) -> Placement:
    M = problem.num_microbatches
    stages = tuple(StagePlacement(index=k, first_block=3 * k, last_block=3 * k + 2, devices=(f"{r}/0", f"{r}/1"),
                                  microbatches=even_split(M, 2)) for k, r in enumerate(regions))
    return Placement(stages=stages, verifiers=(), num_microbatches=M)


def test_the_groups_are_ordered_along_the_fast_links():
    for seed in range(3):
        problem = _problem(seed)
        shuffled = _placement(problem, ("west", "east", "far", "middle"))
        order = best_order(problem, shuffled.stages)
        regions = [shuffled.stages[g].devices[0].split("/")[0] for g in order]
        assert regions in (list(REGIONS), list(reversed(REGIONS)))
        better = reorder(problem, shuffled)
        assert better is not None
        assert price_program(problem, better).step_ms < 0.5 * price_program(problem, shuffled).step_ms


def test_an_order_already_best_is_kept():
    problem = _problem(0)
    assert reorder(problem, _placement(problem, REGIONS)) is None


def test_a_planned_pipeline_sends_no_boundary_over_a_slow_link():
    """The whole path (solver, its reordered rival, simulation): consecutive stages on neighbouring regions."""
    from planner.api import plan_chain
    chain = random_chain(np.random.default_rng(0), 12, param_scale=2e9, act_scale=5e7, out_scale=3e7)
    plan = plan_chain(chain, _line(), spec="tests:chain", global_batch=8, microbatch_size=1, time_limit_s=2,
                      policy=VerificationPolicy(enabled=False), workers=1)
    regions = [{REGIONS.index(plan.ranks[r].host) for r in plan.stage_ranks(k)} for k in range(plan.num_stages)]
    assert plan.num_stages >= 3
    for a, b in zip(regions, regions[1:]):
        assert all(abs(i - j) <= 1 for i in a for j in b), regions
