"""Whom a monitor's failed step is laid on: the sender of its input (``upstream_culprit``), the stage its
replicas share (``shared_by_twins``), or no one, where audits vouched for every sample (``vouched``)."""
from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence

from planner.integrity import evidence
from planner.integrity.fits import Fit, Sample
from planner.integrity.thresholds import IQRFence

__all__ = ["LINKED_REASONS", "TWIN_SHARE", "UPSTREAM_EFOLDS", "shared_by_twins", "upstream_culprit", "vouched"]

# A replica's step that fails a test its twin's step scores at least this share of the fence on moved with its
# twin: after an attacker's ban (issue 37's shape, adaptive attack, seed 2) both replicas' steps failed the
# label-binding test by 1.2-1.9x its fence, by turns, for 20 steps (flagged steps teach nothing, so the
# reference never caught up) and the honest twin was banned.
TWIN_SHARE = 0.8
# The link-derived tests judge a stage's output against a surrogate of its input; fed an input whose
# size moved this many e-folds from its reference (0.35: -30% or +42%; damping by 0.5 is 0.69), they
# judge the input, not the stage.
UPSTREAM_EFOLDS = 0.35
LINKED_REASONS = frozenset({"link", "residual", "drift"})


def shared_by_twins(sender: int, reasons: tuple[str, ...],
                    judged: Mapping[int, tuple[dict[str, float], tuple[str, ...], bool]],
                    step_fences: Mapping[str, IQRFence]) -> bool:
    """True when every test ``sender``'s step fails is also near its fence (``TWIN_SHARE``) on a twin's
    step: the replicas of one stage share its weights and differ only by data, so a move they all
    make is the stage's (or its input's), not one replica's corruption."""
    twins = [scores for other, (scores, _, _) in judged.items() if other != sender]
    if not twins or evidence.DECISIVE.intersection(reasons):
        return False
    for name in reasons:
        limit = step_fences[name].fence() if name in step_fences else None
        if limit is None or not any(TWIN_SHARE * limit <= s.get(name, 0.0) < math.inf for s in twins):
            return False
    return True


def vouched(sender: int, samples: Sequence[Sample], audited: Collection[tuple[int, int]]) -> bool:
    """Whether an audit passed on every one of ``samples`` (``sender``'s step average): then its step is what the
    stage computes from its inputs, and a step-level failure of its own is the statistics' error (one laid on its
    input's sender stands: the audit says nothing of the input). A sample of unknown microbatch is never vouched
    for. The price: a corruption within the audit's tolerance (``audit.TOLERANCE``) on an audited step is no longer
    the step test's to catch. Issue 37 (``verification_twins.py``, 1 in 2, attack at 40, seed 2): after the
    re-plan the honest twin's gradient step means failed the sign test alone at 16 of the 34 steps from 46 on,
    every one of its microbatches audited and passing from 47, and it was banned at 60 on the statistics alone;
    its failed steps never taught the reference, which could not follow."""
    return bool(samples) and all(x.mb is not None and (sender, x.mb) in audited for x in samples)


def upstream_culprit(fits: Sequence[Mapping[str, Fit]], reasons: Sequence[str]) -> int | None:
    """The sender of the flagged samples' input when only link-derived tests failed and that input
    (untrusted, as the samples saw it) moved more than ``UPSTREAM_EFOLDS`` in size: a stage that damps
    or inflates what it sends just under its own fences makes the honest stage after it fail its
    link test, and the blame is the input's. None otherwise."""
    links = [f.get("link") for f in fits]
    if not reasons or not set(reasons) <= LINKED_REASONS or any(
            f is None or f.input_dlog is None or f.input_sender is None for f in links):
        return None
    if abs(sum(f.input_dlog for f in links) / len(links)) <= UPSTREAM_EFOLDS:
        return None
    senders = [f.input_sender for f in links]
    return max(set(senders), key=senders.count)
