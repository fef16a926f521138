"""An elastic start's agreement on the plan (in-memory store, no processes): the plan stands while its hosts
are there, a re-plan without a lost host is signed and written, strangers and missing folders are refused,
and a host's processes beyond the plan's ranks on it are told to go."""
from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from cost_models.cluster_file import parse_cluster
from planner.api import plan_chain
from planner.errors import InvalidInputError
from planner.model_io import load_chain
from planner.plan_load import load_plan
from planner.runtime.launcher import torchrun_elastic
from planner.runtime.launcher.hosts import place
from planner.runtime.options import RunOptions
from planner.runtime.recovery import joins
from planner.secret import run_secret
from planner.solver.policy import VerificationPolicy


@pytest.fixture(scope="module")
def plan():
    _, chain = load_chain("mlp-tiny", batch=2)
    host = lambda name: {"name": name, "region": "lab", "trust": "operator", "trusted": True,  # noqa: E731
                         "devices": [{"type": "CPU", "count": 1}]}
    cluster = parse_cluster({"name": "two", "hosts": [host("h0"), host("h1")],
                             "links": {"default": {"bandwidth_gbps": 10, "latency_ms": 0.1}}})
    return plan_chain(chain, cluster, spec="mlp-tiny", global_batch=4, microbatch_size=2,
                      policy=VerificationPolicy(enabled=False), time_limit_s=1, workers=1, dtype="fp32", stages=2)


def _agree(opts: RunOptions, present: dict[str, int], host: str = "h0"):
    """What torchrun's rank 0 of a start with ``present`` (host -> processes) agrees on."""
    store = dist.HashStore()
    for r, (name, slots) in enumerate(present.items()):
        store.set(f"{torchrun_elastic.PREFIX}/7/host/{r}", json.dumps({"host": name, "slots": slots}))
    return torchrun_elastic.agree(opts, launcher_rank=0, world_size=len(present), key=run_secret(None),
                                  store=store, start="7")


def _opts(tmp_path, plan, host: str = "h0") -> RunOptions:
    return RunOptions(plan=str(plan.save(tmp_path / "plan.json")), elastic=True, host=host,
                      checkpoint_dir=str(tmp_path / "ckpt"), replan_time_limit_s=1, timeout_s=5)


def test_the_plan_stands_while_its_hosts_are_there(tmp_path, plan):
    assert [r.host for r in plan.ranks] == ["h0", "h1"]
    opts = _opts(tmp_path, plan)
    start = _agree(opts, {"h0": 1, "h1": 2})
    assert start.plan == opts.plan and not start.resume
    assert not list((tmp_path / "ckpt").glob("plan-elastic-*"))


def test_a_lost_host_is_planned_out_signed_and_written(tmp_path, plan):
    (tmp_path / "ckpt").mkdir()
    start = _agree(_opts(tmp_path, plan), {"h0": 1})
    assert start.plan == str(tmp_path / "ckpt" / "plan-elastic-7.json")
    new = load_plan(start.plan)
    assert {r.host for r in new.ranks} == {"h0"} and new.excluded_hosts == ("h1",)
    assert new.history[-1].event == "failure" and "h1 gone or short of processes" in new.history[-1].reason
    # the next start takes the newest written plan; h1 back: re-admitted
    back = _agree(_opts(tmp_path, plan), {"h0": 1, "h1": 1})
    assert load_plan(back.plan).excluded_hosts == () and load_plan(back.plan).history[-1].event == "readmit"


def test_strangers_and_missing_folders_are_refused(tmp_path, plan):
    with pytest.raises(InvalidInputError, match="host 'intruder'.*a stranger"):
        _agree(_opts(tmp_path, plan), {"h0": 1, "h1": 1, "intruder": 1})
    with pytest.raises(InvalidInputError, match="--elastic.*--checkpoint-dir"):
        RunOptions(plan="p.json", elastic=True)


def test_processes_beyond_a_host_s_ranks_are_told_to_go(plan):
    env = {"LOCAL_WORLD_SIZE": "3"}
    assert place(plan, host="h1", launcher_rank=0, local_rank=0, environ=env, elastic=True).rank == 1
    assert place(plan, host="h1", launcher_rank=1, local_rank=2, environ=env, elastic=True) is None
    with pytest.raises(InvalidInputError, match="--nproc-per-node 1"):
        place(plan, host="h1", launcher_rank=0, local_rank=0, environ=env)


def test_a_host_new_to_the_cluster_joins_with_a_signed_description(tmp_path, plan):
    opts = _opts(tmp_path, plan)
    desc = tmp_path / "h9.yaml"
    desc.write_text("name: h9\nregion: lab\ntrust: operator\ntrusted: true\ndevices: [{type: CPU, count: 1}]\n")
    folder = tmp_path / "ckpt" / joins.FOLDER
    folder.mkdir(parents=True)
    joins.write_request(folder, joins.make_request(plan, description=desc), run_secret(None))
    start = _agree(opts, {"h0": 1, "h1": 1, "h9": 1})
    new = load_plan(start.plan)
    assert "h9" in {h["name"] for h in new.cluster["hosts"]}
    assert new.history[-1].event == "join" and "h9 joined" in new.history[-1].reason
