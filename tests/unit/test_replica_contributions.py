"""Replicas check each other (issue 37): the gradient-contribution monitor and the centered-clipping sum."""
from __future__ import annotations

import math

import jsonschema
import pytest
import torch

from planner.errors import InvalidInputError
from planner.integrity.attacks import Attacker, parse_attack
from planner.integrity.blame import FLAG_EVENTS_SCHEMA, blame_weights
from planner.integrity.contributions import (
    BEFORE_STEPS,
    SKETCH_SIZE,
    SUSPECT_H,
    ContributionMonitor,
    sketch,
)
from planner.integrity.robust_reduce import centered_clip, clip_radius
from planner.integrity.verifier import Verifier
from planner.verifier_config import VerifierConfig

DIM = 2000


def honest(gen: torch.Generator, step: int, trend: torch.Tensor) -> torch.Tensor:
    """One replica's gradient: a slowly shrinking shared direction plus its own data's, its size varying ~1.5x."""
    size = math.exp(-0.02 * step + 0.3 * float(torch.randn((), generator=gen)))
    own = torch.randn(DIM, generator=gen)
    return size * (0.3 * trend + own / own.norm())


def run(steps: int, *, attack=None, start: int = 30, replicas: int = 2, seed: int = 0) -> list[dict]:
    """Every flag event of ``steps`` steps; ``attack`` rewrites replica 1's contribution from ``start``."""
    gen = torch.Generator().manual_seed(seed)
    trend = torch.randn(DIM, generator=gen)
    trend /= trend.norm()
    mon, events = ContributionMonitor(seed=seed), []
    for step in range(steps):
        parts = {r: honest(gen, step, trend) for r in range(1, replicas + 1)}
        if attack is not None and step >= start:
            parts[1] = attack(parts[1])
        events += mon.check(1, parts, step=step)
    return events


def test_a_sketch_keeps_the_norm_and_reads_a_sign_flip():
    x = torch.randn(10_000)
    a, b = sketch(x, seed=3), sketch(-x, seed=3)
    assert a.shape == (SKETCH_SIZE,) and float(a[0]) == pytest.approx(float(x.norm()))
    assert float(a[2:] @ b[2:]) / float(a[2:].norm() * b[2:].norm()) == pytest.approx(-1.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_honest_replicas_are_not_flagged_often_and_never_banned(seed):
    events = run(200, seed=seed)
    for e in events:
        jsonschema.validate([e], FLAG_EVENTS_SCHEMA)
    assert len(events) <= 4   # at most 1% of the 400 (step, replica) pairs: under the ban test's honest rate


@pytest.mark.parametrize(("factor", "seed"), [(3.0, 0), (3.0, 1), (0.25, 2)])
def test_a_rescaled_contribution_is_flagged_on_its_sender_not_its_twin(factor, seed):
    events = run(40, attack=lambda g: factor * g, seed=seed)
    late = [e for e in events if e["step"] >= 30]
    assert late and {e["sender"] for e in late} == {1}
    assert min(e["step"] for e in late) <= 34
    assert all(blame_weights([e])[1] == math.inf for e in late)   # a whole step of its own evidence


def test_with_three_replicas_the_odd_one_out_is_flagged():
    late = [e for e in run(40, attack=lambda g: 4.0 * g, replicas=3) if e["step"] >= 30]
    assert late and {e["sender"] for e in late} == {1}


def test_a_non_finite_contribution_is_flagged_at_once():
    events = run(3, attack=lambda g: g * math.nan, start=1)
    assert {(e["step"], e["sender"], tuple(e["reasons"])) for e in events} == \
        {(1, 1, ("contrib_nonfinite",)), (2, 1, ("contrib_nonfinite",))}


def test_a_twin_made_non_finite_by_the_poisoned_sum_is_not_flagged():
    mon, ok, bad = ContributionMonitor(), sketch(torch.ones(50), seed=0), torch.full((SKETCH_SIZE,), math.nan)
    assert [e["sender"] for e in mon.judge(1, {1: bad, 2: ok}, step=0)] == [1]
    assert [e["sender"] for e in mon.judge(1, {1: bad, 2: bad}, step=1)] == [1]


def test_a_sketch_of_the_wrong_size_is_refused():
    with pytest.raises(InvalidInputError, match="sketch"):
        ContributionMonitor().judge(1, {1: torch.zeros(3), 2: torch.zeros(3)}, step=0)


def test_centered_clipping_sums_agreeing_replicas_and_bounds_an_outlier():
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(500, generator=gen)
    a, b = base + 0.1 * torch.randn(500, generator=gen), base + 0.1 * torch.randn(500, generator=gen)
    assert torch.allclose(centered_clip([a, b], reference=(a + b) / 2), a + b, atol=1e-5)
    poisoned = [a, -100.0 * b]
    plain = (a + poisoned[1] - (a + b)).norm()
    robust = (centered_clip(poisoned, reference=base, history_radius=float((a - base).norm()))
              - (a + b)).norm()
    assert robust < 0.05 * plain


def test_centered_clipping_leaves_out_a_non_finite_contribution():
    a = torch.ones(8)
    out = centered_clip([a, torch.full((8,), math.inf), a])
    assert torch.isfinite(out).all()


def test_the_clip_radius_is_the_median_distance_capped_by_history():
    assert clip_radius([1.0, 3.0, 100.0]) == 3.0
    assert clip_radius([1.0, 100.0], history=2.0) == 3.0
    with pytest.raises(InvalidInputError):
        clip_radius([])


def test_an_all_reduce_poisoning_attack_targets_the_contribution_only():
    spec = parse_attack("rank=1,kind=scale,factor=3,dir=params")
    assert spec.targets("params") and not spec.targets("act")
    assert not parse_attack("rank=1,kind=zeros,dir=both").targets("params")
    x = torch.ones(5)
    assert torch.equal(Attacker(spec).apply(x, direction="params", step=0, mb=0), 3 * x)
    with pytest.raises(InvalidInputError, match="dir=params"):
        parse_attack("rank=1,kind=delay,dir=params")


def test_a_replica_whose_offset_grows_is_a_suspect_until_an_audit_vouches_for_it():
    gen = torch.Generator().manual_seed(0)
    trend = torch.randn(DIM, generator=gen)
    mon = ContributionMonitor(seed=0)
    for step in range(40):
        parts = {r: honest(gen, step, trend) for r in (1, 3)}
        if step >= 30:
            parts[1] = 3.0 * parts[1]
        mon.check(1, parts, step=step)
    assert 1 in mon.suspects(1) and SUSPECT_H < 5.0
    mon.vouch(1, 1)
    assert 1 not in mon.suspects(1)
    mon.vouch(7, 1)   # a stage it never saw: nothing to restart


@pytest.mark.parametrize(("factor", "seed"), [(3.0, 0), (3.0, 1), (0.25, 2)])
def test_a_contribution_flag_says_since_when_its_evidence_ran_and_the_ban_resumes_from_before_it(factor, seed):
    """The alarm comes a step or more after the onset, whose update already took the poisoned sum in: recovery
    must resume from before the onset, not the first flag."""
    late = [e for e in run(40, attack=lambda g: factor * g, seed=seed) if e["step"] >= 30]
    first = min(late, key=lambda e: e["step"])
    since = first.get("since", first["step"])
    assert 30 - BEFORE_STEPS <= since <= 30 < first["step"], first   # a CUSUM may leave 0 on honest noise first
    jsonschema.validate([first], FLAG_EVENTS_SCHEMA)
    v = Verifier(VerifierConfig().to_dict(), [(0, "grad")])
    for step in range(first["step"], first["step"] + 12):
        v.end_step(step, [[{**first, "step": step}]])
    (ban,) = [e for e in v.events if e["type"] == "ban"]
    assert ban["first_flagged_step"] == since, ban
