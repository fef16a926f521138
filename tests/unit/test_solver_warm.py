"""Warm start: an old plan's stages repaired to the devices left (replicas dropped, an orphaned stage on a free
device or merged into its neighbour), valid, and never lost by the search that starts from it."""
from __future__ import annotations

import pytest
from plan_fixtures import SLOW_DEVICE, TEST_DEVICE, block, chain, cluster, config

from planner.solver.api import problem_for, solve
from planner.solver.objective import price_program, violations
from planner.solver.policy import VerificationPolicy
from planner.solver.warm import WarmStage, WarmStart, warm_placements

OFF = VerificationPolicy(enabled=False)
OLD = WarmStart(stages=(WarmStage(first_block=0, last_block=1, devices=("h0/0",), shares=(4,)),
                        WarmStage(first_block=2, last_block=3, devices=("h1/0", "h2/0"), shares=(3, 1)),
                        WarmStage(first_block=4, last_block=5, devices=("h3/0",), shares=(4,))))
CHAIN = chain([block(i) for i in range(6)])


def _problem(hosts: tuple[str, ...], *, slow: tuple[str, ...] = (), num_microbatches: int = 4):
    cl = cluster([(h, SLOW_DEVICE if h in slow else TEST_DEVICE, 1) for h in hosts])
    return problem_for(CHAIN, cl, config(num_microbatches), OFF, 2)[0]


def _shape(placement):
    return [((s.first_block, s.last_block), s.devices, s.microbatches) for s in placement.stages]


def _repaired(problem):
    found = warm_placements(problem, OLD)
    assert found and found[0][2] == "warm-start"
    for placement, step_ms, _ in found:
        assert not violations(problem, placement) and step_ms > 0
    return found[0][0]


def test_a_lost_replica_leaves_its_group_and_the_rest_take_its_microbatches():
    placement = _repaired(_problem(("h0", "h1", "h3")))
    assert _shape(placement) == [((0, 1), ("h0/0",), (4,)), ((2, 3), ("h1/0",), (4,)), ((4, 5), ("h3/0",), (4,))]


def test_an_orphaned_stage_takes_the_fastest_free_device():
    placement = _repaired(_problem(("h0", "h1", "h2", "slow", "spare"), slow=("slow",)))
    assert _shape(placement)[2] == ((4, 5), ("spare/0",), (4,))
    assert _shape(placement)[1] == ((2, 3), ("h1/0", "h2/0"), (3, 1))  # untouched: the old shares


def test_an_orphaned_replicated_stage_takes_as_many_free_devices_of_one_class():
    cl = cluster([("h0", TEST_DEVICE, 1), ("h3", TEST_DEVICE, 1), ("slow", SLOW_DEVICE, 1), ("pair", TEST_DEVICE, 2)])
    placement = _repaired(problem_for(CHAIN, cl, config(4), OFF, 2)[0])
    assert _shape(placement)[1] == ((2, 3), ("pair/0", "pair/1"), (2, 2))  # new devices: the mean share each


def test_a_stage_that_lost_replicas_is_also_topped_up_from_free_devices():
    problem = _problem(("h0", "h1", "h3", "spare"))
    found = warm_placements(problem, OLD)
    assert [how for _, _, how in found][:2] == ["warm-start", "warm-start, topped up"]
    assert _shape(found[0][0])[1] == ((2, 3), ("h1/0",), (4,))
    assert _shape(found[1][0])[1] == ((2, 3), ("h1/0", "spare/0"), (2, 2))  # old share 3, the mean 2 for spare


def test_an_orphaned_stage_without_a_free_device_joins_its_neighbour():
    assert _shape(_repaired(_problem(("h0", "h1", "h2")))) == [((0, 1), ("h0/0",), (4,)),
                                                             ((2, 5), ("h1/0", "h2/0"), (3, 1))]
    assert _shape(_repaired(_problem(("h1", "h2", "h3"))))[0] == ((0, 3), ("h1/0", "h2/0"), (3, 1))


def test_shares_follow_the_old_split_at_another_microbatch_count():
    placement = _repaired(_problem(("h0", "h1", "h2", "h3"), num_microbatches=8))
    assert [s.microbatches for s in placement.stages] == [(8,), (6, 2), (8,)]


def test_the_cuts_are_also_chosen_again_for_the_repaired_devices():
    old = WarmStart(stages=tuple(WarmStage(first_block=2 * k, last_block=2 * k + 1, devices=(f"h{k}/0",),
                                           shares=(4,)) for k in range(3)))
    problem = _problem(("h0", "h1"))  # h2 gone: h1 holds 4 blocks, h0 2, until the cuts move
    found = warm_placements(problem, old)
    assert [how for _, _, how in found] == ["warm-start", "warm-start, re-partitioned"]
    assert [(s.first_block, s.last_block) for s in found[0][0].stages] == [(0, 1), (2, 5)]
    assert [(s.first_block, s.last_block) for s in found[1][0].stages] == [(0, 2), (3, 5)]
    assert found[1][1] < found[0][1]


@pytest.mark.parametrize("warm", [WarmStart(stages=()),
                                  WarmStart(stages=(WarmStage(first_block=0, last_block=2, devices=("h0/0",),
                                                              shares=(4,)),))])
def test_nothing_to_start_from_for_another_chain(warm):
    assert warm_placements(_problem(("h0", "h1")), warm) == []


def test_every_old_device_lost_collapses_onto_the_free_one():
    assert _shape(_repaired(_problem(("other",)))) == [((0, 5), ("other/0",), (4,))]


def test_the_search_keeps_a_plan_at_least_as_cheap_as_its_warm_start():
    cl = cluster([(h, TEST_DEVICE, 1) for h in ("h0", "h1", "h3")])
    problem = problem_for(CHAIN, cl, config(4), OFF, 2)[0]
    warm_ms = min(price_program(problem, p).step_ms for p, _, _ in warm_placements(problem, OLD))
    sol = solve(CHAIN, cl, config(4), OFF, time_limit_s=1.0, workers=1, warm_start=OLD)
    assert sol.report.objective_ms <= warm_ms * (1 + 1e-9)
