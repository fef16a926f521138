"""Which fence excesses of one received tensor make a flag.

A monitor scores each sample with a dozen distances and fences each one
(``thresholds``). Honest training puts one of them a little over its fence now
and then, and a distribution can move for honest reasons; these rules keep
both from being read as corruption, and are pure functions of the scores and
the fences.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

from planner.integrity.thresholds import IQRFence

# The tests of a tensor's distribution alone. An output that the stage's learnt surrogate
# predicts from the stage's input (link share under LINK_VOUCH times its fence, residual shape
# within its fence) is what the stage computed from what it was given: when only these tests
# object to it, the distribution moved (a loss spike, a stage that changes fast), not the data.
# At d=256, lr 1e-3, an honest spike moved one stage's gradient spectrum past its fence for good:
# flagged samples never teach the reference, so it could not catch up (352 of 380 samples
# flagged). Scale stays out: the link reads unit rows, blind to a gain; sign flips, other data,
# replays and biases are what the link itself sees.
SHIFT_TESTS = frozenset({"mad", "l2", "swd", "spectral", "skew", "sign"})
LINK_VOUCH = 0.5
# One microbatch over one fence by a little is what honest training does now and then: a dozen
# tests, each with a tail, on a stage that changes at every step (d=256, lr 1e-3: the link at
# 1.2-2.0x its fence for a few steps after a loss spike, the residual at 1.5x, the label table
# at 1.05x, the scale at 1.0-1.7x, the spectral share at 1.2x, each alone). Dropping those
# samples also starves the references and predictors of the very samples they must learn the
# change from, and the monitor locks out (a stale surrogate flags more, and learns less, until
# the drift test bans the honest stage). Every attack of the benchmark scores either several
# tests over their fences at once or one far over it (link 3.6-52x on replays, sign flips and
# biases, scale 25x on zeros). A sample flagged by one test below GROSS times its fence is held
# instead: it counts in its step's average, whose fences are tighter (``step_floors``), and a
# sender whose step fails is blamed for it. A replay above its fence is a copy: proof alone.
GROSS = 2.5
DECISIVE = frozenset({"replay"})
# A fence fit over the warm-up reads a model that changed fast (gpt-tiny, lr 1e-3: loss 5.6 -> 4.9 in five steps),
# and for the first steps after it a sample of honest data can clear it by a product just over GROSS: the one
# honest drop of every seed-0 run of ``verification_dist.py`` (step 6, spectral 2.2x and mad 1.17x its fence: 2.6;
# 6 of its 23 clean runs' 16 flags, the others scattered over steps 18-179). For YOUNG_STEPS steps after the
# warm-up, one sample is dropped only at YOUNG_GROSS times that product; below it, it is held for its step's
# average (whose fences are tighter), as any sample under GROSS is.
YOUNG_STEPS = 5
YOUNG_GROSS = 2.0
# Where no verifier sees a stage's input (verifiers split across its boundaries), nothing vouches for
# a shift of the shape of its output: a stage's honest change reads as one. In the split placement of
# the emulation (4 microbatches a step, lr 1e-3) the gradients rank 1 sends grew 2.4x and changed
# shape at a loss wave (spectral share 0.04 -> 0.33, swd 1.2-1.5x its fence, seeds 2 and 3) and stayed
# so: its steps were flagged for 277 and 349 steps running and it was banned; seed 0's moved for 8 steps
# (spectral 1.1-1.6x its fence) and it was banned too. A bias of 0.3 of the activations' size scores
# the same (spectral 1.0-2.0x). Such a step-level flag is an alert: its step teaches the reference
# (so the monitor follows the change) and blames nobody; a ban needs a test that tells a stage from
# its corruption (the link, the label table, the size and sign tests, a replay, a gross microbatch).
UNLINKED_SHIFT = frozenset({"mad", "l2", "swd", "spectral", "skew"})


def flag_reasons(scores: Mapping[str, float], fences: Mapping[str, IQRFence], *,
                 per_sample: bool = True, gross: float = GROSS) -> tuple[str, ...]:
    """The distances that flag the sample (empty: it passes or, per sample, is held for its
    step's average), given its ``scores`` and the ``fences`` it is judged on (a step's
    average: one distance over its fence is enough there)."""
    reasons = tuple(name for name, value in scores.items() if fences[name].exceeds(value))
    if reasons and SHIFT_TESTS.issuperset(reasons) and vouched(scores, fences):
        return ()
    if per_sample and reasons and not convincing(scores, reasons, fences, gross=gross):
        return ()
    return reasons


def alert_only(scores: Mapping[str, float], reasons: tuple[str, ...] | list[str]) -> bool:
    """True for a step's flag by shape tests alone on a monitor without the stage's input (no
    ``link`` score): an alert, no evidence against the sender (see ``UNLINKED_SHIFT``)."""
    return bool(reasons) and UNLINKED_SHIFT.issuperset(reasons) and "link" not in scores


def vouched(scores: Mapping[str, float], fences: Mapping[str, IQRFence]) -> bool:
    """True when the stage's surrogate explains the sample (see ``SHIFT_TESTS``). A step's average
    is vouched for as its samples are, on their fence (a step's own link fence is capped by it and
    often tighter): else an honest shift the surrogate explains sample by sample fails as a step."""
    fence = fences.get("link")
    limit = fence.fence() if fence is not None and "link" in scores else None
    if limit is not None and fence is not None and fence.fallback is not None:
        twin = fence.fallback.fence()
        limit = limit if twin is None else max(limit, twin)
    return limit is not None and scores["link"] <= LINK_VOUCH * limit


def convincing(scores: Mapping[str, float], reasons: tuple[str, ...], fences: Mapping[str, IQRFence], *,
               gross: float = GROSS) -> bool:
    """Whether one sample's fence excesses are enough to drop it: a test that is proof alone
    (``DECISIVE``), or excesses that multiply to ``GROSS`` or more (each test's score over its
    fence; one test alone: ``GROSS`` times its fence, see ``GROSS``).

    Not "two tests over": the tests come in related pairs (mad and l2, link and residual, spectral
    and residual), so two small excesses were often one excess counted twice (figures:
    benchmarks/README.md, tuning notes)."""
    if DECISIVE.intersection(reasons):
        return True
    excess = 0.0
    for name in reasons:
        limit, value = fences[name].fence(), scores[name]
        if limit is None:
            continue
        if not math.isfinite(value) or limit <= 0.0:
            return True     # over a zero fence, or not a number: no finite ratio can excuse it
        excess += math.log(value / limit)
    return excess >= math.log(gross)
