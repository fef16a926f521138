"""Re-planning works whatever a microbatch holds: plans traced at one sample (as `stagewise plan` traces)
that run 1, 4 or 16 samples per microbatch are re-planned and run (gloo, one process per rank, one thread
each), and each run ends with the weights of a by-hand single-process reference.

* `replan` then `run`: the re-plan without a host runs from the start, as the reference does.
* `run --replan-on-failure`: a rank dies at step 3 of 4, checkpoints every 2 steps; the run re-plans
  without its host, resumes after step 1, trains step 2 again, and its summary says so leg by leg.
"""
from __future__ import annotations

import json

import pytest
import torch

from cost_models.cluster_file import parse_cluster
from planner.api import plan_chain
from planner.replan import replan
from planner.plan_load import load_plan
from planner.runtime.launcher.elastic import launch_replanning
from planner.runtime.launcher.launch import launch
from planner.runtime.options import FaultSpec, RunOptions
from planner.solver.policy import VerificationPolicy
from tests.dist.plans import chain_for, load_dumps, reference_run

torch.set_num_threads(1)
MICROBATCHES = [1, 4, 16]
STEPS, EVERY, DIES_AT = 4, 2, 3

CLUSTER = parse_cluster({"name": "three", "links": {"default": {"bandwidth_gbps": 10, "latency_ms": 0.1}},
                         "hosts": [{"name": f"h{i}", "region": "lab", "trust": "operator", "trusted": True,
                                    "devices": [{"type": "CPU", "count": 1}]} for i in range(3)]})


def _plan(microbatch: int):
    """A 3-stage mlp-tiny plan, one stage per host, traced at one sample and run at ``microbatch``."""
    plan = plan_chain(chain_for("mlp-tiny", batch=1, seq=None), CLUSTER, spec="mlp-tiny",
                      global_batch=2 * microbatch, microbatch_size=microbatch, optimizer="adam", dtype="fp32",
                      policy=VerificationPolicy(enabled=False), time_limit_s=1, workers=1, stages=3)
    assert (plan.model.batch, plan.config.microbatch_size) == (1, microbatch)
    assert sorted(r.host for r in plan.ranks) == ["h0", "h1", "h2"]
    return plan


def _assert_params(folder, num_ranks, want):
    got = {}
    for dump in load_dumps(folder, num_ranks):
        got.update(dump["params"])
    assert got.keys() == want.keys()
    for name, p in got.items():
        torch.testing.assert_close(p, want[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("microbatch", MICROBATCHES)
def test_a_replanned_plan_runs_and_matches_the_reference(microbatch, tmp_path):
    plan = _plan(microbatch)
    new = replan(plan, exclude_hosts=["h2"], reason="h2 lost", time_limit_s=1, workers=1)
    assert new.config.microbatch_size == microbatch and "h2" not in {r.host for r in new.ranks}
    result = launch(RunOptions(plan=str(new.save(tmp_path / "new.json")), steps=2, timeout_s=60,
                               dump=str(tmp_path / "dump")))
    assert result["steps"] == 2
    _assert_params(tmp_path / "dump", new.num_ranks, reference_run(new, steps=2)[2])


@pytest.mark.parametrize("microbatch", MICROBATCHES)
def test_a_run_replans_itself_and_its_summary_covers_every_leg(microbatch, tmp_path):
    plan = _plan(microbatch)
    doomed = next(r.rank for r in plan.ranks if r.host == "h2")
    report = tmp_path / "report.json"
    result = launch_replanning(RunOptions(plan=str(plan.save(tmp_path / "plan.json")), steps=STEPS, timeout_s=30,
                                          checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=EVERY,
                                          fault=FaultSpec(rank=doomed, kind="die", step=DIES_AT),
                                          dump=str(tmp_path / "dump"), report=str(report)),
                               max_replans=1, time_limit_s=1)
    (replanned,) = result["replans"]
    assert replanned["excluded"] == "h2" and replanned["resumed_after_step"] == EVERY - 1
    assert replanned["redone_steps"] == DIES_AT - EVERY  # step 2: completed, not checkpointed, trained again
    first, second = result["legs"]
    assert (first["ended"], first["first_step"], first["last_step"], first["steps"], first["redone_steps"]) == \
        ("failure", 0, DIES_AT - 1, DIES_AT, DIES_AT - EVERY)
    assert (second["ended"], second["resumed_after_step"], second["first_step"], second["last_step"],
            second["steps"], second["redone_steps"]) == ("finished", EVERY - 1, EVERY, STEPS - 1, STEPS - EVERY, 0)
    assert (first["ranks"], second["plan"], second["ranks"]) == (3, replanned["plan"], replanned["ranks"])
    assert (result["steps_run"], result["steps_redone"]) == (DIES_AT + STEPS - EVERY, DIES_AT - EVERY)
    written = json.loads(report.read_text())
    assert written["legs"] == result["legs"] and written["replans"] == result["replans"]
    assert written["steps_run"] == result["steps_run"] and "failed" not in written
    # Resumed from a checkpoint of the same state: the end of a run that never failed.
    _assert_params(tmp_path / "dump", replanned["ranks"], reference_run(load_plan(replanned["plan"]), steps=STEPS)[2])
