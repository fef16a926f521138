"""Mixed replication (``search.mixed``, issue 36): on small multi-region pools drawn with a seed, plans of single-device
stages then replicated ones, priced as programs, that the hill-climb on the programs' cost (``polish``) does not reach
from the search's uniform plan; deterministic, and never dearer than the plan it starts from."""
from __future__ import annotations

import numpy as np
import pytest

from cost_models.cluster_file import parse_cluster
from cost_models.training import TrainingConfig
from planner.solver.api import problem_for
from planner.solver.objective import price_program, violations
from planner.solver.policy import VerificationPolicy
from planner.solver.search import budget, mixed
from planner.solver.search.chain_dp import Group
from planner.solver.search.polish import polish
from planner.solver.search.seq_partition import sequence_placement
from tests.unit.solver_fixtures import random_chain

BUDGET_S = 0.3  # nominal seconds of work for each search


@pytest.fixture(autouse=True)
def no_ceiling(monkeypatch):
    """The wall-clock ceiling out of the way (a loaded machine reaches it): the work budget alone ends the search."""
    monkeypatch.setattr(budget, "CEILING_FACTOR", 50.0)


def _problem(seed: int):
    """One V100 a host in 4 regions of 4, 2 Gb/s within a region and 0.3-1.2 Gb/s, 10-150 ms between regions."""
    rng = np.random.default_rng(seed)
    regions = 4
    hosts = [{"name": f"g{i}", "region": f"r{i // 4}", "trust": "op", "trusted": True,
              "devices": [{"type": "V100-16GB", "count": 1}]} for i in range(4 * regions)]
    pairs = [{"between": [f"r{a}", f"r{b}"], "bandwidth_gbps": float(rng.uniform(0.3, 1.2)),
              "latency_ms": float(rng.uniform(10, 150))} for a in range(regions) for b in range(a, regions) if a != b]
    pairs += [{"between": [f"r{a}", f"r{a}"], "bandwidth_gbps": 2.0, "latency_ms": 5.0} for a in range(regions)]
    cluster = parse_cluster({"name": "regions", "hosts": hosts, "links": {
        "default": {"bandwidth_gbps": 1.0, "latency_ms": 50.0}, "regions": pairs}})
    chain = random_chain(rng, int(rng.integers(10, 16)), param_scale=4e7, act_scale=5e7, flop_scale=2e11,
                         out_scale=4e6)
    config = TrainingConfig(global_batch=32, microbatch_size=1)
    return problem_for(chain, cluster, config, VerificationPolicy(enabled=False), 1)[0]


def _uniform(problem):
    """The search's kind of plan: every stage on 2 replicas, the classes in their order."""
    classes = [c.index for c in problem.classes if c.stage_capable]
    groups = tuple(Group(cls=c, replicas=2) for c in classes for _ in range(2))
    placement = sequence_placement(problem, groups, exact=True)[0]
    return placement, price_program(problem, placement).step_ms


# Of seeds 0-7 (drain pricing, daca44b), mixed replication prices 9-28% under polish's plan on 0, 2, 3, 4, 6, 7;
# 0.8% on 1; none on 5.
@pytest.mark.parametrize("seed", [0, 3, 6])
def test_mixed_replication_reaches_a_cheaper_plan_than_polish(seed):
    problem = _problem(seed)
    start, start_ms = _uniform(problem)
    _, polished_ms = polish(problem, start, time_budget_s=BUDGET_S)
    got = mixed.search(problem, start, start_ms, time_budget_s=BUDGET_S)
    assert got is not None
    plan, ms = got
    assert not violations(problem, plan)
    assert ms == pytest.approx(price_program(problem, plan).step_ms)
    assert ms < polished_ms * 0.95, (ms, polished_ms, start_ms)
    assert {len(st.devices) for st in plan.stages} != {2}  # not the uniform shape the search starts from


def test_mixed_search_is_deterministic_and_never_dearer():
    problem = _problem(3)
    start, start_ms = _uniform(problem)
    first = mixed.search(problem, start, start_ms, time_budget_s=BUDGET_S)
    again = mixed.search(problem, start, start_ms, time_budget_s=BUDGET_S)
    assert first == again
    assert first is None or first[1] < start_ms
    assert mixed.search(problem, start, 0.5 * (first or (start, start_ms))[1], time_budget_s=BUDGET_S) is None


def test_mixed_groups_take_classes_in_order():
    problem = _problem(0)
    order = tuple(reversed([c.index for c in problem.classes if c.stage_capable]))
    groups = mixed.mixed_groups(problem, order, 3, 2, 5)
    assert groups is not None
    assert [g.replicas for g in groups] == [1, 1, 1, 2, 2]
    assert [g.cls for g in groups] == [order[0]] * 3 + [order[1]] * 2  # 1 device left of the first: too few for 2
    assert mixed.mixed_groups(problem, order, 0, 4, 5) is None  # 16 devices: 4 stages of 4 at most
    moves = mixed.group_moves(problem, groups)
    assert tuple(Group(cls=g.cls, replicas=1) for g in groups) in moves  # the whole prefix unreplicated
    assert groups[:3] + (Group(cls=order[1], replicas=1),) * 2 + groups[4:] in moves  # a stage of 2 split in two
