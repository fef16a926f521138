"""The sequential ban test: its false-ban guarantee and its detection delay."""
from __future__ import annotations

import math
import random

import pytest

from planner.integrity.bans import BanTest


def _run_lengths(test_factory, rate: float, steps: int, seed: int) -> list[int]:
    """Steps between bans of a sender blamed with probability ``rate`` per step (the test restarted)."""
    rng, lengths, test, since = random.Random(seed), [], test_factory(), 0
    for _ in range(steps):
        since += 1
        if test.step({7} if rng.random() < rate else set()):
            lengths.append(since)
            test, since = test_factory(), 0
    return lengths


def test_an_honest_sender_at_the_design_rate_waits_longer_than_the_bound_for_a_ban():
    """At the honest rate itself the mean run length must exceed exp(h); with a small bound (1e3, so
    the simulation sees many bans) the measured mean is checked against it."""
    make = lambda: BanTest(honest_rate=0.05, attack_rate=0.6, false_steps=1e3)
    lengths = _run_lengths(make, 0.05, 400_000, seed=0)
    assert len(lengths) >= 20                                   # enough bans to estimate the mean
    assert sum(lengths) / len(lengths) >= 1e3


@pytest.mark.parametrize("share, most", [(1.0, 5), (0.8, 7), (0.7, 8)])
def test_an_attacker_blamed_in_most_steps_is_banned_within_ten(share, most):
    """Blamed in 70% of its steps or more: banned within ten (the issue's goal), in expectation."""
    test = BanTest(honest_rate=0.05, attack_rate=0.6, false_steps=1e5)
    assert test.steps_to_ban(share) <= most
    rng = random.Random(1)
    for step in range(1, 200):
        if test.step({3} if rng.random() < share else set()):
            break
    assert step <= 2 * most


def test_a_rarely_blamed_sender_is_never_banned():
    test = BanTest(honest_rate=0.05, attack_rate=0.6, false_steps=1e5)
    assert test.steps_to_ban(0.2) == math.inf
    assert _run_lengths(lambda: BanTest(honest_rate=0.05, attack_rate=0.6, false_steps=1e5), 0.01, 100_000, 2) == []


def test_the_evidence_and_the_bans_survive_a_restart():
    test = BanTest(honest_rate=0.05, attack_rate=0.6, false_steps=1e5)
    for _ in range(5):
        test.step({2, 3} if _ < 4 else {2})
    saved = test.to_json()
    again = BanTest(honest_rate=0.05, attack_rate=0.6, false_steps=1e5)
    again.restore(saved)
    assert again.banned == {2} and again.evidence == test.evidence and 3 in again.evidence


def test_the_first_flagged_step_is_where_the_run_of_evidence_that_banned_began():
    test = BanTest(honest_rate=0.05, attack_rate=0.6, false_steps=1e3)     # 3 blamed steps in a row ban
    blamed_at = {1, 6, 7, 8}                                                # step 1's evidence dies away
    for step in range(10):
        test.step({4} if step in blamed_at else set(), at=step)
        if step == 4:
            assert test.unresolved() == {}                                  # back at zero: resolved
        if step == 7:
            assert test.unresolved() == {4: 6} and not test.banned
    assert test.banned == {4} and test.bans == {4: (6, 8)}
    assert test.unresolved() == {4: 6}
    again = BanTest(honest_rate=0.05, attack_rate=0.6, false_steps=1e3)
    again.restore(test.to_json())
    assert again.bans == test.bans and again.unresolved() == test.unresolved()
