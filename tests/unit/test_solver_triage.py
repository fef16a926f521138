"""Microbatch counts that totals rule out are set aside before the solve's time is shared."""
from __future__ import annotations

import numpy as np

from cost_models.training import TrainingConfig
from planner.solver import api
from planner.solver.policy import VerificationPolicy
from tests.unit.program_fixtures import wide_area_cluster
from tests.unit.solver_fixtures import random_chain


def _case():
    rng = np.random.default_rng(5)
    cluster = wide_area_cluster(rng, 6)
    # Activations that no device holds for a microbatch of 16, but do for 1 (the chain is per sample).
    mem = max(d.spec.mem_bytes for d in cluster.stage_devices)
    chain = random_chain(rng, 8, param_scale=1e6, act_scale=mem / 16, out_scale=1e5)
    return chain, cluster, TrainingConfig(global_batch=16, microbatch_size=1)


def test_counts_ruled_out_by_totals_never_get_a_share():
    chain, cluster, config = _case()
    problems = [api.problem_for(chain, cluster, config, VerificationPolicy(enabled=False), mb)[0] for mb in (1, 16)]
    outcomes, errors = [], []
    kept = api._triaged(problems, False, outcomes, errors)
    assert [p.num_microbatches for p in kept] == [16]  # size 1 kept; size 16's activations fit nowhere
    assert [o.method for o in outcomes] == ["precheck"] and len(errors) == 1


def test_recomputation_is_triaged_in_turn_under_auto():
    chain, cluster, config = _case()
    big = api.problem_for(chain, cluster, config, VerificationPolicy(enabled=False), 16)[0]
    outcomes, errors = [], []
    kept = api._triaged([big], True, outcomes, errors)
    assert outcomes[0].problem is big and not big.recompute
    assert all(p.recompute for p in kept) and len(outcomes) + len(kept) == 2  # its twin kept or ruled out too


def test_a_solve_with_ruled_out_sizes_returns_the_feasible_plan_and_says_so():
    chain, cluster, config = _case()
    sol = api.solve(chain, cluster, config, VerificationPolicy(enabled=False), time_limit_s=2.0,
                    microbatch_sizes=(1, 16), recompute_mode="never")
    assert sol.num_microbatches == 16  # microbatches of size 1
    assert any("M=1:" in n and "no plan" in n for n in sol.report.notes)
