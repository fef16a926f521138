"""A re-plan keeps its model's fingerprint paired with the batch it was traced at: a plan traced at one
sample and run at 1, 4 or 16 per microbatch is re-planned into one that `run` (its model check) and
`load_plan(model=module)` accept. Before, the re-plan said batch 16 beside batch 1's fingerprint."""
from __future__ import annotations

import pytest

from cost_models.cluster_file import parse_cluster
from models.registry import build_model
from planner.api import plan_chain
from planner.replan import replan
from planner.plan_load import load_plan
from planner.runtime.rank.rank_setup import check_model
from planner.solver.policy import VerificationPolicy
from tests.dist.plans import chain_for

CLUSTER = parse_cluster({"name": "three", "links": {"default": {"bandwidth_gbps": 10, "latency_ms": 0.1}},
                         "hosts": [{"name": f"h{i}", "region": "lab", "trust": "operator", "trusted": True,
                                    "devices": [{"type": "CPU", "count": 1}]} for i in range(3)]})


@pytest.mark.parametrize("microbatch", [1, 4, 16])
def test_a_replan_of_a_plan_traced_at_one_sample_passes_the_model_check(microbatch, tmp_path):
    chain = chain_for("mlp-tiny", batch=1, seq=None)  # as `stagewise plan` traces: one sample
    plan = plan_chain(chain, CLUSTER, spec="mlp-tiny", global_batch=2 * microbatch, microbatch_size=microbatch,
                      policy=VerificationPolicy(enabled=False), time_limit_s=1, workers=1, stages=2)
    new = replan(plan, exclude_hosts=[plan.ranks[-1].host], reason="lost", time_limit_s=1, workers=1)
    assert new.config.microbatch_size == microbatch and new.model == plan.model and new.model.batch == 1
    check_model(new)  # what `stagewise run` does before any rank starts: export at model.batch, compare
    path = new.save(tmp_path / "new.json", sign=False)
    module = build_model("mlp-tiny", batch=1, device="meta").module
    assert load_plan(path, model=module).model == plan.model
    again = replan(new, readmit_hosts=[plan.ranks[-1].host], reason="back", time_limit_s=1, workers=1)
    assert again.model == plan.model  # a re-plan of a re-plan too
