"""The fill bound's term for a stage's all-reduce and optimizer step after its own passes (``bound.fill``:
``step >= arrival + m t + AR_k + optim_k``) stays below every plan: on pools of a fast and a slow kind whose
links make the all-reduces cost (all trusted or trusted ends), random plans and plans hill-climbed on the
programs' cost, priced and simulated from their compiled programs; and it binds there (the bound without it is
lower)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cost_models.cluster_file import parse_cluster
from cost_models.training import TrainingConfig
from planner.simulate import simulate
from planner.solver.bound import fill, fill_dp
from planner.solver.objective import violations
from planner.solver.policy import VerificationPolicy
from planner.solver.problem_build import build_problem, scale_chain
from planner.solver.search.polish import polish
from tests.unit.program_fixtures import _compiled, random_placement
from tests.unit.solver_fixtures import random_chain

HAIR = 1 + 1e-9


def _pool(rng: np.random.Generator, *, ends: bool):
    """Hosts of a fast and a slow GPU type (1-4 a host, 3-5 hosts) on 2-10 Gb/s, a chain whose head holds many parameters,
    8-32 microbatches: its replicated stages' all-reduces cost about as much as their passes."""
    fast, slow = ("A100-40GB", "V100-16GB") if rng.random() < 0.5 else ("A100-80GB", "T4")
    hosts = []
    for i in range(int(rng.integers(3, 6))):
        trusted = not ends or i < 2 or rng.random() < 0.5
        hosts.append({"name": f"h{i}", "region": f"z{i % 2}", "trust": "op" if trusted else f"v{i}",
                      "trusted": bool(trusted),
                      "devices": [{"type": fast if i % 2 == 0 else slow, "count": int(rng.integers(1, 5))}],
                      "intra_host": {"bandwidth_gbps": float(rng.choice([10, 100])), "latency_ms": 0.01}})
    if ends:
        hosts.append({"name": "verifier", "region": "z0", "trust": "op", "trusted": True, "role": "verifier",
                      "devices": [{"type": "CPU", "count": 1}]})
    links = {"intra_host": {"bandwidth_gbps": 10, "latency_ms": 0.01},
             "default": {"bandwidth_gbps": float(rng.choice([2, 10])), "latency_ms": 1.0}}
    cluster = parse_cluster({"name": "after-passes", "hosts": hosts, "links": links})
    chain = random_chain(rng, int(rng.integers(4, 7)), param_scale=float(rng.choice([5e7, 1e8])), flop_scale=float(rng.choice([5e11, 3e12])),
                         act_scale=2e7, out_scale=1e6, uniform=True)
    head = chain.blocks[-1]
    blocks = chain.blocks[:-1] + (dataclasses.replace(head, param_count=3 * head.param_count,
                                                      param_bytes=3 * head.param_bytes),)
    chain = dataclasses.replace(chain, blocks=blocks)
    config = TrainingConfig(global_batch=int(rng.choice([8, 16, 32])), microbatch_size=1,
                            schedule="gpipe" if rng.random() < 0.25 else "1f1b")
    policy = VerificationPolicy() if ends else VerificationPolicy(enabled=False)
    return build_problem(scale_chain(chain, 1), cluster, config, policy), chain, cluster, config, policy


@pytest.mark.parametrize("ends", [False, True])
def test_below_random_and_climbed_plans_priced_and_simulated(ends, monkeypatch):
    simulated, raised = 0, 0
    for seed in range(4):
        rng = np.random.default_rng(2600 + seed + (40 if ends else 0))
        problem, chain, cluster, config, policy = _pool(rng, ends=ends)
        bound = fill.fill_bound_ms(problem)
        with monkeypatch.context() as m:
            m.setattr(fill_dp, "ROUNDS", 0)  # the bound without the term
            raised += bound > fill.fill_bound_ms(problem) * (1 + 1e-4)
        for _ in range(6):
            placement = random_placement(rng, problem, cluster)
            if placement is None or violations(problem, placement):
                continue
            climbed, _ = polish(problem, placement, time_budget_s=0.05)
            for plan in (placement, climbed):
                priced, compiled = _compiled(problem, plan, chain, cluster, config, policy)
                assert bound <= priced.step_ms * HAIR, plan
                assert bound <= simulate(compiled).step_ms * HAIR, plan
                simulated += 1
    assert simulated >= 8 and raised >= 2, (simulated, raised)


def test_the_plans_work_budget_pays_for_the_fill_bound_and_a_budget_short_of_a_test_skips_it():
    """The bound runs inside ``plan``'s time: each feasibility test charged (``budget.fill_units``); a budget that
    cannot pay a whole test's bisection skips it (the floor it was given: weaker, still valid)."""
    from planner.solver.search.budget import UNITS_PER_S, Work, fill_units

    problem = _pool(np.random.default_rng(2600), ends=False)[0]
    full = fill.fill_bound_ms(problem)
    assert full > 0.0
    rich = Work(1e3, what="plan")
    assert fill.fill_bound_ms(problem, within=rich) == full
    each = fill_units(problem.num_blocks, sum(c.count for c in problem.classes if c.stage_capable))
    tests = rich.spent / each   # whole tests, each at its price
    assert tests >= 1 and abs(tests - round(tests)) < 1e-6
    poor = Work((fill.TESTS_EACH * each - 1) / UNITS_PER_S, what="plan")
    assert fill.fill_bound_ms(problem, 7.0, within=poor) == 7.0 and poor.spent == 0
