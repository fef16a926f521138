"""Replays from further back than the sketch ring, and blame that a replay keeps. A stale worker sent its
20-step-old activations (gpt-tiny on four T4 hosts, split placement, 16 microbatches a step: the ring of
256 sketches reached back 16 steps); it was never flagged, and its honest neighbour upstream was banned."""
from __future__ import annotations

import torch

from planner.integrity.attacks import Attacker, parse_attack
from planner.integrity.blame import STEP_MB, blame
from planner.integrity.history import CopyMemory
from tests.unit.test_verify import MBS, Stream, make, run

torch.set_num_threads(1)


def test_a_replay_older_than_the_ring_is_caught_by_its_fingerprint() -> None:
    v = make(replay_window=8)                       # the ring holds 2 steps of 4 microbatches
    attacker = Attacker(parse_attack("rank=1,start=12,kind=delay,steps=5"), seed=0)
    flags = run(v, 17, attacker=attacker, labels=False)
    assert not any(flags[s] for s in range(12))
    replays = {(e["step"], e["mb"]) for s in range(12, 17) for e in flags[s] if "replay" in e["reasons"]}
    assert replays == {(s, mb) for s in range(12, 17) for mb in range(MBS)}
    assert v.banned == {1}


def test_the_fingerprint_memory_forgets_the_oldest_first() -> None:
    copies = CopyMemory(2)
    a, b, c = (torch.full((8,), float(i)) for i in range(3))
    for sketch in (a, b, c):
        copies.push(sketch)
    assert not copies.copied(a) and copies.copied(b) and copies.copied(c)
    assert not copies.copied(torch.full((8,), 2.0 + 1e-6))  # exact copies only: the ring sees near ones


def test_a_copy_of_the_same_data_s_tensor_is_no_replay() -> None:
    copies = CopyMemory(4)
    copies.push(torch.ones(8), data_key=7)
    assert not copies.copied(torch.ones(8), data_key=7)     # a frozen stage, its data come round again
    assert copies.copied(torch.ones(8), data_key=8)         # another microbatch's tensor sent back
    assert copies.copied(torch.ones(8))                     # unknown data: any copy is a replay
    copies.push(torch.zeros(8), data_key=1)
    assert not copies.copied(torch.zeros(8), data_key=2)    # zeros (no target to learn) copy nobody


def test_a_frozen_stage_whose_data_come_round_again_is_not_flagged() -> None:
    """Fine-tuning with the bottom layers frozen on a small dataset: every epoch (3 steps here) the
    first stage sends bit for bit what it sent the epoch before, for the same data. Sending one of
    those tensors for other data is still a replay."""
    stream = Stream(0)
    epoch = {(s, mb): stream.sample(0) for s in range(3) for mb in range(MBS)}   # one frozen model
    v = make()
    for step in range(15):
        for mb in range(MBS):
            x, lab = epoch[(step % 3, mb)]
            if step == 14 and mb == 0:
                x = epoch[(1, 2)][0]                        # a copy of another microbatch's tensor
            v.check(0, "act", x, step=step, mb=mb, sender=1, labels=lab)
        flags = v.flag_events(step)
        v.end_step(step, [flags])
        if step < 14:
            assert not flags, flags[:2]
    assert [e["mb"] for e in flags] == [0] and "replay" in flags[0]["reasons"]
    assert v.banned == set()


def flag(step: int, mb: int, boundary: int, direction: str, sender: int, *reasons: str) -> dict:
    return {"type": "flag", "step": step, "mb": mb, "boundary": boundary, "direction": direction,
            "sender": sender, "reasons": list(reasons)}


def test_a_replay_is_blamed_whatever_was_flagged_upstream() -> None:
    """The stale worker's effect on its honest neighbour (trained on gradients of its stale tensors) flags
    the neighbour's output, upstream of the replay in the step: both are blamed, not the neighbour alone."""
    upstream = flag(50, STEP_MB, 1, "act", 1, "scale")
    replay = flag(50, 3, 2, "act", 2, "replay")
    assert blame([upstream, replay]) == {1, 2}
    assert blame([flag(50, 3, 1, "act", 1, "link", "l2"), replay]) == {1, 2}
    assert blame([upstream, flag(50, 3, 2, "act", 2, "link", "l2")]) == {1}   # anything else: upstream wins
