"""Bans that exclude (gloo, one process per rank, one thread each).

* An attacker on the untrusted middle host of a 3-stage mlp-tiny plan is banned mid-run; with
  ``--replan-on-failure`` the run stops at the ban, re-plans without the attacker's host and resumes
  from the last clean checkpoint (the newest before its first flagged step), and its final weights
  equal a reference that loads that very checkpoint by hand and trains the remaining steps.
* A step in which every microbatch was dropped does not step the optimizer (Adam would move the
  weights on momentum alone), and the run says which steps trained nothing.

The corruption is an infinite scale (flagged whatever the monitors learnt; see test_runtime_attack).
"""
from __future__ import annotations

import shutil

import torch
from safetensors import safe_open

from models.registry import build_model, loss_fn
from planner.plan_load import load_plan
from planner.runtime.data import make_source
from planner.runtime.launcher import elastic
from planner.runtime.launcher.launch import launch
from planner.runtime.options import RunOptions
from planner.runtime.rank.rank_setup import make_optimizer
from planner.runtime.recovery import checkpoint
from planner.verifier_config import VerifierConfig
from tests.dist.by_hand import from_checkpoint_by_hand, keep_resumed_checkpoints
from tests.dist.plans import load_dumps, make_plan, reference_run

torch.set_num_threads(1)
M, STEPS, ATTACK_START, ATTACKER = 4, 10, 3, 1
VERIFY = ("act", "grad")


def _params(folder, num_ranks) -> dict[str, torch.Tensor]:
    out = {}
    for d in load_dumps(folder, num_ranks):
        out.update(d["params"])
    return out


def test_a_banned_attacker_is_planned_out_and_the_run_resumes_from_the_last_clean_checkpoint(tmp_path, monkeypatch):
    plan = make_plan("mlp-tiny", microbatch=2, num_microbatches=M, stages=[(0, 1), (2, 3), (4, 5)], optimizer="adam",
                     verifiers=[(0, 3, VERIFY), (1, 3, VERIFY)], verifier_host=True, untrusted=(ATTACKER,),
                     verifier_config=VerifierConfig(warmup=2, ban_false_steps=1000))  # 3 blamed steps ban
    assert plan.ranks[ATTACKER].host == "h1" and plan.ranks[ATTACKER].stage == 1
    path = plan.save(tmp_path / "plan.json")
    ckpt, clean = tmp_path / "ckpt", tmp_path / "clean"

    resumed = keep_resumed_checkpoints(monkeypatch, clean)
    # Half the microbatches corrupted: the steps after the first flag still train on the others, so the
    # checkpoints taken then differ from the clean one.
    attack = f"rank={ATTACKER},kind=scale,factor=inf,start={ATTACK_START},p=0.5,dir=act"
    result = elastic.launch_replanning(
        RunOptions(plan=str(path), steps=STEPS, timeout_s=60, checkpoint_dir=str(ckpt), checkpoint_every=1,
                   attacks=(attack,), dump=str(tmp_path / "dump"), report=str(tmp_path / "report.json")),
        max_replans=1, time_limit_s=2)

    (replanned,) = result["replans"]
    (ban,) = replanned["banned"]
    first, banned_at = ban["first_flagged_step"], ban["ban_step"]
    assert ban["rank"] == ATTACKER and ATTACK_START <= first < banned_at < STEPS
    # two newer checkpoints were taken after the clean one: only the pruning rule kept it
    assert banned_at - first >= checkpoint.KEEP
    assert replanned["excluded"] == "h1"
    assert replanned["after"] == f"rank {ATTACKER} (host h1) banned at step {banned_at}, first flagged at step {first}"
    # the last clean checkpoint, not the newest: the newest before the first flagged step
    assert replanned["resumed_after_step"] == first - 1
    (step, opts), = resumed
    assert step == first - 1 and opts.attacks == ()
    new_plan = load_plan(opts.plan)
    assert "h1" not in {r.host for r in new_plan.ranks}
    assert new_plan.report.notes[0].startswith("replanned without h1: rank 1 (host h1) banned")
    assert new_plan.history[-1].event == "ban" and new_plan.history[-1].excluded_hosts == ("h1",)
    assert replanned["event"] == "ban"
    # the checkpoints the attacker had a hand in were set aside, none of them resumed from
    tainted = sorted(p.name for p in ckpt.glob("step-*.tainted"))
    assert tainted == [f"step-{s:08d}.tainted" for s in range(first, banned_at)]
    assert result["steps"] == STEPS - first and result["untrained_steps"] == [] and result["banned"] == []
    assert "banned at step" in result["recovered"]

    want = from_checkpoint_by_hand(clean, first - 1, new_plan, STEPS)
    got = _params(tmp_path / "dump", new_plan.num_ranks)
    assert got.keys() == want.keys()
    for name, p in got.items():
        torch.testing.assert_close(p, want[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_a_step_in_which_nothing_trained_does_not_step_the_optimizer(tmp_path):
    """Every microbatch from step 1 on is corrupted and dropped (no ban: the test's bar is out of reach):
    the weights after 3 Adam steps are those after the first, and the run names steps 1 and 2."""
    plan = make_plan("mlp-tiny", microbatch=2, num_microbatches=2, stages=[(0, 2), (3, 5)], optimizer="adam",
                     verifiers=[(0, 2, VERIFY)], verifier_host=True,
                     verifier_config=VerifierConfig(warmup=1, ban_false_steps=1e12))
    path = plan.save(tmp_path / "plan.json")
    result = launch(RunOptions(plan=str(path), steps=3, timeout_s=60, dump=str(tmp_path / "dump"),
                               attacks=("rank=0,kind=scale,factor=inf,start=1,dir=act",)))
    assert result["untrained_steps"] == [1, 2] and result["dropped"] == [0, 2, 2]
    _, _, after_one = reference_run(plan, steps=1)
    got = _params(tmp_path / "dump", plan.num_ranks)
    assert got.keys() == after_one.keys()
    for name, p in got.items():
        torch.testing.assert_close(p, after_one[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
