"""The verdict the lead verifier sends every rank at the end of a verified step
(``planner.runtime.wire.bans``): the bans, the unresolved flags and how many microbatches trained."""
from __future__ import annotations

from planner.runtime.wire.bans import BanNotice, decode, describe, encode, replan_hint


def test_the_lead_verifiers_verdict_round_trips_bans_unresolved_flags_and_what_trained():
    got = decode(encode(4, unresolved={1: 6, 2: 8}, bans={1: (6, 9)}, trained=3))
    assert got.bans == {1: BanNotice(rank=1, first_flagged_step=6, ban_step=9)}
    assert got.unresolved == {1: 6, 2: 8}
    assert got.trained == 3


def test_the_verdict_names_the_suspects_every_rank_audits_next_step():
    got = decode(encode(4, unresolved={2: 8}, bans={}, trained=3, suspects={1, 3}))
    assert got.suspects == {1, 3} and got.unresolved == {2: 8} and got.trained == 3 and got.bans == {}
    assert decode(encode(4, unresolved={}, bans={}, trained=3)).suspects == frozenset()


def test_a_flag_at_step_zero_and_a_step_that_trained_nothing_are_told_apart_from_none():
    got = decode(encode(2, unresolved={1: 0}, bans={1: (0, 0)}, trained=0))
    assert got.bans == {1: BanNotice(rank=1, first_flagged_step=0, ban_step=0)} and got.trained == 0
    assert decode(encode(2, unresolved={}, bans={}, trained=2)).bans == {}


def test_the_stop_line_names_the_rank_its_host_and_the_commands_that_go_on_without_it():
    notice = BanNotice(rank=2, first_flagged_step=6, ban_step=9)
    assert describe(notice, "h2") == "rank 2 (host h2) banned at step 9, first flagged at step 6"
    hint = replan_hint("plan.json", "h2", "ckpt")
    assert "stagewise replan plan.json --exclude h2 -o NEW.json" in hint
    assert "stagewise run NEW.json --resume --checkpoint-dir ckpt" in hint and "--replan-on-failure 1" in hint
    assert "--resume" not in replan_hint("plan.json", "h2", None)
