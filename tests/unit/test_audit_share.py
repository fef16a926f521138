"""The audit share the planner chooses (``planner.solver.audits``): the sparsest of ``EVERY_CHOICES`` under which
an attacking replica goes unaudited ``MISS_STEPS`` steps with probability at most ``MISS_TARGET``, else the
densest the price allows, its miss probability in the plan's notes."""
from __future__ import annotations

import dataclasses

import pytest

from planner.solver.audits import (
    EVERY_CHOICES,
    MISS_STEPS,
    MISS_TARGET,
    audit_notes,
    choose_audits,
    miss_probability,
    with_audits,
)
from planner.solver.objective import price_program
from planner.solver.policy import VerificationPolicy
from tests.unit.audit_fixtures import watched


def test_the_miss_probability_of_independent_draws():
    assert (MISS_STEPS, MISS_TARGET, EVERY_CHOICES) == (10, 1e-3, (2, 4, 8, 16))
    assert miss_probability(4, 1) == pytest.approx(0.75 ** 10) == pytest.approx(0.0563, abs=1e-4)
    assert miss_probability(8, 8) == pytest.approx(0.875 ** 80)
    assert miss_probability(1, 1) == 0.0 and miss_probability(4, 0) == 1.0


@pytest.mark.parametrize("microbatches, every", [(8, 4), (16, 8), (32, 16)])
def test_the_sparsest_share_that_meets_the_target_is_chosen(microbatches, every):
    """Per replica 4, 8, 16 microbatches a step: 1 in 4 (8 would miss with 0.5%), 1 in 8, 1 in 16."""
    problem, placement = watched(microbatches=microbatches)
    chosen = choose_audits(problem, placement)
    assert [st.audit_every for st in chosen.stages] == [0, every, 0]
    m = microbatches // 2
    assert miss_probability(every, m) <= MISS_TARGET
    assert every == EVERY_CHOICES[-1] or miss_probability(2 * every, m) > MISS_TARGET
    (note,) = audit_notes(problem, chosen)
    assert f"one microbatch in {every} " in note and "unaudited" not in note, note


def test_one_microbatch_a_replica_takes_one_in_two_and_one_in_four_where_that_is_too_dear():
    problem, placement = watched(microbatches=2)   # one microbatch a replica a step: 1 in 4 would miss 5.6%
    assert miss_probability(2, 1) <= MISS_TARGET < miss_probability(4, 1)
    roomy = dataclasses.replace(problem, policy=VerificationPolicy(audit_cost=0.5))
    assert [st.audit_every for st in choose_audits(roomy, placement).stages] == [0, 2, 0]
    base = price_program(problem, with_audits(placement, {})).step_ms
    priced = {k: price_program(problem, with_audits(placement, {1: k})).step_ms for k in (2, 4)}
    assert priced[2] > priced[4] > base
    tight = dataclasses.replace(problem, policy=VerificationPolicy(audit_cost=(priced[2] + priced[4]) / 2 / base - 1))
    chosen = choose_audits(tight, placement)
    assert [st.audit_every for st in chosen.stages] == [0, 4, 0]
    (note,) = audit_notes(tight, chosen)
    assert note.endswith("; a replica corrupting all its 1 microbatch a step goes unaudited 10 steps with "
                         "probability 5.6% (over 0.1%)"), note


def test_where_the_target_share_is_too_dear_a_sparser_one_is_chosen_and_the_note_says_its_miss():
    problem, placement = watched(microbatches=8)
    base = price_program(problem, with_audits(placement, {})).step_ms
    priced = {k: price_program(problem, with_audits(placement, {1: k})).step_ms for k in EVERY_CHOICES}
    assert priced[4] > priced[8] > base   # a denser share costs more: a budget between them takes 1 in 8
    budget = (priced[4] + priced[8]) / 2 / base - 1
    problem = dataclasses.replace(problem, policy=VerificationPolicy(audit_cost=budget))
    chosen = choose_audits(problem, placement)
    assert [st.audit_every for st in chosen.stages] == [0, 8, 0]
    (note,) = audit_notes(problem, chosen)
    assert "a replica corrupting all its 4 microbatches a step goes unaudited 10 steps with probability 0.48%" \
        in note, note
