"""Re-planning around a lost host: the run checkpoints, a host goes, `replan` solves again without it,
and the resumed run on the new plan ends with the weights of a run that never lost anything (gloo, one
process per rank, one thread each)."""
from __future__ import annotations

import pytest
import torch

from cost_models.cluster_file import parse_cluster
from cost_models.devices import CATALOG
from planner.api import plan_chain
from planner.replan import replan
from planner.errors import InfeasiblePlanError, InvalidInputError
from planner.model_io import load_chain
from planner.plan_load import load_plan
from planner.runtime.launcher.elastic import launch_replanning
from planner.runtime.launcher.launch import launch
from planner.runtime.options import FaultSpec, RunOptions
from planner.solver.policy import VerificationPolicy
from tests.dist.plans import load_dumps

torch.set_num_threads(1)
STEPS = 4


def _cluster():
    host = lambda name: {"name": name, "region": "lab", "trust": "operator", "trusted": True,  # noqa: E731
                         "devices": [{"type": "CPU", "count": 1}]}
    return parse_cluster({"name": "three", "hosts": [host("h0"), host("h1"), host("h2")],
                          "links": {"default": {"bandwidth_gbps": 10, "latency_ms": 0.1}}})


@pytest.fixture(scope="module")
def straight(first_plan, tmp_path_factory):
    """The run that never loses a host: its weights after STEPS steps."""
    tmp = tmp_path_factory.mktemp("straight")
    launch(RunOptions(plan=str(first_plan.save(tmp / "first.json")), steps=STEPS, timeout_s=60,
                      dump=str(tmp / "dump")))
    return _params(tmp / "dump", first_plan.num_ranks)


@pytest.fixture(scope="module")
def first_plan():
    _, chain = load_chain("gpt-tiny", batch=2, seq=16)
    return plan_chain(chain, _cluster(), spec="gpt-tiny", seq=16, global_batch=4, microbatch_size=2,
                      policy=VerificationPolicy(enabled=False), time_limit_s=2, workers=1, dtype="fp32",
                      optimizer="adam", stages=3)


def _params(folder, num_ranks) -> dict[str, torch.Tensor]:
    out = {}
    for d in load_dumps(folder, num_ranks):
        out.update(d["params"])
    return out


def _assert_same(resumed, straight):
    assert set(resumed) == set(straight)
    for name, p in resumed.items():
        torch.testing.assert_close(p, straight[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_a_run_resumed_on_a_replan_ends_where_an_unbroken_one_does(first_plan, straight, tmp_path):
    assert {r.host for r in first_plan.ranks} == {"h0", "h1", "h2"}
    first = first_plan.save(tmp_path / "first.json")
    ckpt = tmp_path / "ckpt"
    launch(RunOptions(plan=str(first), steps=2, timeout_s=60, checkpoint_dir=str(ckpt), checkpoint_every=1))
    second = replan(first_plan, exclude_hosts=["h2"], reason="rank 2 died at step 2", time_limit_s=2, workers=1)
    assert "h2" not in {r.host for r in second.ranks}
    assert second.report.notes[0].startswith("replanned without h2: rank 2 died at step 2")
    assert (second.config.global_batch, second.config.optimizer, second.config.dtype) == (4, "adam", "float32")
    path = second.save(tmp_path / "second.json")
    result = launch(RunOptions(plan=str(path), steps=STEPS, timeout_s=60, checkpoint_dir=str(ckpt), resume=True,
                               dump=str(tmp_path / "resumed")))
    assert result["steps"] == STEPS - 2
    _assert_same(_params(tmp_path / "resumed", second.num_ranks), straight)


def test_a_run_replans_itself_when_a_host_dies(first_plan, straight, tmp_path):
    """--replan-on-failure: the rank on h2 dies at step 2; the launcher excludes h2, re-plans, resumes."""
    doomed = next(r.rank for r in first_plan.ranks if r.host == "h2")
    path = first_plan.save(tmp_path / "first.json")
    result = launch_replanning(RunOptions(plan=str(path), steps=STEPS, timeout_s=30, checkpoint_dir=str(tmp_path / "c"),
                                          checkpoint_every=1, fault=FaultSpec(rank=doomed, kind="die", step=2),
                                          dump=str(tmp_path / "dump")), max_replans=1, time_limit_s=2)
    (replanned,) = result["replans"]
    assert replanned["excluded"] == "h2" and replanned["resumed_after_step"] == 1
    assert f"rank {doomed} died" in replanned["after"]
    assert result["steps"] == STEPS - 2
    _assert_same(_params(tmp_path / "dump", replanned["ranks"]), straight)


def test_bad_exclusions_are_refused(first_plan):
    with pytest.raises(InvalidInputError, match="exclude host 'h9'"):
        replan(first_plan, exclude_hosts=["h9"], reason="x")
    with pytest.raises(InvalidInputError, match="at least one host"):
        replan(first_plan, reason="x")
    with pytest.raises(InfeasiblePlanError, match="every host"):
        replan(first_plan, exclude_domains=["operator"], reason="x")


def test_a_lost_verifier_is_placed_again_and_the_run_goes_on(tmp_path):
    """The verifier is no single point of failure: its rank dies at step 2, the launcher excludes its host,
    the re-plan puts the checks on the other verifier host, and the run ends with the weights of one that
    never lost it (honest ranks: verification leaves the weights alone)."""
    _, chain = load_chain("gpt-tiny", batch=2, seq=16)
    # Workers hold 60% of the model's training state (16 B/param): no two hold it with their activations (at 70%
    # the two trusted ones did, and the re-plan dropped the checks), so every plan spans all three hosts and the
    # untrusted one's boundaries are checked: the re-plan must place those checks again.
    small = {**CATALOG["CPU"].to_dict(), "mem_bytes": int(0.6 * 4 * chain.param_bytes)}
    host = lambda name, trusted=True, role="worker": {  # noqa: E731
        "name": name, "region": "lab", "trust": "operator" if trusted else f"vol-{name}", "trusted": trusted,
        "role": role, "devices": [{"type": "CPU", "count": 1, **({"spec": small} if role == "worker" else {})}]}
    cluster = parse_cluster({"name": "checked", "hosts": [host("h0"), host("h1", trusted=False), host("h2"),
                                                          host("v0", role="verifier"), host("v1", role="verifier")],
                             "links": {"default": {"bandwidth_gbps": 10, "latency_ms": 0.1}}})
    plan = plan_chain(chain, cluster, spec="gpt-tiny", seq=16, global_batch=4, microbatch_size=2,
                      policy=VerificationPolicy(verifier_placement="cpu"), time_limit_s=2, workers=1, dtype="fp32",
                      optimizer="adam", stages=3)
    trusted = parse_cluster({"name": "trusted", "hosts": [host("h0"), host("h2"), host("v1", role="verifier")],
                             "links": {"default": {"bandwidth_gbps": 10, "latency_ms": 0.1}}})
    with pytest.raises(InfeasiblePlanError):   # the premise: no plan leaves the untrusted host (and its checks) out
        plan_chain(chain, trusted, spec="gpt-tiny", seq=16, global_batch=4, microbatch_size=2,
                   policy=VerificationPolicy(verifier_placement="cpu"), time_limit_s=2, workers=1, dtype="fp32",
                   optimizer="adam")
    checker = next(r for r in plan.ranks if r.stage is None)
    lost, spare = checker.host, ({"v0", "v1"} - {checker.host}).pop()
    first = plan.save(tmp_path / "first.json")
    launch(RunOptions(plan=str(first), steps=STEPS, timeout_s=60, dump=str(tmp_path / "straight")))
    result = launch_replanning(RunOptions(plan=str(first), steps=STEPS, timeout_s=30, checkpoint_dir=str(tmp_path / "c"),
                                          checkpoint_every=1, fault=FaultSpec(rank=checker.rank, kind="die", step=2),
                                          dump=str(tmp_path / "dump")), max_replans=1, time_limit_s=2)
    (replanned,) = result["replans"]
    assert replanned["excluded"] == lost
    second = load_plan(replanned["plan"])
    assert {r.host for r in second.ranks if r.stage is None} == {spare}
    assert {v.boundary for v in second.verifiers} == {v.boundary for v in plan.verifiers}
    _assert_same(_params(tmp_path / "dump", second.num_ranks), _params(tmp_path / "straight", plan.num_ranks))
