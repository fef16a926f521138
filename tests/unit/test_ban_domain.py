"""A ban's re-plan excludes the banned host, or its whole trust domain when the plan's policy says so."""
from __future__ import annotations

import pytest

from cost_models.cluster_file import parse_cluster
from planner.api import plan_chain
from planner.model_io import load_chain
from planner.runtime.launcher.elastic import _ban_event
from planner.runtime.launcher.launch import RunBanned
from planner.runtime.options import RunOptions
from planner.runtime.wire.bans import BanNotice, RankBannedError
from planner.solver.policy import VerificationPolicy


def _plan(tmp_path, *, domain: bool):
    host = lambda name, trust, trusted: {"name": name, "region": "lab", "trust": trust,  # noqa: E731
                                         "trusted": trusted, "devices": [{"type": "CPU", "count": 1}]}
    cluster = parse_cluster({"name": "pool", "hosts": [host("h0", "op", True), host("a1", "alice", False),
                                                       host("a2", "alice", False), host("h3", "op", True)],
                             "links": {"default": {"bandwidth_gbps": 10, "latency_ms": 0.1}}})
    _, chain = load_chain("gpt-tiny", batch=2, seq=16)
    plan = plan_chain(chain, cluster, spec="gpt-tiny", seq=16, global_batch=4, microbatch_size=2, time_limit_s=1,
                      workers=1, dtype="fp32", stages=4, policy=VerificationPolicy(ban_excludes_domain=domain))
    return plan, plan.save(tmp_path / "plan.json")


@pytest.mark.parametrize("domain", [False, True])
def test_a_ban_excludes_the_host_or_its_trust_domain(tmp_path, domain):
    plan, path = _plan(tmp_path, domain=domain)
    bad = next(r for r in plan.ranks if r.host == "a1")
    notice = BanNotice(rank=bad.rank, first_flagged_step=3, ban_step=5)
    banned = RunBanned(RankBannedError((notice,), hosts={bad.rank: "a1"}), result=None)
    event = _ban_event(RunOptions(plan=str(path), steps=8, checkpoint_dir=str(tmp_path / "ck")), banned)
    assert event["hosts"] == ["a1"]
    assert event["domains"] == (["alice"] if domain else [])
    assert ("trust domain alice" in event["excluded"]) == domain
