"""The audit share the planner chooses (``planner.solver.audits``): the sparsest of ``EVERY_CHOICES`` under which
an attacking replica goes unaudited the policy's ``audit_within_steps`` with probability at most ``MISS_TARGET``,
else the densest the price allows, its miss probability in the plan's notes."""
from __future__ import annotations

import dataclasses

import pytest

from planner.solver.audits import (
    EVERY_CHOICES,
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
    assert (VerificationPolicy().audit_within_steps, MISS_TARGET, EVERY_CHOICES) == (10, 1e-3, (1, 2, 4, 8, 16))
    assert miss_probability(4, 1, 10) == pytest.approx(0.75 ** 10) == pytest.approx(0.0563, abs=1e-4)
    assert miss_probability(8, 8, 10) == pytest.approx(0.875 ** 80)
    assert miss_probability(1, 1, 1) == 0.0 and miss_probability(4, 0, 10) == 1.0
    assert miss_probability(2, 1, 1) == 0.5 and miss_probability(2, 10, 1) == pytest.approx(2 ** -10)


@pytest.mark.parametrize("microbatches, every", [(8, 4), (16, 8), (32, 16)])
def test_the_sparsest_share_that_meets_the_target_is_chosen(microbatches, every):
    """Per replica 4, 8, 16 microbatches a step: 1 in 4 (8 would miss with 0.5%), 1 in 8, 1 in 16."""
    problem, placement = watched(microbatches=microbatches)
    chosen = choose_audits(problem, placement)
    assert [st.audit_every for st in chosen.stages] == [0, every, 0]
    m = microbatches // 2
    assert miss_probability(every, m, 10) <= MISS_TARGET
    assert every == EVERY_CHOICES[-1] or miss_probability(2 * every, m, 10) > MISS_TARGET
    (note,) = audit_notes(problem, chosen)
    assert f"one microbatch in {every} " in note and "unaudited" not in note, note


def test_one_microbatch_a_replica_takes_one_in_two_and_one_in_four_where_that_is_too_dear():
    problem, placement = watched(microbatches=2)   # one microbatch a replica a step: 1 in 4 would miss 5.6%
    assert miss_probability(2, 1, 10) <= MISS_TARGET < miss_probability(4, 1, 10)
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
                         "probability 5.6% (over 0.1%; --audit-within)"), note


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


def test_within_one_step_audits_every_microbatch_where_the_price_allows_and_the_note_says_what_it_misses():
    """``audit_within_steps=1``: with one microbatch a replica a step only 1 in 1 meets the target, at a full
    recompute's price; where ``audit_cost`` does not cover it the next share is taken and the note says so."""
    problem, placement = watched(microbatches=2)
    base = price_program(problem, with_audits(placement, {})).step_ms
    priced = {k: price_program(problem, with_audits(placement, {1: k})).step_ms for k in (1, 2)}
    assert priced[1] > priced[2] > base
    roomy = dataclasses.replace(problem, policy=VerificationPolicy(audit_cost=priced[1] / base, audit_within_steps=1))
    chosen = choose_audits(roomy, placement)
    assert [st.audit_every for st in chosen.stages] == [0, 1, 0]
    (note,) = audit_notes(roomy, chosen)
    assert "every microbatch (" in note and "unaudited" not in note, note
    default = dataclasses.replace(problem, policy=dataclasses.replace(roomy.policy, audit_within_steps=10))
    assert [st.audit_every for st in choose_audits(default, placement).stages] == [0, 2, 0]   # cheaper, meets 10
    tight = dataclasses.replace(problem, policy=VerificationPolicy(audit_cost=(priced[1] + priced[2]) / 2 / base - 1,
                                                                   audit_within_steps=1))
    chosen = choose_audits(tight, placement)
    assert [st.audit_every for st in chosen.stages] == [0, 2, 0]
    (note,) = audit_notes(tight, chosen)
    assert note.endswith("goes unaudited 1 step with probability 50% (over 0.1%; --audit-within)"), note


@pytest.mark.parametrize("steps", [0, 1001, 2.5, True])
def test_a_bad_audit_within_is_refused_with_its_fix(steps):
    from planner.errors import InvalidInputError
    with pytest.raises(InvalidInputError, match="--audit-within"):
        VerificationPolicy(audit_within_steps=steps)
