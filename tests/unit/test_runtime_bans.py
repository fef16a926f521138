"""The end-of-step exchange every rank of a verified run joins (``planner.runtime.bans``): summed over
the ranks, it tells each of them the bans, the unresolved flags and how many microbatches trained."""
from __future__ import annotations

import torch

from planner.runtime.bans import BanNotice, decode, describe, encode, replan_hint


def test_the_lead_verifier_speaks_for_the_bans_and_every_rank_for_what_it_trained():
    n = 4  # ranks 0-2 run stages 0-2 (rank 0 the first), rank 3 is the verifier
    shares = [encode(n, rank=r, lead=False, unresolved={}, bans={}, trained=t) for r, t in ((0, 3), (1, 3), (2, 4))]
    shares.append(encode(n, rank=3, lead=True, unresolved={1: 6, 2: 8}, bans={1: (6, 9)}, trained=0))
    got = decode(torch.stack(shares).sum(0), first_stage_ranks=(0,))
    assert got.bans == {1: BanNotice(rank=1, first_flagged_step=6, ban_step=9)}
    assert got.unresolved == {1: 6, 2: 8}
    assert got.trained == 3


def test_a_flag_at_step_zero_and_a_step_that_trained_nothing_are_told_apart_from_none():
    share = encode(2, rank=0, lead=True, unresolved={1: 0}, bans={1: (0, 0)}, trained=0)
    got = decode(share, first_stage_ranks=(0,))
    assert got.bans == {1: BanNotice(rank=1, first_flagged_step=0, ban_step=0)} and got.trained == 0
    assert decode(encode(2, rank=0, lead=False, unresolved={}, bans={}, trained=2),
                  first_stage_ranks=(0,)).bans == {}


def test_the_stop_line_names_the_rank_its_host_and_the_commands_that_go_on_without_it():
    notice = BanNotice(rank=2, first_flagged_step=6, ban_step=9)
    assert describe(notice, "h2") == "rank 2 (host h2) banned at step 9, first flagged at step 6"
    hint = replan_hint("plan.json", "h2", "ckpt")
    assert "stagewise replan plan.json --exclude h2 -o NEW.json" in hint
    assert "stagewise run NEW.json --resume --checkpoint-dir ckpt" in hint and "--replan-on-failure 1" in hint
    assert "--resume" not in replan_hint("plan.json", "h2", None)
