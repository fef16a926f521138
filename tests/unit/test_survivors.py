"""The survivors' state after a failure: what a rank leaves, and the launcher's decision to make it the
newest checkpoint (same step everywhere, every stage covered, newer than the newest checkpoint) or not."""
from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from planner.runtime.recovery import checkpoint, survivors
from planner.runtime.recovery.survivors import Note, decide

STAGE_OF = {0: 0, 1: 0, 2: 1, 3: None}  # two replicas of stage 0, one of stage 1, a verifier


def _decide(*notes: Note, newest: int | None = 9):
    return decide(notes, stage_of=STAGE_OF, num_stages=2, newest=newest, last_step=15)


def test_the_survivors_state_is_taken_when_the_steps_agree_every_stage_is_covered_and_it_is_newer():
    got = _decide(Note(rank=0, step=13), Note(rank=2, step=13), Note(rank=3, step=13))
    assert (got.step, got.ranks) == (13, (0, 2, 3))
    assert got.entry() == {"survivors": {"step": 13, "ranks": [0, 2, 3]},
                           "survivors_note": "ranks 0, 2, 3 left their state after step 13",
                           "survivors_reached_step": 13}
    assert _decide(Note(rank=1, step=13), Note(rank=2, step=13), newest=None).step == 13  # no checkpoint yet
    lost_verifier = _decide(Note(rank=0, step=13), Note(rank=2, step=13))
    assert lost_verifier.step == 13 and "verifier rank 3 left no state: the resumed run's monitor starts fresh" \
        in lost_verifier.why


def test_anything_less_falls_back_to_the_newest_checkpoint_and_says_why():
    mismatch = _decide(Note(rank=0, step=13), Note(rank=1, step=13), Note(rank=2, step=14))
    assert mismatch.step is None
    assert mismatch.why == ("the survivors stopped at different steps (rank 0 after step 13, rank 1 after step 13, "
                            "rank 2 after step 14)")
    assert mismatch.entry() == {"survivors_discarded": mismatch.why, "survivors_reached_step": 14}
    lost = _decide(Note(rank=0, step=13), Note(rank=1, step=13), Note(rank=3, step=13))
    assert lost.step is None and lost.why == "stage 1 left no survivor file (ranks [2])"
    declined = _decide(Note(rank=0, step=13), Note(rank=2, step=None, why="rank 2 had begun step 14's optimizer update"))
    assert declined.step is None
    assert declined.why == "stage 1 left no survivor file (ranks [2]); rank 2 had begun step 14's optimizer update"
    # a replica inside its update is no loss while its twin left the state
    assert _decide(Note(rank=0, step=13), Note(rank=1, step=None, why="x"), Note(rank=2, step=13)).step == 13
    stale = _decide(Note(rank=0, step=9), Note(rank=2, step=9))
    assert stale.step is None and stale.why == "the survivors' step 9 is no newer than the newest checkpoint (step 9)"
    assert _decide().why == "no surviving rank left its state"
    done = _decide(Note(rank=0, step=15), Note(rank=2, step=15))     # nothing left to resume
    assert done.step is None and done.why.startswith("the survivors had finished the last step (15)")


def test_a_state_an_auditor_had_not_yet_vouched_for_is_never_resumed_from():
    # rank 3 audits stage 0 with its verdict a step late: a peer killed in step 14 must not carry step 13's update
    # past its audit (an attacker could crash a twin to escape it)
    def run(*notes: Note):
        return decide(notes, stage_of=STAGE_OF, num_stages=2, newest=9, last_step=15, auditors={3})
    stage_notes = (Note(rank=0, step=13), Note(rank=2, step=13))
    why = "rank 3 had no passing verdict on step 13's audits"
    out = run(*stage_notes, Note(rank=3, step=None, why=why, unaudited_since=13))
    assert out.step is None and why in out.why and out.reached == 13
    assert run(*stage_notes).step is None                                     # the auditor died: its verdicts lost
    assert "auditor rank 3 left no note" in run(*stage_notes).why
    assert run(*stage_notes, Note(rank=3, step=13)).step == 13                # every audit of step 13 in
    assert run(*stage_notes, Note(rank=3, step=13, unaudited_since=14)).step == 13   # only later steps' out


def test_an_auditor_with_audits_out_leaves_a_note_and_no_file(tmp_path):
    w, _, tracker = _rank(tmp_path, 0, value=1.0, steps=3)
    survivors.leave(tmp_path, tracker, rank=0, fingerprint="f", params={"w0": w}, state={}, keep_before=None,
                    unaudited_since=2)
    assert not (tmp_path / survivors.FOLDER / "rank0.safetensors").exists()
    assert survivors.read_notes(tmp_path, num_ranks=1, fingerprint="f") == [
        Note(rank=0, step=None, why="rank 0 had no passing verdict on step 2's audits", unaudited_since=2)]


def _rank(tmp_path, rank: int, *, value: float, steps: int, first: int = 0, fingerprint: str = "f"):
    """A rank with one Adam-trained parameter, ``steps`` completed steps, then a peer failure: leave()."""
    w = torch.nn.Parameter(torch.full((3,), value))
    opt = torch.optim.Adam([w], lr=0.1)
    executor = SimpleNamespace(optimizer=opt, untrained_steps=[], scaler=None)
    tracker = survivors.Tracker(executor, first=first)
    for step in range(first, first + steps):
        w.grad = torch.ones_like(w)
        opt.step()
        tracker.completed(step)
    survivors.leave(tmp_path, tracker, rank=rank, fingerprint=fingerprint, params={f"w{rank}": w},
                    state={"layout": []}, keep_before=None)
    return w, opt, tracker


KEY = b"k" * 32


def _plan(stages, fingerprint="f"):
    ranks = [SimpleNamespace(rank=r, stage=k, host=f"h{r}", device=f"h{r}/0") for r, k in enumerate(stages)]
    return SimpleNamespace(ranks=ranks, num_ranks=len(ranks), num_stages=len({k for k in stages if k is not None}),
                           model=SimpleNamespace(fingerprint=fingerprint), stages=(), tied_params=(),
                           policy=SimpleNamespace(enabled=False), verifiers=(),
                           effective_cluster=lambda: SimpleNamespace(device=lambda d: SimpleNamespace(trusted=True)))


def test_settled_survivor_files_resume_as_a_checkpoint_listing_only_their_ranks(tmp_path):
    w0, opt0, _ = _rank(tmp_path, 0, value=1.0, steps=4)
    w1, _, _ = _rank(tmp_path, 1, value=2.0, steps=4)
    note = json.loads((tmp_path / survivors.FOLDER / "rank0.json").read_text())
    assert note == {"rank": 0, "step": 3, "why": "", "keep_before": None, "unaudited_since": None}
    got = survivors.settle(tmp_path, _plan([0, 1, 1]), last_step=9, key=KEY)              # rank 2 (a twin of rank 1) died
    assert (got.step, got.ranks) == (3, (0, 1))
    assert checkpoint.complete_steps(tmp_path) == [3]
    assert [p.name for p in checkpoint.rank_files(tmp_path, step=3)] == ["rank0.safetensors", "rank1.safetensors"]
    assert not (tmp_path / survivors.FOLDER).exists()
    fresh = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.Adam([fresh], lr=0.1)
    checkpoint.restore_rank(tmp_path, step=3, params={"w0": fresh}, optimizer=opt, rank=0, key=KEY)
    torch.testing.assert_close(fresh.detach(), w0.detach())
    torch.testing.assert_close(opt.state[fresh]["exp_avg"], opt0.state[w0]["exp_avg"])
    assert checkpoint.read_params(tmp_path, step=3, names={"w1"}, key=KEY)["w1"].tolist() == w1.tolist()


def test_a_rank_inside_its_optimizer_update_or_with_no_new_step_writes_no_file(tmp_path):
    w, opt, tracker = _rank(tmp_path, 0, value=1.0, steps=2)
    w.grad = torch.ones_like(w)
    opt.step()                                                       # step 2's update: neither step 1's nor 2's
    survivors.leave(tmp_path, tracker, rank=0, fingerprint="f", params={"w0": w}, state={}, keep_before=None)
    assert not (tmp_path / survivors.FOLDER / "rank0.safetensors").exists()
    _rank(tmp_path, 1, value=1.0, steps=0, first=5)                  # resumed at step 5, failed in it
    notes = survivors.read_notes(tmp_path, num_ranks=2, fingerprint="f")
    assert notes == [Note(rank=0, step=None, why="rank 0 had begun step 2's optimizer update"),
                     Note(rank=1, step=None, why="rank 1 had completed no step since the run (re)started")]


def test_a_note_that_does_not_match_its_file_or_the_model_counts_as_none(tmp_path):
    _rank(tmp_path, 0, value=1.0, steps=3)
    _rank(tmp_path, 1, value=1.0, steps=3, fingerprint="another model")
    (tmp_path / survivors.FOLDER / "rank2.json").write_text('{"rank": 2, "step": "__import__"}')
    notes = survivors.read_notes(tmp_path, num_ranks=3, fingerprint="f")
    assert notes == [Note(rank=0, step=2), Note(rank=1, step=None, why="rank 1's file does not match its note"),
                     Note(rank=2, step=None, why="rank 2's note is unreadable")]
    got = survivors.settle(tmp_path, _plan([0, 1, 1]), last_step=9, key=KEY)
    assert got.step is None and got.why.startswith("stage 1 left no survivor file")
    assert checkpoint.complete_steps(tmp_path) == [] and not (tmp_path / survivors.FOLDER).exists()


def test_a_manifest_lists_every_rank_that_wrote_a_file(tmp_path):
    for rank in range(2):
        checkpoint.save_rank(tmp_path, step=1, rank=rank, fingerprint="f", params={}, optimizer=None)
    checkpoint.complete(tmp_path, step=1, layout=checkpoint.Layout.of(_plan([0, 1])), key=KEY)
    assert json.loads((checkpoint.step_folder(tmp_path, 1) / checkpoint.MANIFEST).read_text())["ranks"] == [0, 1]
    assert [p.name for p in checkpoint.rank_files(tmp_path, step=1)] == ["rank0.safetensors", "rank1.safetensors"]
