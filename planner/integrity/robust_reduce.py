"""A Byzantine-robust sum of the replicas' gradient contributions: centered clipping.

Centered clipping (Karimireddy, He and Jaggi, "Learning from History for Byzantine Robust Optimization",
ICML 2021): from a reference ``v`` (the stage's recent honest contribution),
``v <- v + mean_i((x_i - v) * min(1, tau / |x_i - v|))``: a replica moves the result by at most ``tau / n``. Chosen over the coordinate-wise median and the
trimmed mean because those need at least three replicas to outvote one (a stage here has two or three)
and cost a sort per coordinate, while centered clipping is a few vector passes, works with two replicas
(whatever one replica sends) and converges under
a bounded share of Byzantine replicas given a reference from history (the paper's momentum).

Every replica computes the same result from the same gathered contributions, so it needs an all-gather
(``n`` times an all-reduce's bytes received) instead of the all-reduce.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from planner.errors import InvalidInputError

__all__ = ["CLIP_ITERS", "centered_clip", "clip_radius"]

# One pass (the paper's analysis holds for one with a reference from history): once every point is within
# ``tau`` of ``v`` another pass jumps to their plain mean, so more passes give an outlier back its pull.
CLIP_ITERS = 1
HISTORY_FACTOR = 1.5   # the radius is at most this many times the stage's honest radius seen so far


def _median(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """The coordinate-wise median of ``rows``, the mean of the middle two for an even count (two replicas:
    their mean; ``torch.median`` would give the lower)."""
    ordered = torch.stack(list(rows)).sort(dim=0).values
    mid = len(rows) // 2
    return ordered[mid] if len(rows) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def clip_radius(distances: Sequence[float], history: float | None = None) -> float:
    """The clipping radius: the median of the contributions' distances to the reference, at most
    ``HISTORY_FACTOR`` times the stage's honest radius seen so far (``history``; with two replicas the median
    is their mean, which a large outlier drags up)."""
    if not distances:
        raise InvalidInputError("centered clipping distances", expected="at least one", found="none")
    ordered = sorted(float(d) for d in distances)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])
    if history is not None and math.isfinite(history) and history > 0.0:
        median = min(median, HISTORY_FACTOR * history)
    return median


def centered_clip(contributions: Sequence[torch.Tensor], *, reference: torch.Tensor | None = None,
                  tau: float | None = None, history_radius: float | None = None,
                  iters: int = CLIP_ITERS) -> torch.Tensor:
    """The robust *sum* of ``contributions`` (flat tensors of one shape): ``n`` times their centered-clipped
    mean, so that with honest, agreeing replicas it is close to the plain sum the all-reduce gives.

    ``reference``: where clipping starts, a *mean* contribution (the stage's history; default: the
    coordinate-wise median, which for two replicas is their mean). ``tau``: the radius (default
    :func:`clip_radius` of the distances to ``reference``, capped by ``history_radius``)."""
    if not contributions:
        raise InvalidInputError("centered clipping contributions", expected="at least one tensor", found="none")
    rows = [c.detach().reshape(-1).float() for c in contributions]
    kept = [r for r in rows if bool(torch.isfinite(r).all())]
    if not kept:
        raise InvalidInputError("centered clipping contributions", expected="at least one finite tensor",
                                found="every contribution has nan or inf")
    rows = kept   # a non-finite contribution can only be a fault or an attack: left out
    n = len(contributions)
    v = _median(rows) if reference is None else reference.detach().reshape(-1).float()
    if v.shape != rows[0].shape:
        raise InvalidInputError("centered clipping reference", expected=f"{rows[0].numel()} elements",
                                found=str(v.numel()))
    diffs = [r - v for r in rows]
    if tau is None:
        tau = clip_radius([float(d.norm()) for d in diffs], history_radius)
    for i in range(iters):   # a row at a time: a stacked copy and its reductions across rows cost 3x the passes
        if i:
            diffs = [r - v for r in rows]
        step = torch.zeros_like(v)
        for diff in diffs:
            dist = float(diff.norm())
            step.add_(diff, alpha=(tau / max(dist, 1e-30) if dist > tau else 1.0) / len(rows))
        v = v + step
    return (n * v).to(contributions[0].dtype).reshape(contributions[0].shape)
