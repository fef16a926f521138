"""Verifiers placed on the programs' price inside the search (issue 36, the swarm-t4 case): a boundary's verifier
moved whole to another trusted device, or its senders split over several (``shared_verifiers.place_on_programs``:
least busy first, or by side), where the compiled programs price faster; the mixed search's pipelines of single
devices with trusted ends.

On a volunteer swarm (two trusted T4s on one host, untrusted single-T4 hosts on 200 Mb/s) the greedy placement
(``verifiers.assign_verifiers``) scores sites by the closed form, where every send counts as busy time: the trusted
devices' checks look free anywhere and a tie keeps three boundaries on one T4. The search then never kept a
pipeline of single T4s, whose verifiers spread over both trusted T4s price 25% under the greedy's.
"""
from __future__ import annotations

import dataclasses
import itertools

import pytest

from cost_models.cluster_file import parse_cluster
from cost_models.training import TrainingConfig
from planner.simulate import simulate
from planner.solver import api as solver_api
from planner.solver.api import problem_for
from planner.solver.link_tests import lost_link_tests
from planner.solver.objective import (
    Placement,
    price_program,
    required_directions,
    violations,
)
from planner.solver.policy import VerificationPolicy
from planner.solver.search import budget, mixed
from planner.solver.search.budget import Work
from planner.solver.search.chain_dp import Group
from planner.solver.search.polish import polish
from planner.solver.shared_verifiers import place_on_programs, split_shared
from planner.solver.solution import StagePlacement, VerifierPlacement
from planner.solver.verifiers import assign_verifiers
from tests.unit.plan_fixtures import block, chain
from tests.unit.program_fixtures import _compiled, replicated_untrusted_placement

TRUSTED = ("coord/0", "coord/1")
CONFIG = TrainingConfig(global_batch=16, microbatch_size=1, dtype="float16", mixed_precision=True)


@pytest.fixture(autouse=True)
def no_ceiling(monkeypatch):
    """The wall-clock ceiling out of the way (a loaded machine reaches it): the work budget alone ends the search."""
    monkeypatch.setattr(budget, "CEILING_FACTOR", 50.0)


def _swarm(peers: int = 8):
    """swarm-t4 in small: a trusted host of two T4s, ``peers`` untrusted hosts of one T4, 200 Mb/s and 50 ms."""
    hosts = [{"name": "coord", "region": "i", "trust": "op", "trusted": True, "devices": [{"type": "T4", "count": 2}]}]
    hosts += [{"name": f"p{i}", "region": "i", "trust": f"p{i}", "devices": [{"type": "T4", "count": 1}]}
              for i in range(peers)]
    return parse_cluster({"name": "mini-swarm", "hosts": hosts, "links": {
        "intra_host": {"bandwidth_gbps": 128.0, "latency_ms": 0.01},
        "default": {"bandwidth_gbps": 0.2, "latency_ms": 50.0}}})


def _gpt_like(blocks: int = 24):
    """GPT-1.3b-like layers (one sample of 1024 tokens): 0.11 TFLOP forward, 60M parameters, 8 MiB out."""
    return chain([block(i, fwd_flops=110 * 10**9, params=60_000_000, saved_act_bytes=160_000_000,
                        out_bytes=8 * 2**20) for i in range(blocks)], microbatch_size=1)


def _pipeline(problem, sizes: list[int]) -> tuple[StagePlacement, ...]:
    """Single-T4 stages of ``sizes`` blocks: the trusted T4s at the ends, untrusted peers between."""
    devices = [TRUSTED[0], *(f"p{i}/0" for i in range(len(sizes) - 2)), TRUSTED[1]]
    out, at = [], 0
    for k, (n, d) in enumerate(zip(sizes, devices)):
        out.append(StagePlacement(index=k, first_block=at, last_block=at + n - 1, devices=(d,),
                                  microbatches=(problem.num_microbatches,)))
        at += n
    return tuple(out)


def _best_by_hand(problem, stages) -> tuple[float, Placement]:
    """Every whole-boundary choice between the two trusted T4s, priced: the cheapest valid (independent of the
    code under test)."""
    checked = [b for b in range(len(stages) - 1) if required_directions(problem, stages, b)]
    best = None
    for sites in itertools.product(TRUSTED, repeat=len(checked)):
        verifiers = tuple(VerifierPlacement(boundary=b, device=s, directions=required_directions(problem, stages, b))
                          for b, s in zip(checked, sites))
        placement = Placement(stages=stages, verifiers=verifiers, num_microbatches=problem.num_microbatches)
        if not violations(problem, placement):
            ms = price_program(problem, placement).step_ms
            best = min(best or (ms, placement), (ms, placement), key=lambda x: x[0])
    assert best is not None
    return best


def test_the_search_spreads_a_pipelines_verifiers_over_both_trusted_devices():
    """Before: the search's plan was 3 stages (9/8/7 blocks, 5,537.7 ms): its 5-stage pipeline priced 7,020.4 ms
    with the greedy's verifiers (boundaries 0-2 on one T4) and 5,287.5 with them alternating."""
    cluster, ch, policy = _swarm(), _gpt_like(), VerificationPolicy()
    problem = problem_for(ch, cluster, CONFIG, policy, 1)[0]
    stages = _pipeline(problem, [5, 5, 5, 5, 4])
    greedy = Placement(stages=stages, verifiers=assign_verifiers(problem, stages, problem.num_microbatches),
                       num_microbatches=problem.num_microbatches)
    hand_ms, _ = _best_by_hand(problem, stages)
    assert hand_ms < 0.8 * price_program(problem, greedy).step_ms  # the greedy misses the spread placement
    assert place_on_programs(problem, greedy)[1] == pytest.approx(hand_ms)

    solution = solver_api.solve(ch, cluster, CONFIG, policy, time_limit_s=2.0, workers=1)
    assert solution.predicted_step_ms <= hand_ms * (1 + 1e-6), (solution.predicted_step_ms, hand_ms)
    placement = Placement(stages=tuple(dataclasses.replace(st, in_flight=()) for st in solution.stages),
                          verifiers=solution.verifiers, num_microbatches=solution.num_microbatches)
    priced, plan = _compiled(problem, placement, ch, cluster, CONFIG, policy)
    assert priced.step_ms == pytest.approx(simulate(plan).step_ms, rel=0.05)


def test_the_search_finds_a_split_boundary_that_beats_every_unsplit_placement():
    """Two peers (four T4s at most): before, the search's plan was 3 stages (8/8/8 blocks, 10,193.4 ms); the 4-stage
    pipeline 7/6/6/5 with boundary 1 split by side (its activations' sender checked on the last T4, its gradients'
    on the first) prices 9,456.5 ms, its best unsplit placement 11,765.8 (whole-boundary choices, by hand)."""
    cluster, ch, policy = _swarm(peers=2), _gpt_like(), VerificationPolicy()
    config = dataclasses.replace(CONFIG, global_batch=32)
    problem = problem_for(ch, cluster, config, policy, 1)[0]
    solution = solver_api.solve(ch, cluster, config, policy, time_limit_s=2.0, workers=1)
    placement = Placement(stages=tuple(dataclasses.replace(st, in_flight=()) for st in solution.stages),
                          verifiers=solution.verifiers, num_microbatches=solution.num_microbatches)
    ms = price_program(problem, placement).step_ms
    assert ms == pytest.approx(solution.predicted_step_ms)
    assert any(v.senders for v in placement.verifiers), placement.verifiers
    unsplit = _unsplit(problem, placement)
    assert unsplit and all(ms < 0.95 * price_program(problem, u).step_ms for u in unsplit)
    assert ms < 0.95 * _best_by_hand(problem, placement.stages)[0]  # every whole-boundary placement of its stages
    priced, plan = _compiled(problem, placement, ch, cluster, config, policy)
    assert priced.step_ms == pytest.approx(simulate(plan).step_ms, rel=0.05)


def test_mixed_seeds_keep_a_trusted_device_for_the_last_stage():
    problem = problem_for(_gpt_like(), _swarm(), CONFIG, VerificationPolicy(), 1)[0]
    T, U = (next(c.index for c in problem.classes if c.trusted is t) for t in (True, False))
    assert mixed.mixed_groups(problem, (T, U), 5, 1, 5) == (Group(cls=T, replicas=1), *[Group(cls=U, replicas=1)] * 3,
                                                           Group(cls=T, replicas=1))
    assert mixed.mixed_groups(problem, (T, U), 1, 2, 3) == (Group(cls=T, replicas=1), Group(cls=U, replicas=2),
                                                           Group(cls=T, replicas=1))
    free = dataclasses.replace(problem, policy=VerificationPolicy(trusted_endpoints=False))
    assert mixed.mixed_groups(free, (T, U), 3, 1, 3) == (Group(cls=T, replicas=1),) * 2 + (Group(cls=U, replicas=1),)


def _unsplit(problem, placement: Placement) -> list[Placement]:
    """Each split boundary of ``placement`` checked by one verifier again, on each of its sites (valid ones)."""
    out = []
    for b in sorted({v.boundary for v in placement.verifiers}):
        group = [v for v in placement.verifiers if v.boundary == b]
        if len(group) < 2:
            continue
        directions = tuple(d for d in ("act", "grad") if any(d in v.directions for v in group))
        for site in dict.fromkeys(v.device for v in group):
            one = VerifierPlacement(boundary=b, device=site, directions=directions, watch_only=group[0].watch_only)
            rest = tuple(v for v in placement.verifiers if v.boundary != b)
            cand = dataclasses.replace(placement, verifiers=tuple(sorted(rest + (one,), key=lambda v: v.boundary)))
            if not violations(problem, cand):
                out.append(cand)
    return out


def test_verifiers_placed_on_programs_never_price_slower_nor_above_their_unsplit_versions():
    """Random SENTINEL-like pools in small (untrusted replicated middles, the trusted ends' devices the only verifier
    sites), each with the greedy's verifiers: the placement moved and split on the programs' price is valid, never
    dearer than the greedy's, than any of its split boundaries checked by one verifier, or than the split alone
    (``split_shared``, where that pays: moving a whole boundary usually pays more, 18 of 18 seeds), loses a link
    test only where it pays the policy's share, and its price is its simulation within 5%."""
    moved = splits_paid = 0
    for seed in range(120):
        drawn = replicated_untrusted_placement(seed, max_stages=4)
        if drawn is None:
            continue
        problem, placement, *rest = drawn
        got, ms = place_on_programs(problem, placement)
        before = price_program(problem, placement).step_ms
        assert violations(problem, got) == ()
        assert ms == pytest.approx(price_program(problem, got).step_ms)
        assert ms <= before * (1 + 1e-9)
        if len(lost_link_tests(problem, got)) > len(lost_link_tests(problem, placement)):
            assert ms * (1 + problem.policy.link_test_cost) < before
        for other in _unsplit(problem, got):
            assert ms <= price_program(problem, other).step_ms * (1 + 1e-9), seed
        split = split_shared(problem, placement)
        if split is not placement:
            splits_paid += 1
            assert ms <= price_program(problem, split).step_ms * (1 + 1e-9), seed
        if got is placement:
            continue
        moved += 1
        priced, plan = _compiled(problem, got, *rest)
        assert priced.step_ms == pytest.approx(simulate(plan).step_ms, rel=0.05), seed
    assert moved >= 20 and splits_paid >= 10, (moved, splits_paid)


@pytest.mark.parametrize("seed", [1, 4, 7, 11])
def test_the_hill_climb_never_ends_above_its_start_nor_its_unsplit_versions(seed):
    """The search's hill-climb on the programs' cost (``polish``), from random untrusted plans: its plan never prices
    above where it started, nor above itself with a split boundary merged back onto one verifier."""
    drawn = replicated_untrusted_placement(seed, max_stages=5)
    assert drawn is not None
    problem, placement, *rest = drawn
    got, ms = polish(problem, placement, time_budget_s=5.0, within=Work(5.0, what="test"))
    assert violations(problem, got) == ()
    assert ms <= price_program(problem, placement).step_ms * (1 + 1e-9)
    for other in _unsplit(problem, got):
        assert ms <= price_program(problem, other).step_ms * (1 + 1e-9)
    priced, plan = _compiled(problem, got, *rest)
    assert priced.step_ms == pytest.approx(simulate(plan).step_ms, rel=0.05)
