"""The audit lookback: where a ban's recovery resumes, and which checkpoints stay for it (random schedules)."""
from __future__ import annotations

import math
import random

import pytest

from planner.errors import InvalidInputError
from planner.integrity.lookback import RUNGS, Lookback, audit_steps
from planner.runtime.recovery.checkpoint import KEEP

ATTACKER = 1


def test_audit_steps_is_the_fewest_whose_miss_chance_is_under_eps():
    for every, m in [(2, 1), (4, 1), (4, 2), (8, 3), (16, 1)]:
        d = audit_steps(every, m, 1e-3)
        assert (1 - 1 / every) ** (m * d) <= 1e-3 < (1 - 1 / every) ** (m * (d - 1))
    assert audit_steps(4, 1, 1e-3) == 25 and audit_steps(2, 1, 1e-3) == 10
    assert audit_steps(1, 5) == 1   # every microbatch audited: the first attacked step is flagged
    with pytest.raises(InvalidInputError):
        audit_steps(0, 1)


def test_without_audits_a_resume_is_the_newest_checkpoint_before_the_first_flag():
    plain = Lookback()
    assert plain.resume_bound({3: 10}) == 9 and plain.resume_bound({}) == math.inf
    audited = Lookback.of({ATTACKER: (4, 1)}, lag=1)
    assert audited.resume_bound({ATTACKER: 30}) == 30 - 25        # 25 steps of audits (the lag: retention's only)
    assert audited.resume_bound({ATTACKER: 30, 3: 2}) == 1        # the earliest of the bans'
    assert audited.resume_bound({ATTACKER: 5}) == -1              # before the first step: the run starts again


def test_a_late_verdict_costs_retention_not_the_resume_bound():
    """The attack's latest first audit within the guarantee (``D - 1`` steps after its start), its verdict a step
    late but reported at the audited step: the resume is the step before the attack, not one more (the lag was
    counted twice); retention still looks ``D + lag - 1`` steps back for a flag not yet known."""
    look = Lookback.of({ATTACKER: (2, 1)}, lag=1)
    d, start = audit_steps(2, 1), 40
    assert look.resume_bound({ATTACKER: start + d - 1}) == start - 1
    assert look.horizon == d and look.bounds(start + d - 1, {}) == {start - 1}


def _audited_steps(rng: random.Random, every: int, m: int, steps: int) -> list[bool]:
    return [any(rng.random() < 1 / every for _ in range(m)) for _ in range(steps)]


def _simulate(seed: int) -> dict:
    """One run: an attack from step ``a`` on every microbatch of the attacker, flagged by the first audit that
    draws one (or earlier by a monitor), known up to ``lag`` steps late but reported at its flagged step (a late
    verdict names its audited step: ``audit.late_audit_event``'s ``since``); checkpoints every ``e`` steps,
    pruned by the rule each time; the ban stops the run and resumes from the newest kept checkpoint at or
    before the bound."""
    rng = random.Random(seed)
    every, m, e, lag = rng.choice([2, 4, 8]), rng.choice([1, 2]), rng.choice([1, 2, 3, 5, 9]), rng.choice([0, 1])
    look = Lookback.of({ATTACKER: (every, m), 3: (every, m)}, lag=1)   # rank 3: an honest twin, never flagged
    a = rng.randrange(0, 80)
    audited = _audited_steps(rng, every, m, a + 400)
    hit = next(s for s in range(a, len(audited)) if audited[s])
    flag = min(hit, a + rng.randrange(0, hit - a + 1)) if rng.random() < 0.3 else hit
    reported, known = flag, flag + lag
    ban = known + rng.randrange(0, 6)
    kept: list[int] = []
    taken: list[int] = []
    most = 0
    for c in range(ban):
        unresolved = {ATTACKER: reported} if known <= c else {}
        if (c + 1) % e == 0:
            taken.append(c)
            kept = sorted(look.keep(kept + [c], now=c, unresolved=unresolved, newest=KEEP))
            most = max(most, len(kept) - len(unresolved))
            for bound in look.bounds(c, unresolved):   # a kept one at most a window and an interval before each bound
                near = max((s for s in kept if s <= bound), default=-1)
                assert near >= min(max(s for s in taken if s <= bound) if taken[0] <= bound else -1,
                                   bound - look.spacing - e + 1), (c, bound, kept)
    bound = look.resume_bound({ATTACKER: reported})
    resumed = max((s for s in kept if s <= bound), default=-1)
    newest_taken = max((s for s in taken if s <= bound), default=-1)
    return {"a": a, "hit": hit, "d": audit_steps(every, m), "resumed": resumed, "bound": bound,
            "newest_taken": newest_taken, "spacing": look.spacing, "e": e, "most": most}


@pytest.mark.parametrize("chunk", range(4))
def test_random_schedules_resume_before_the_attack_with_bounded_checkpoints_and_redo(chunk):
    caught = 0
    for seed in range(chunk * 500, (chunk + 1) * 500):
        run = _simulate(seed)
        assert run["most"] <= KEEP + RUNGS + 3                 # checkpoints kept besides the unresolved flags'
        if run["hit"] - run["a"] < run["d"]:                  # the audits drew one of the attack's within D
            caught += 1
            assert run["resumed"] < run["a"], run             # the resumed state holds no attacked step
        # the redo beyond the bound: at most a window of the ladder and a checkpoint interval
        assert run["resumed"] >= min(run["newest_taken"], run["bound"] - run["spacing"] - run["e"] + 1), run
    assert caught >= 495   # eps = 1e-3 a run


def test_the_old_rule_resumes_into_the_attack_under_sampled_audits():
    """Before: the newest checkpoint before the first flag held attacked steps whenever an audit missed the
    attack's first step (at 1 in 4, one microbatch a step: 3 runs in 4)."""
    dirty = sum(_first_flag_rule(seed) for seed in range(400))
    assert 250 < dirty < 350


def _first_flag_rule(seed: int) -> bool:
    rng = random.Random(seed)
    a = rng.randrange(0, 80)
    audited = _audited_steps(rng, 4, 1, a + 400)
    hit = next(s for s in range(a, len(audited)) if audited[s])
    return Lookback().resume_bound({ATTACKER: hit}) >= a


def _audited_plan(every: int):
    """mlp-tiny in 3 stages, the middle one on two untrusted replicas of 4 microbatches each a step (as
    tests/dist/test_runtime_audit_copies), audited one in ``every``."""
    import dataclasses

    from planner.verifier_config import VerifierConfig
    from tests.dist.plans import make_plan

    plan = make_plan("mlp-tiny", microbatch=2, num_microbatches=8, stages=[(0, 1), (2, 3), (4, 5)],
                     replicas={1: (4, 4)}, untrusted=(1, 2), optimizer="adam",
                     verifiers=[(0, 0, ("act", "grad")), (1, 3, ("act", "grad"))],
                     verifier_config=VerifierConfig(warmup=50))
    return dataclasses.replace(plan, stages=tuple(dataclasses.replace(st, audit_every=every if st.index == 1 else 0)
                                                  for st in plan.stages))


def test_the_runtime_lookback_is_the_plans_audited_replicas_and_sets_aside_past_the_bound():
    from planner.runtime.recovery import retention
    from planner.runtime.wire.bans import BanNotice

    plan = _audited_plan(4)
    look = retention.plan_lookback(plan, audit_every=None, verifying=True)
    assert look.back == {1: audit_steps(4, 4), 2: audit_steps(4, 4)} == {1: 7, 2: 7}
    assert retention.plan_lookback(plan, audit_every=2, verifying=True).back == {1: 3, 2: 3}
    assert retention.plan_lookback(plan, audit_every=0, verifying=True).back == {}
    assert retention.plan_lookback(plan, audit_every=None, verifying=False).back == {}
    # the survivors' settling asks the run's auditors: none where the run audits nothing
    assert retention.plan_auditors(plan) == retention.plan_auditors(plan, audit_every=2) != frozenset()
    assert retention.plan_auditors(plan, audit_every=0) == retention.plan_auditors(plan, verify=False) == frozenset()
    ban = BanNotice(rank=1, first_flagged_step=20, ban_step=21)
    assert retention.set_aside_from(look, [ban]) == 14                    # checkpoints after steps 14.. set aside
    assert retention.set_aside_from(Lookback(), [ban]) == 20              # unaudited: from the first flag on
    assert retention.set_aside_from(look, [BanNotice(rank=1, first_flagged_step=3, ban_step=4)]) == 0
