"""A rank's checkpoint file: parameters, optimizer state and its extra state, by parameter name."""
from __future__ import annotations

import torch

from planner.runtime.recovery import checkpoint

KEY = b"k" * 32


def _layout(num_ranks: int = 1, fingerprint: str = "f", **kw) -> checkpoint.Layout:
    return checkpoint.Layout(num_ranks=num_ranks, fingerprint=fingerprint, hosts={r: f"h{r}" for r in range(num_ranks)},
                             holders=kw.pop("holders", {}), **kw)


def test_a_rank_file_round_trips_parameters_optimizer_state_and_extra_state(tmp_path):
    w = torch.nn.Parameter(torch.randn(3, 2))
    opt = torch.optim.Adam([w], lr=0.1)
    w.grad = torch.ones_like(w)
    opt.step()
    checkpoint.save_rank(tmp_path, step=4, rank=0, fingerprint="f", params={"layer.w": w}, optimizer=opt,
                         state={"bans": {"banned": [2]}})
    checkpoint.complete(tmp_path, step=4, layout=_layout(), key=KEY)
    assert checkpoint.latest(tmp_path, fingerprint="f", key=KEY).step == 4
    fresh = torch.nn.Parameter(torch.zeros(3, 2))
    opt2 = torch.optim.Adam([fresh], lr=0.1)
    got = checkpoint.restore_rank(tmp_path, step=4, params={"layer.w": fresh}, optimizer=opt2, rank=0, key=KEY)
    torch.testing.assert_close(fresh.detach(), w.detach())
    torch.testing.assert_close(opt2.state[fresh]["exp_avg"], opt.state[w]["exp_avg"])
    assert got.state == {"bans": {"banned": [2]}}


def _take(root, step: int, *, keep_before: int | None = None) -> None:
    w = torch.nn.Parameter(torch.full((2,), float(step)))
    checkpoint.save_rank(root, step=step, rank=0, fingerprint="f", params={"w": w}, optimizer=None)
    checkpoint.complete(root, step=step, layout=_layout(), key=KEY,
                        unresolved={} if keep_before is None else {1: keep_before})


def _prunable(steps: list[int], keep_before: int | None = None) -> list[int]:
    """Without audits: sender 1 first flagged at ``keep_before``."""
    return checkpoint.prunable(steps, now=max(steps), unresolved={} if keep_before is None else {1: keep_before})


def test_pruning_keeps_the_newest_two_and_the_last_clean_one_while_a_flag_is_unresolved():
    assert _prunable([1, 2, 3, 4, 5]) == [1, 2, 3]
    # a sender first flagged at step 3: the checkpoint after step 2 is the last one it had no hand in
    assert _prunable([1, 2, 3, 4, 5], keep_before=3) == [1, 3]
    assert _prunable([1, 2, 3, 4, 5], keep_before=5) == [1, 2, 3]   # 4 is clean and among the newest
    assert _prunable([4, 5, 6], keep_before=2) == [4]                # none is clean: nothing extra kept
    assert _prunable([2], keep_before=3) == []


def test_the_clean_checkpoint_survives_a_run_of_flagged_steps_and_is_the_newest_once_the_rest_are_set_aside(
        tmp_path):
    for step in range(3):
        _take(tmp_path, step)
    for step in range(3, 7):                                  # flagged from step 3 on, unresolved
        _take(tmp_path, step, keep_before=3)
    assert checkpoint.complete_steps(tmp_path) == [2, 5, 6]
    moved = checkpoint.set_aside(tmp_path, from_step=3)       # banned: its first flagged step was 3
    assert [p.name for p in moved] == ["step-00000005.tainted", "step-00000006.tainted"]
    assert checkpoint.complete_steps(tmp_path) == [2]
    assert checkpoint.latest(tmp_path, fingerprint="f", key=KEY).step == 2  # what --resume loads now
    assert checkpoint.set_aside(tmp_path, from_step=3) == []  # once more is a no-op
    _take(tmp_path, 7)                                        # a flag resolved: the usual two stay
    _take(tmp_path, 8)
    _take(tmp_path, 9)
    assert checkpoint.complete_steps(tmp_path) == [8, 9]
