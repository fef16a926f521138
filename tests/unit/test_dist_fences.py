"""The size test where the verifier sees one side of a stage only (issue 37's HF Llama shape): its fence is read
against the trend of the tensors' size (``thresholds.TrendLevel``), so a boundary whose honest size keeps moving
early in training still catches a sender that rescales what it sends."""
from __future__ import annotations

import math

import pytest
import torch

from planner.errors import InvalidInputError
from planner.integrity.attacks import Attacker, parse_attack
from planner.integrity.contributions import ContributionMonitor
from planner.integrity.thresholds import TrendLevel
from planner.integrity.verifier import Verifier
from tests.unit.test_contribution_sign_noise import START, flip, train

torch.set_num_threads(1)

D, RANK, ROWS, MBS = 32, 4, 64, 3
GROWTH = 0.06          # e-folds a step: what the HF Llama's activations grew in its first 30 steps


def _stream(seed: int):
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(RANK, D, generator=gen)

    def sample(step: int) -> torch.Tensor:
        latent = torch.randn(ROWS, RANK, generator=gen)
        noise = 0.05 * torch.randn(ROWS, D, generator=gen)
        return (latent @ mix + noise) * math.exp(GROWTH * step)

    return sample


def _run(steps: int, attack: str | None, *, seed: int = 0) -> tuple[dict[int, list[dict]], set[int]]:
    verifier = Verifier({"warmup": 5}, [(1, "act")])
    attacker = Attacker(parse_attack(attack), seed=seed) if attack else None
    sample = _stream(seed)
    flags: dict[int, list[dict]] = {}
    for step in range(steps):
        for mb in range(MBS):
            x = sample(step)
            if attacker is not None:
                x = attacker.apply(x, direction="act", step=step, mb=mb)
            verifier.check(1, "act", x, step=step, mb=mb, sender=1)
        flags[step] = verifier.flag_events(step)
        verifier.end_step(step, [flags[step]])
    return flags, verifier.banned


def test_trend_level_follows_a_steady_trend() -> None:
    trend = TrendLevel()
    assert trend.predict(0) is None
    for step in range(12):
        # an EMA of 0.1 e-folds a step lags it by 0.3-0.4; the trend by under half a step's move once settled
        assert step < 8 or abs(trend.predict(step) - 0.1 * step) < 0.05
        trend.learn(step, 0.1 * step)
    # steps that teach nothing carry the slope on, damped: below the straight line's 4.0, above the last level
    assert 1.2 < trend.predict(40) < 4.0 - 0.5


def test_trend_level_ignores_non_finite_values_and_rejects_bad_smoothing() -> None:
    trend = TrendLevel()
    trend.learn(0, 1.0)
    trend.learn(1, math.nan)
    trend.learn(2, 1.0)
    assert trend.predict(3) == pytest.approx(1.0)
    with pytest.raises(InvalidInputError):
        TrendLevel(alpha=0.0)


def test_a_growing_honest_stream_is_never_flagged() -> None:
    flags, banned = _run(60, None)
    assert not banned
    assert not [e for events in flags.values() for e in events if "scale" in e["reasons"]]


@pytest.mark.parametrize("attack", ["rank=1,kind=scale,factor=0.5,start=20",
                                    "rank=1,kind=scale,factor=2,start=20"])
def test_a_rescaled_sender_on_a_growing_stream_is_banned_within_ten_steps(attack: str) -> None:
    flags, banned = _run(31, attack)
    assert banned == {1}
    first = min(s for s, events in flags.items() if any("scale" in e["reasons"] for e in events))
    assert first == 20


def _contributions(steps: int, *, start: int, low: float, seed: int = 0) -> list[dict]:
    """Three replicas' flag events: replica 3 honest but its norm ``low`` times its twins' all along (an offset
    that alarms and is never attributed: no level moved), replica 1 tripling its contribution from ``start``."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randn(2000, generator=gen)
    shared /= shared.norm()
    mon, events = ContributionMonitor(seed=seed), []
    for step in range(steps):
        parts = {}
        for r in (1, 2, 3):
            own = torch.randn(2000, generator=gen)
            size = math.exp(0.2 * float(torch.randn((), generator=gen))) * (low if r == 3 else 1.0)
            parts[r] = size * (0.5 * shared + own / own.norm())
        if step >= start:
            parts[1] = 3.0 * parts[1]
        events += mon.check(1, parts, step=step)
    return events


def test_a_tripled_replica_is_flagged_though_an_honest_twin_s_offset_alarmed_long_before() -> None:
    events = _contributions(40, start=30, low=0.7)
    assert not [e for e in events if e["sender"] != 1]
    flagged = sorted(e["step"] for e in events)
    assert flagged and flagged[0] <= 33 and len(flagged) >= 5


@pytest.mark.parametrize(("lr", "seed"), [(0.05, 5), (0.1, 3)])
def test_a_flip_whose_twins_barely_agreed_with_the_history_is_flagged_on_a_decisive_lead(lr: float, seed: int) -> None:
    # the lead on the whole history is decisive before the part since the onset agrees (was START + 10 / + 19)
    events = train(60, attack=flip, seed=seed, lr=lr)
    assert events and {e["sender"] for e in events} == {1}
    assert min(e["step"] for e in events) <= START + 6
