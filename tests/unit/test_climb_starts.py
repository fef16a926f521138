"""The hill-climb from several starts (``count_solve._climbed``): a search that meets one plan more never returns a
dearer one because that plan, a local optimum, took the single climb (issue 36, pools.py SENTINEL 200 Mb/s: the
trusted hosts alone planned 2,243 ms at 0.5 s of work and 3,139 ms at 0.86-2 s)."""
from __future__ import annotations

import pytest

from cost_models.cluster_file import parse_cluster
from cost_models.precision import resolve_dtype
from cost_models.training import TrainingConfig
from planner.model_io import load_chain
from planner.solver import api as solver_api
from planner.solver.count_solve import _climbed
from planner.solver.objective import Placement, even_split, price_program
from planner.solver.policy import VerificationPolicy
from planner.solver.search.budget import Work
from planner.solver.search.polish import polish
from planner.solver.solution import StagePlacement


def _trusted_pool():
    hosts = [{"name": f"dc{i}", "region": "dc", "trust": "operator", "trusted": True,
              "devices": [{"type": "A100-80GB", "count": 4}]} for i in range(4)]
    return parse_cluster({"name": "slow-dc", "hosts": hosts,
                          "links": {"intra_host": {"bandwidth_gbps": 100, "latency_ms": 0.01},
                                    "default": {"bandwidth_gbps": 0.2, "latency_ms": 5}}})


@pytest.fixture(scope="module")
def problem_setup():
    _, chain = load_chain("gpt-1.3b", batch=1, seq=1024)
    cluster = _trusted_pool()
    dtype = resolve_dtype("auto", cluster)
    config = TrainingConfig(global_batch=64, microbatch_size=1, dtype=dtype, mixed_precision=dtype != "float32")
    return chain, cluster, config


def _placement(problem, groups):
    """Equal block runs, one per device group, every microbatch split evenly over a group."""
    L, n, M = problem.num_blocks, len(groups), problem.num_microbatches
    stages = tuple(StagePlacement(index=k, first_block=k * (L // n), last_block=L - 1 if k == n - 1 else
                                  (k + 1) * (L // n) - 1, devices=tuple(g), microbatches=even_split(M, len(g)))
                   for k, g in enumerate(groups))
    return Placement(stages=stages, verifiers=(), num_microbatches=M)


def test_a_start_stuck_at_a_local_optimum_does_not_hide_the_next(problem_setup):
    chain, cluster, config = problem_setup
    problem = solver_api.problem_for(chain, cluster, config, VerificationPolicy(), 1)[0]
    ids = [d.id for d in cluster.devices]
    stuck, _ = polish(problem, _placement(problem, [ids[0:2], ids[2:4]]), time_budget_s=2.0)  # one host, 2 x 2
    spread = _placement(problem, [ids[0:4], ids[4:8]])  # two hosts, 4 x 4: dearer than ``stuck`` as it stands
    assert price_program(problem, spread).step_ms > price_program(problem, stuck).step_ms
    plan, ms = _climbed(problem, [stuck, spread], 2.0, False, Work(2.0))
    assert ms == pytest.approx(price_program(problem, plan).step_ms)
    assert ms < 0.8 * price_program(problem, stuck).step_ms, [len(st.devices) for st in plan.stages]


@pytest.mark.parametrize("budget_s", [0.857])
def test_more_work_never_climbs_to_a_dearer_plan(problem_setup, budget_s):
    chain, cluster, config = problem_setup
    sol = solver_api.solve(chain, cluster, config, VerificationPolicy(), workers=2, time_limit_s=budget_s)
    # 2 stages on one host's 4 devices and 3 of another's: the 0.5 s search's plan (one slow all-reduce fewer)
    assert sol.predicted_step_ms < 2300.0, (budget_s, sol.predicted_step_ms, [len(s.devices) for s in sol.stages])
