"""A step whose blame holds a winning step-level flag is rejected (``Verifier.last_rejected``): none of
its microbatches was dropped for that flag, so no rank may apply its optimizer update. Flags of single
microbatches, replays included, drop their microbatches and never reject the step."""
from __future__ import annotations

import math

from planner.integrity.blame import STEP_MB, blame_weights, step_blamed
from planner.integrity.verifier import Verifier


def flag(step: int, mb: int, boundary: int, direction: str, sender: int, *reasons: str) -> dict:
    return {"type": "flag", "step": step, "mb": mb, "boundary": boundary, "direction": direction, "sender": sender,
            "scope": "step" if mb == STEP_MB else "microbatch", "reasons": list(reasons)}


def verdicts(*steps: list[dict]) -> list[tuple[bool, set[int]]]:
    """(rejected, blamed) after each step's flags, gathered from two verifiers (the second one silent)."""
    v = Verifier({}, [(1, "act"), (1, "grad")])
    out = []
    for step, flags in enumerate(steps):
        v.end_step(step, [flags, []])
        out.append((v.last_rejected, set(v.last_blamed)))
    return out


def test_a_winning_step_level_flag_rejects_its_step_and_the_next_step_starts_clean():
    assert verdicts([flag(0, STEP_MB, 1, "grad", 2, "scale")], []) == [(True, {2}), (False, set())]
    assert step_blamed([flag(0, STEP_MB, 1, "grad", 2)]) == {2}
    assert blame_weights([flag(0, STEP_MB, 1, "grad", 2)]) == {2: math.inf}


def test_microbatch_flags_alone_drop_their_microbatches_but_never_reject_the_step():
    every = [flag(0, mb, 1, "act", 1, "mad") for mb in range(16)]    # blamed, 16 microbatches of evidence
    lone = [flag(1, 3, 1, "grad", 2, "mad")]
    assert verdicts(every, lone) == [(False, {1}), (False, set())]


def test_a_replay_weighs_a_whole_step_but_its_microbatch_was_dropped_already():
    replay = [flag(0, 5, 1, "act", 1, "replay")]
    assert blame_weights(replay) == {1: math.inf} and step_blamed(replay) == set()
    assert verdicts(replay) == [(False, {1})]


def test_a_step_flag_outranked_upstream_rejects_nothing_and_one_that_wins_does():
    # sender 1 flagged on two microbatches upstream takes sender 2's step-level flag (its cause): dropped, not rejected
    upstream = [flag(0, STEP_MB, 2, "act", 2), flag(0, 0, 1, "act", 1), flag(0, 1, 1, "act", 1)]
    assert step_blamed(upstream) == set() and verdicts(upstream) == [(False, {1})]
    # a lone microbatch flag upstream explains its own microbatch, not a whole step's average
    lone = [flag(0, STEP_MB, 2, "act", 2), flag(0, 0, 1, "act", 1)]
    assert step_blamed(lone) == {2} and verdicts(lone)[0][0]
    # a step-level flag laid on its stage's input rejects the step for that input's sender
    laid = [{**flag(0, STEP_MB, 2, "act", 2), "upstream": 1}]
    assert step_blamed(laid) == {1} and verdicts(laid) == [(True, {1})]
