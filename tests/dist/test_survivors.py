"""Resume from the survivors' state (gloo, one process per rank, one thread each).

A 2-stage gpt-tiny plan whose first stage has two replicas checkpoints every 10 steps; a rank dies at
step 14, between checkpoints.

* The lost rank is a replica of the replicated stage: the survivors (its twin and the last stage) leave
  their state after step 13, the launcher marks it complete, re-plans without the lost host and resumes
  at step 14: no step is trained twice. The final weights equal a reference that loads that survivor
  checkpoint by hand into the whole model and trains on, and the weights of an unbroken run.
* The lost rank is the last stage's only replica: the survivors' state misses that stage, so it is
  discarded (the history says why) and the run resumes from the checkpoint after step 9, as before.
"""
from __future__ import annotations

from collections import Counter

import torch

from planner.plan_load import load_plan
from planner.runtime.launcher import elastic
from planner.runtime.options import FaultSpec, RunOptions
from planner.runtime.recovery import checkpoint, survivors
from tests.dist.by_hand import from_checkpoint_by_hand, keep_resumed_checkpoints
from tests.dist.plans import load_dumps, make_plan, reference_run

torch.set_num_threads(1)
STEPS, EVERY, DIES_AT = 16, 10, 14


def _plan():
    plan = make_plan("gpt-tiny", microbatch=2, num_microbatches=2, seq=16, stages=[(0, 2), (3, 5)],
                     replicas={0: (1, 1)}, optimizer="adam")
    assert [r.stage for r in plan.ranks] == [0, 0, 1]
    return plan


def _params(folder, num_ranks) -> dict[str, torch.Tensor]:
    out = {}
    for d in load_dumps(folder, num_ranks):
        out.update(d["params"])
    return out


def _assert_same(got, want):
    assert set(got) == set(want)
    for name, p in got.items():
        torch.testing.assert_close(p, want[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def _run_losing(tmp_path, monkeypatch, rank: int):
    """The plan's run with ``rank`` dying at step DIES_AT, re-planned once; returns (result, the steps rank 0
    reported in order, the checkpoints it resumed from, the plan)."""
    plan = _plan()
    path = plan.save(tmp_path / "plan.json")
    resumed = keep_resumed_checkpoints(monkeypatch, tmp_path / "clean")
    events: list[dict] = []
    result = elastic.launch_replanning(
        RunOptions(plan=str(path), steps=STEPS, timeout_s=30, checkpoint_dir=str(tmp_path / "ckpt"),
                   checkpoint_every=EVERY, fault=FaultSpec(rank=rank, kind="die", step=DIES_AT),
                   dump=str(tmp_path / "dump")), max_replans=1, time_limit_s=2, on_event=events.append)
    steps = [e["step"] for e in events if e.get("event") == "step"]
    return result, steps, resumed, plan


def test_a_lost_replica_resumes_from_the_survivors_state_and_redoes_nothing(tmp_path, monkeypatch):
    result, steps, resumed, plan = _run_losing(tmp_path, monkeypatch, rank=1)
    (replanned,) = result["replans"]
    assert replanned["excluded"] == "h1" and "rank 1 died" in replanned["after"]
    assert replanned["survivors"] == {"step": DIES_AT - 1, "ranks": [0, 2]}
    assert replanned["resumed_after_step"] == DIES_AT - 1        # the last step completed before the failure
    assert replanned["redone_steps"] == 0
    assert "resumed after step 13 from the survivors' state (ranks 0, 2 left" in result["recovered"]
    ((step, _),) = resumed
    assert step == DIES_AT - 1
    # The new plan trained steps 14 and 15 only; no step was reported twice (nothing redone).
    assert result["steps"] == STEPS - DIES_AT
    assert steps[-(STEPS - DIES_AT):] == list(range(DIES_AT, STEPS))
    assert max(Counter(steps).values()) == 1
    manifest = checkpoint.rank_files(tmp_path / "clean", step=step)
    assert [p.name for p in manifest] == ["rank0.safetensors", "rank2.safetensors"]  # the survivors' files
    assert not (tmp_path / "ckpt" / survivors.FOLDER).exists()

    new_plan = load_plan(replanned["plan"])
    assert "h1" not in {r.host for r in new_plan.ranks}
    final = _params(tmp_path / "dump", new_plan.num_ranks)
    _assert_same(final, from_checkpoint_by_hand(tmp_path / "clean", step, new_plan, STEPS))
    # The survivors' state is the one of a run that never failed: the end is that run's end too.
    _assert_same(final, reference_run(plan, steps=STEPS)[2])


def test_a_stage_whose_only_replica_died_falls_back_to_the_checkpoint(tmp_path, monkeypatch):
    result, steps, resumed, plan = _run_losing(tmp_path, monkeypatch, rank=2)
    (replanned,) = result["replans"]
    assert replanned["excluded"] == "h2"
    assert "survivors" not in replanned
    assert replanned["survivors_discarded"].startswith("stage 1 left no survivor file (ranks [2])")
    assert replanned["resumed_after_step"] == EVERY - 1          # the checkpoint on disk, as before
    assert replanned["redone_steps"] == DIES_AT - EVERY          # steps 10 to 13 again
    assert "survivor checkpoint discarded" in result["recovered"]
    ((step, _),) = resumed
    assert step == EVERY - 1
    assert result["steps"] == STEPS - EVERY
    new_plan = load_plan(replanned["plan"])
    final = _params(tmp_path / "dump", new_plan.num_ranks)
    _assert_same(final, from_checkpoint_by_hand(tmp_path / "clean", step, new_plan, STEPS))
