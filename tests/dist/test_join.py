"""A host that joins a running run is planned in at its next checkpoint (gloo, one process per rank, one
thread each).

gpt-tiny on four CPU hosts, each able to hold 70% of the model's training state; h3 is six times faster
than the others, but the run starts without it (the plan excludes it). Once the run's first checkpoint is
complete, a join request for h3 is written, as `stagewise join` writes it; beside it lies a file that is
no request, which is rejected without stopping anything. The launcher stops the ranks right after the
next checkpoint, re-plans with h3 (history event ``join``, signed), and resumes there on the new plan;
the final weights equal a reference that loads that checkpoint by hand and trains the remaining steps.
The run may re-plan after no failure at all (``max_replans=0``): a join is not a recovery.
"""
from __future__ import annotations

import dataclasses
import shutil
import threading
import time

import torch

from cost_models.cluster_file import parse_cluster
from cost_models.devices import CATALOG
from planner.api import plan_chain
from planner.model_io import load_chain
from planner.runtime.launcher import elastic
from planner.runtime.launcher.launch import launch
from planner.runtime.launcher.membership import load_signed_plan
from planner.runtime.options import RunOptions
from planner.runtime.recovery import checkpoint, joins
from planner.secret import run_secret
from planner.solver.policy import VerificationPolicy
from tests.dist.by_hand import from_checkpoint_by_hand, keep_resumed_checkpoints
from tests.dist.plans import load_dumps

torch.set_num_threads(1)
STEPS = 40  # long enough that the request, written after the first checkpoint, meets a later one


def _first_plan():
    """Three stages on h0, h1, h2 of a cluster whose fastest host, h3, the plan leaves out."""
    _, chain = load_chain("gpt-tiny", batch=2, seq=16)
    host = lambda name, efficiency: {  # noqa: E731
        "name": name, "region": "lab", "trust": "operator", "trusted": True,
        "devices": [{"type": "CPU", "count": 1, "spec": {**CATALOG["CPU"].to_dict(), "efficiency": efficiency,
                                                          "mem_bytes": int(0.7 * 4 * chain.param_bytes)}}]}
    cluster = parse_cluster({"name": "four", "hosts": [host("h0", 0.05), host("h1", 0.05), host("h2", 0.05),
                                                       host("h3", 0.3)],
                             "links": {"default": {"bandwidth_gbps": 10, "latency_ms": 0.1}}})
    plan = plan_chain(chain, cluster.without_hosts({"h3"}), spec="gpt-tiny", seq=16, global_batch=4,
                      microbatch_size=2, policy=VerificationPolicy(enabled=False), time_limit_s=2, workers=1,
                      dtype="fp32", optimizer="adam", stages=3)
    return dataclasses.replace(plan, cluster=cluster.to_dict(), excluded_hosts=("h3",))


def _params(folder, num_ranks) -> dict[str, torch.Tensor]:
    out = {}
    for d in load_dumps(folder, num_ranks):
        out.update(d["params"])
    return out


def _ask_after_first_checkpoint(ckpt, plan, key, done: threading.Event) -> threading.Thread:
    """A thread that writes h3's join request once the run's first checkpoint is complete."""

    def ask() -> None:
        while not checkpoint.complete_steps(ckpt) and not done.is_set():
            time.sleep(0.01)
        if not done.is_set():
            joins.write_request(ckpt / joins.FOLDER, joins.make_request(plan, host="h3", why="h3 repaired"), key)

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    return thread


def test_a_host_that_joins_mid_run_is_planned_in_at_the_next_checkpoint(tmp_path, monkeypatch):
    plan = _first_plan()
    assert {r.host for r in plan.ranks} == {"h0", "h1", "h2"}
    key = run_secret()
    path = plan.save(tmp_path / "plan.json", secret=key)
    ckpt, clean = tmp_path / "ckpt", tmp_path / "clean"
    (ckpt / joins.FOLDER).mkdir(parents=True)
    (ckpt / joins.FOLDER / "note.yaml").write_text("host: h3\n")  # not signed: not a request

    resumed = keep_resumed_checkpoints(monkeypatch, clean)
    done = threading.Event()
    asker = _ask_after_first_checkpoint(ckpt, plan, key, done)
    try:
        result = elastic.launch_replanning(
            RunOptions(plan=str(path), steps=STEPS, timeout_s=60, checkpoint_dir=str(ckpt), checkpoint_every=1,
                       dump=str(tmp_path / "dump"), report=str(tmp_path / "report.json")),
            max_replans=0, time_limit_s=2)
    finally:
        done.set()
        asker.join()

    assert "joins_waiting" not in result, "the run ended before a checkpoint took the join request"
    (joined,) = result["replans"]
    (step, opts), = resumed
    assert joined["event"] == "join" and joined["joined"] == ["h3"] and joined["resumed_after_step"] == step
    assert 0 < step < STEPS - 1 and result["steps"] == STEPS - 1 - step
    assert joined["after"] == "h3 joined (re-admitted): h3 repaired"
    assert result["joined"].startswith("h3 joined (re-admitted): h3 repaired -> re-planned with h3")
    assert "recovered" not in result and result["untrained_steps"] == []
    assert joined["request_to_first_step_s"] > joined["restart_s"] > 0 and joined["request_to_checkpoint_s"] >= 0
    # the request was acted on, the stray file set aside, and the run said so
    assert sorted(p.name for p in (ckpt / joins.FOLDER).iterdir()) == ["join-h3.json.joined", "note.yaml.rejected"]
    (bad,) = result["joins_rejected"]
    assert bad["file"].endswith("note.yaml.rejected") and "not JSON" in bad["error"]
    # the new plan: signed, h3 in it, the join in its history
    new_plan, _ = load_signed_plan(opts.plan, key)
    assert "h3" in {r.host for r in new_plan.ranks} and new_plan.excluded_hosts == ()
    last = new_plan.history[-1]
    assert (last.event, last.readmitted_hosts, last.excluded_hosts) == ("join", ("h3",), ())
    assert last.reason == "h3 joined (re-admitted): h3 repaired" and last.previous_ranks == plan.num_ranks
    assert new_plan.report.notes[0].startswith("replanned with h3 joined: h3 joined (re-admitted)")

    want = from_checkpoint_by_hand(clean, step, new_plan, STEPS)
    got = _params(tmp_path / "dump", new_plan.num_ranks)
    assert got.keys() == want.keys()
    for name, p in got.items():
        torch.testing.assert_close(p, want[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
