"""Scale-free distances between a boundary tensor's summary and its monitor's reference.

The summaries are ``summaries``' (per-feature moments, projected quantiles, skew, covariance,
sketch). Every distance but ``scale`` (the size change itself) is scale free, so one threshold
rule fits activations of size 1 and gradients of size 1e-5 alike. Functions here are pure.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from planner.errors import InvalidInputError
from planner.integrity.summaries import EPS, Summary, as_numpy, random_directions

SPECTRAL_ENERGY = 0.95   # the principal subspace holds this share of the reference's energy


def rms(s: Summary) -> float:
    """Root mean square of the summarised tensor's elements, from its per-feature
    moments: ``sqrt(mean_d(mean_d^2 + std_d^2))``."""
    return float((s.mean.square() + s.std.square()).mean().sqrt())


def shape(s: Summary) -> torch.Tensor:
    """The per-feature (mean, std) vector divided by the tensor's RMS: its shape
    without its overall size (all zeros for an all-zero tensor)."""
    return torch.cat((s.mean, s.std)) / max(rms(s), EPS)


def mean_abs_diff(x: Summary, ref: Summary) -> float:
    """Mean absolute difference of the shapes (:func:`shape`) of sample and reference,
    divided by the mean absolute value of the reference's: 0 = same statistics
    up to a scale factor, 1 = nothing in common (e.g. an all-zero tensor).
    Size is left to :func:`scale_change`: honest gradients swing in size from
    batch to batch far more than in shape."""
    a, b = shape(x), shape(ref)
    return float((a - b).abs().mean() / b.abs().mean().clamp_min(EPS))


def normalized_l2(x: Summary, ref: Summary) -> float:
    """``||shape(x) - shape(ref)|| / ||shape(ref)||`` (see :func:`mean_abs_diff`)."""
    a, b = shape(x), shape(ref)
    return float((a - b).norm() / b.norm().clamp_min(EPS))


def log_size_change(x: Summary, ref: Reference) -> float:
    """``ln(rms(x) / rms(ref))``, signed: the e-folds by which the tensor grew (< 0: shrank)
    since the reference. A stage's own share of a size change is its output's minus its
    input's (``Monitor.score``): a loss spike's gradients grow on their way back through
    every stage, and each stage only passes on, and amplifies, what it received."""
    return log_size(x) - ref.log_rms


def log_size(x: Summary) -> float:
    """``ln(rms(x))``: with a stage's input's, its log gain (``Monitor.score``)."""
    return math.log(_size(as_numpy(x.mean), as_numpy(x.std)))


def scale_change(x: Summary, ref: Summary) -> float:
    """``|ln(rms(x) / rms(ref))|``: how many e-folds the tensor's overall size moved
    (an all-zero tensor scores ``-ln(EPS)`` = 27.6)."""
    return abs(math.log(max(rms(x), EPS)) - math.log(max(rms(ref), EPS)))


def sign_flip_ratio(x: Summary, ref: Summary) -> float:
    """Share of the reference's per-feature mean mass whose sign the sample flips.

    Each feature weighs ``|ref mean|``: features whose mean is near zero flip
    sign by chance between honest batches and should not count. A sign flip of
    the whole tensor scores 1, an all-zero tensor scores 1 too (zero is not the
    reference's sign).
    """
    weight = ref.mean.abs()
    flipped = torch.sign(x.mean) != torch.sign(ref.mean)
    return float((weight * flipped).sum() / weight.sum().clamp_min(EPS))


def skew_flip(x: Summary, ref: Summary) -> float:
    """``(1 - cos(skew(x), skew(ref))) / 2``: 0 when the per-feature skewness points
    the same way as the reference's, 1 when it is mirrored (a sign flip), 0.5
    when it is unrelated or absent (a constant or zero tensor has no skew)."""
    a, b = x.skew, ref.skew
    denom = (a.norm() * b.norm()).clamp_min(EPS)
    return float((1.0 - (a @ b) / denom) / 2.0)


def sliced_wasserstein(x: Summary, ref: Summary) -> float:
    """Sliced 1-Wasserstein distance between the rows of the sample and the
    reference distribution, each divided by its RMS (size is :func:`scale_change`'s
    business), in units of the reference's mean absolute deviation on the same
    slices (so 1.0 = moved by one typical spread)."""
    if x.quantiles.shape != ref.quantiles.shape:
        raise InvalidInputError("quantile summaries", expected=f"shape {tuple(ref.quantiles.shape)}",
                                found=f"shape {tuple(x.quantiles.shape)}")
    qx = x.quantiles / max(rms(x), EPS)
    qr = ref.quantiles / max(rms(ref), EPS)
    w1 = (qx - qr).abs().mean()
    spread = (qr - qr.mean(dim=1, keepdim=True)).abs().mean()
    return float(w1 / spread.clamp_min(EPS))


def principal_basis(cov: torch.Tensor, energy: float = SPECTRAL_ENERGY) -> torch.Tensor:
    """``[K, r]``: the fewest eigenvectors of ``cov`` holding ``energy`` of its trace."""
    values, vectors = torch.linalg.eigh(cov.double())
    values, vectors = values.flip(0).clamp_min(0.0), vectors.flip(1)
    total = float(values.sum())
    if total <= 0.0:
        return vectors[:, :0].float()
    rank = int((values.cumsum(0) / total < energy).sum()) + 1
    return vectors[:, :rank].float()


def spectral_residual(x: Summary, ref: Summary, basis: torch.Tensor) -> float:
    """Share of the sample's energy (around the reference mean) outside ``basis``,
    the reference's principal subspace. From the summaries alone:
    ``E||P(x - mu)||^2 = tr(P C_x P) + ||P(m_x - mu)||^2`` with P the complement."""
    shift = x.pmean - ref.pmean
    total = torch.trace(x.cov) + shift @ shift
    if float(total) <= EPS:
        return 0.0
    inside = torch.trace(basis.T @ x.cov @ basis) + (shift @ basis).square().sum()
    return float(((total - inside) / total).clamp(0.0, 1.0))


@dataclass(frozen=True, slots=True, kw_only=True)
class Reference:
    """A reference :class:`Summary` with the parts of every distance to it that do not
    depend on the sample, computed once: a reference moves once per step, and is
    scored against by every microbatch of it. :func:`summary_scores` uses it.

    The vectors are numpy arrays: scoring a summary is some forty operations on
    vectors of a few hundred values, where numpy's per-call cost is a fraction of
    torch's. Only elementwise numpy is used (no BLAS call: numpy's BLAS may start its
    own threads, which on a loaded machine costs more than it saves); the matrix
    products of the spectral test stay in torch."""

    summary: Summary
    log_rms: float
    shape: np.ndarray           # shape(summary)
    shape_abs: float            # mean |shape|, at least EPS
    shape_norm: float           # ||shape||, at least EPS
    sign: np.ndarray            # sign of the per-feature means
    weight: np.ndarray          # |mean| / sum |mean| (the sign-flip weights)
    skew: np.ndarray
    skew_norm: float
    quantiles: np.ndarray       # quantiles / rms
    spread: float               # their mean absolute deviation per slice, at least EPS
    basis: torch.Tensor | None  # principal subspace of the covariance (None: not needed)
    projector: np.ndarray | None = None   # basis @ basis.T: the spectral test in elementwise numpy
    pmean: np.ndarray | None = None       # the summary's pmean, as numpy




def _size(mean: np.ndarray, std: np.ndarray) -> float:
    return max(math.sqrt(float(np.square(mean).sum() + np.square(std).sum()) / mean.size), EPS)


def _norm(v: np.ndarray) -> float:
    return math.sqrt(float(np.square(v).sum()))


def reference(ref: Summary, *, spectral: bool = True, basis: torch.Tensor | None = None) -> Reference:
    """The :class:`Reference` of ``ref``. ``spectral``: also its principal basis, the given
    ``basis`` if any (a basis computed from a recent reference: the principal subspace
    moves far more slowly than the EMA, and an eigendecomposition costs more than a
    check), else :func:`principal_basis` of its covariance."""
    mean, std = as_numpy(ref.mean), as_numpy(ref.std)
    size = _size(mean, std)
    shape_vec = np.concatenate((mean, std)) / size
    weight = np.abs(mean)
    quantiles = as_numpy(ref.quantiles) / size
    skew = as_numpy(ref.skew)
    if spectral and basis is None:
        basis = principal_basis(ref.cov)
    return Reference(summary=ref, log_rms=math.log(size), shape=shape_vec,
                     shape_abs=max(float(np.abs(shape_vec).mean()), EPS),
                     shape_norm=max(_norm(shape_vec), EPS),
                     sign=np.sign(mean), weight=weight / max(float(weight.sum()), EPS),
                     skew=skew, skew_norm=_norm(skew), quantiles=quantiles,
                     spread=max(float(np.abs(quantiles - quantiles.mean(axis=1, keepdims=True)).mean()), EPS),
                     basis=basis if spectral else None,
                     projector=as_numpy(basis @ basis.T) if spectral and basis is not None else None,
                     pmean=as_numpy(ref.pmean))


SUMMARY_DISTANCES = ("mad", "l2", "scale", "sign", "skew", "swd", "spectral")


def summary_scores(x: Summary, ref: Reference, names: Sequence[str] = SUMMARY_DISTANCES) -> dict[str, float]:
    """The distances among ``names`` (of :data:`SUMMARY_DISTANCES`) from ``x`` to ``ref``, in
    one pass: the same values as :func:`mean_abs_diff`, :func:`normalized_l2`,
    :func:`scale_change`, :func:`sign_flip_ratio`, :func:`skew_flip`,
    :func:`sliced_wasserstein` and :func:`spectral_residual` (up to float rounding), at
    a fraction of the cost: each distance's own function re-derives the sample's size
    and the reference's terms, and a check of a small tensor is dominated by the
    number of operations, not by their size."""
    out: dict[str, float] = {}
    mean, std = as_numpy(x.mean), as_numpy(x.std)
    size = _size(mean, std)
    if "mad" in names or "l2" in names:
        diff = np.concatenate((mean, std)) / size - ref.shape
        if "mad" in names:
            out["mad"] = float(np.abs(diff).mean()) / ref.shape_abs
        if "l2" in names:
            out["l2"] = _norm(diff) / ref.shape_norm
    if "scale" in names:
        out["scale"] = abs(math.log(size) - ref.log_rms)
    if "sign" in names:
        out["sign"] = float(ref.weight[np.sign(mean) != ref.sign].sum())
    if "skew" in names:
        skew = as_numpy(x.skew)
        denom = max(_norm(skew) * ref.skew_norm, EPS)
        out["skew"] = (1.0 - float((skew * ref.skew).sum()) / denom) / 2.0
    if "swd" in names:
        if tuple(x.quantiles.shape) != ref.quantiles.shape:
            raise InvalidInputError("quantile summaries", expected=f"shape {ref.quantiles.shape}",
                                    found=f"shape {tuple(x.quantiles.shape)}")
        out["swd"] = float(np.abs(as_numpy(x.quantiles) / size - ref.quantiles).mean()) / ref.spread
    if "spectral" in names:
        assert ref.projector is not None, "the reference was prepared without its principal basis"
        # With P = basis basis^T: tr(B^T C B) = sum(P * C), ||B^T s||^2 = s^T P s.
        shift, cov = as_numpy(x.pmean) - ref.pmean, as_numpy(x.cov)
        total = float(np.trace(cov)) + float(np.square(shift).sum())
        inside = float((ref.projector * cov).sum()) + float(((ref.projector * shift).sum(axis=1) * shift).sum())
        out["spectral"] = 0.0 if total <= EPS else min(1.0, max(0.0, (total - inside) / total))
    return out


def sliced_wasserstein_samples(a: torch.Tensor, b: torch.Tensor, *, projections: int = 16,
                               seed: int = 0) -> float:
    """Unnormalised sliced 1-Wasserstein distance between two equal-size sets of
    rows (``[N, D]`` each): the average over random unit directions of the 1-D
    W1 distance of the projected samples. Reference helper for tests and tools."""
    if a.shape != b.shape or a.dim() != 2:
        raise InvalidInputError("sample sets", expected="two [N, D] tensors of the same shape",
                                found=f"{tuple(a.shape)} and {tuple(b.shape)}")
    dirs = random_directions(a.shape[1], projections, seed)
    pa = (a.float() @ dirs).sort(dim=0).values
    pb = (b.float() @ dirs).sort(dim=0).values
    return float((pa - pb).abs().mean())


DISTANCES = {
    "mad": mean_abs_diff,
    "l2": normalized_l2,
    "scale": scale_change,
    "sign": sign_flip_ratio,
    "skew": skew_flip,
    "swd": sliced_wasserstein,
}
"""Distances between a sample's summary and the reference summary, by config name.
``spectral`` (needs the reference's principal basis) is computed by the monitor
from the functions above; ``binding``, ``link``, ``residual`` (learnt
predictors) and ``replay`` (a history of sketches) from ``predictors``."""
