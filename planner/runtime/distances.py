"""Pure tensor statistics and distances for the integrity monitors.

A boundary tensor carries a different batch every microbatch, so comparing it
elementwise with an average of earlier tensors measures the data, not the
sender. The monitors compare *distribution summaries* that stay stable across
batches of the same model state instead:

- the per-feature mean and standard deviation over every other dimension
  (tokens, positions, pixels): ``[D]`` each;
- the sorted values of the rows projected on a few fixed random directions,
  read at fixed quantile levels (``[P, Q]``): in one dimension the average of
  quantile functions is the Wasserstein barycenter, so an EMA of these is a
  proper reference distribution for the sliced Wasserstein distance;
- the per-feature skewness ``[D]``: the only batch-stable statistic we found
  that changes sign with the tensor. Gradients of a cross-entropy loss are
  skewed (one large negative logit gradient per token, many small positive
  ones) and keep their skew direction from batch to batch while their mean is
  pure noise: without the stage's input (below), a gradient sign flip shows
  up here and nowhere else;
- the feature covariance (of at most ``MAX_SPECTRAL_DIMS`` random projections
  of the features): trained networks keep their activations and gradients in
  a few principal directions, while added noise, random values or random
  signs spread energy evenly over all of them. The share of a sample's energy
  outside the reference's principal subspace catches noise far below what
  any per-feature statistic can see;
- with the microbatch's labels (token ids, classes; a pure function of the
  step on every rank): a per-label table of mean rows. Activations carry their
  tokens (the residual stream *is* token embedding plus context), gradients
  their targets, so rows predicted by the table of *their own* labels are
  honest, and rows computed from other data (a stale or replayed tensor, a
  fabricated one) are not. This "binding" is the test that catches a worker
  sending correct-looking results for the wrong batch;
- with the stage's input (when the same verifier checks the boundary before
  the sender: its input activations, or the gradients it received): a ridge
  regression from the input rows to the output rows, learnt online from honest
  microbatches. A residual stage's output is almost a linear function of its
  input; an output of other data, a sign flip or noise is not. This "link"
  test needs neither labels nor recomputation, and is the sharpest of all;
- a *sketch*: a fixed random subset of the centred tensor, used only to spot a
  replay of an earlier tensor (the "delay" attack), which no distribution
  statistic can see because an old tensor is a perfectly plausible sample.

Every distance but ``scale`` (the size change itself) is scale free, so one
threshold rule fits activations of size 1 and gradients of size 1e-5 alike.
Functions here are pure: no state, no randomness except from explicit seeds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from planner.errors import InvalidInputError

EPS = 1e-12
# Rows used for quantiles and projections; larger tensors are strided down to
# this many rows, which keeps a check at O(rows * D) however big the tensor.
MAX_QUANTILE_ROWS = 8192
MAX_SPECTRAL_DIMS = 128  # wider features are randomly projected down to this many
SPECTRAL_ENERGY = 0.95   # the principal subspace holds this share of the reference's energy
SKETCH_SIZE = 2048
REPLAY_SCORE_CAP = 12.0  # -log10(1 - cos) of an exact replay, capped
LABEL_BUCKETS = 4096     # label ids are folded into this many rows of the binding table


@dataclass(frozen=True, slots=True, kw_only=True)
class Summary:
    """The distribution summary of one boundary tensor (all float32 CPU tensors).

    ``mean``/``std``/``skew``: per-feature ``[D]``; ``quantiles``: ``[P, Q]`` quantiles of
    the rows projected on the P directions; ``pmean``/``cov``: mean ``[K]`` and
    covariance ``[K, K]`` of the rows in the spectral basis (K = min(D,
    MAX_SPECTRAL_DIMS)); ``sketch``: ``[<= SKETCH_SIZE]`` centred values at
    fixed positions (empty if not requested).
    """

    mean: torch.Tensor
    std: torch.Tensor
    skew: torch.Tensor
    quantiles: torch.Tensor
    pmean: torch.Tensor
    cov: torch.Tensor
    sketch: torch.Tensor

    def __post_init__(self) -> None:
        assert self.mean.shape == self.std.shape and self.mean.dim() == 1, "per-feature stats must be [D]"

    def blend(self, other: "Summary", beta: float) -> "Summary":
        """EMA step ``beta * self + (1 - beta) * other`` (the sketch is not averaged)."""
        return Summary(mean=beta * self.mean + (1 - beta) * other.mean,
                       std=beta * self.std + (1 - beta) * other.std,
                       skew=beta * self.skew + (1 - beta) * other.skew,
                       quantiles=beta * self.quantiles + (1 - beta) * other.quantiles,
                       pmean=beta * self.pmean + (1 - beta) * other.pmean,
                       cov=beta * self.cov + (1 - beta) * other.cov,
                       sketch=other.sketch)


def mean_summary(summaries: Sequence[Summary]) -> Summary:
    """The average of several summaries (a step's microbatches): one less noisy sample."""
    if not summaries:
        raise InvalidInputError("summaries to average", expected="at least one", found="none")
    n = len(summaries)

    def avg(name: str) -> torch.Tensor:
        return sum(getattr(s, name) for s in summaries) / n

    return Summary(mean=avg("mean"), std=avg("std"), skew=avg("skew"), quantiles=avg("quantiles"),
                   pmean=avg("pmean"), cov=avg("cov"), sketch=torch.empty(0))


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """View a tensor as ``[N, D]`` float32 rows of features.

    The feature dimension is the last one, except for 4-D feature maps
    ``[B, C, H, W]`` whose features are the channels.
    """
    if x.dim() == 0 or x.numel() == 0:
        raise InvalidInputError("boundary tensor", expected="a tensor with at least one dimension and element",
                                found=f"shape {tuple(x.shape)}")
    x = x.detach().to(device="cpu", dtype=torch.float32)
    if x.dim() == 4:
        x = x.movedim(1, -1)
    return x.reshape(-1, x.shape[-1])


def feature_size(x: torch.Tensor) -> int:
    """The feature dimension :func:`as_rows` uses, without copying anything."""
    if x.dim() == 0 or x.numel() == 0:
        raise InvalidInputError("boundary tensor", expected="a tensor with at least one dimension and element",
                                found=f"shape {tuple(x.shape)}")
    return int(x.shape[1] if x.dim() == 4 else x.shape[-1])


def random_directions(dim: int, count: int, seed: int) -> torch.Tensor:
    """``[dim, count]`` unit vectors drawn from a fixed seed (the same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    dirs = torch.randn(dim, count, generator=gen)
    return dirs / dirs.norm(dim=0, keepdim=True).clamp_min(EPS)


def quantile_levels(count: int) -> torch.Tensor:
    """Midpoint levels ``(i + 0.5) / count``: equal weight per level."""
    return (torch.arange(count, dtype=torch.float32) + 0.5) / count


def sorted_quantiles(values: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Quantiles of each column of ``values [N, P]`` at ``levels [Q]`` -> ``[P, Q]``.

    Nearest-rank on the sorted column (no interpolation): exact, cheap and
    without ``torch.quantile``'s 16M-element input limit.
    """
    n = values.shape[0]
    ordered = values.sort(dim=0).values
    idx = (levels * n).floor().long().clamp(0, n - 1)
    return ordered[idx].T.contiguous()


def sketch_positions(numel: int, size: int, seed: int) -> torch.Tensor:
    """Fixed pseudo-random flat positions (sorted) of a tensor with ``numel`` elements."""
    if numel <= size:
        return torch.arange(numel)
    gen = torch.Generator().manual_seed(seed + numel)
    return torch.randperm(numel, generator=gen)[:size].sort().values


def spectral_projection(dim: int, seed: int) -> torch.Tensor | None:
    """None (use the features as they are) up to ``MAX_SPECTRAL_DIMS`` features, else a
    fixed ``[dim, MAX_SPECTRAL_DIMS]`` Gaussian projection (it keeps low-rank structure
    low-rank and isotropic noise isotropic, which is all the spectral test needs)."""
    if dim <= MAX_SPECTRAL_DIMS:
        return None
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(dim, MAX_SPECTRAL_DIMS, generator=gen) / math.sqrt(MAX_SPECTRAL_DIMS)


def summarize(x: torch.Tensor, *, directions: torch.Tensor, levels: torch.Tensor,
              spectral: torch.Tensor | None = None, sketch_at: torch.Tensor | None = None) -> Summary:
    """The :class:`Summary` of ``x`` with the given projection directions and levels.

    ``spectral``: the projection from :func:`spectral_projection` (None: identity);
    ``sketch_at``: flat positions from :func:`sketch_positions` (None: no sketch).
    """
    return summarize_rows(x, directions=directions, levels=levels, spectral=spectral, sketch_at=sketch_at)[0]


def summarize_rows(x: torch.Tensor, *, directions: torch.Tensor, levels: torch.Tensor,
                   spectral: torch.Tensor | None = None, sketch_at: torch.Tensor | None = None
                   ) -> tuple[Summary, torch.Tensor]:
    """:func:`summarize`, plus the rows in the spectral basis divided by their RMS (what
    the label table and the stage's linear surrogate predict), from one projection."""
    rows = as_rows(x)
    if directions.shape[0] != rows.shape[1]:
        raise InvalidInputError("projection directions", expected=f"{rows.shape[1]} rows (the feature size)",
                                found=f"{directions.shape[0]}")
    mean = rows.mean(dim=0)
    centred = rows - mean
    var = centred.square().mean(dim=0)
    std = var.sqrt()
    # Features with no spread (a constant input, a dead unit) have no skew: 0.
    skew = centred.pow(3).mean(dim=0) / var.pow(1.5).clamp_min(EPS)
    skew = torch.where(std > EPS ** 0.5 * (mean.abs() + EPS), skew, torch.zeros_like(skew))
    stride = max(1, math.ceil(rows.shape[0] / MAX_QUANTILE_ROWS))
    quantiles = sorted_quantiles(rows[::stride] @ directions, levels)
    if spectral is None:
        prows, pmean, pcentred = rows, mean, centred[::stride]
    else:
        prows = rows @ spectral
        pmean = prows.mean(dim=0)
        pcentred = prows[::stride] - pmean
    cov = pcentred.T @ pcentred / pcentred.shape[0]
    # Centring removes the part every batch shares (the per-feature mean), so two
    # different batches are far apart and only a replay is near-identical.
    sketch = torch.empty(0) if sketch_at is None else centred.reshape(-1)[sketch_at]
    unit = prows / float(prows.square().mean().sqrt().clamp_min(EPS))
    return Summary(mean=mean, std=std, skew=skew, quantiles=quantiles, pmean=pmean, cov=cov, sketch=sketch), unit


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


def label_buckets(labels: torch.Tensor, rows: int) -> torch.Tensor | None:
    """Label ids folded into ``LABEL_BUCKETS``, or None unless there is one integer label per row."""
    if labels.numel() != rows or labels.is_floating_point():
        return None
    return labels.detach().reshape(-1).to("cpu", torch.long) % LABEL_BUCKETS


def label_means(rows: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids [U], mean row per id [U, K], count per id [U])`` of the labels present."""
    ids, inverse = labels.unique(return_inverse=True)
    counts = torch.zeros(ids.numel()).index_add_(0, inverse, torch.ones(labels.numel()))
    sums = torch.zeros(ids.numel(), rows.shape[1]).index_add_(0, inverse, rows)
    return ids, sums / counts[:, None], counts


def binding_parts(rows: torch.Tensor, labels: torch.Tensor, table: torch.Tensor, seen: torch.Tensor,
                  centre: torch.Tensor) -> tuple[float, float]:
    """``(sum ||row - table[label]||^2, sum ||row - centre||^2)`` over rows whose label
    the table has seen; their ratio is the binding score (~0.2-0.5 honest, >= 1 for
    rows of other data: another label's mean is no better a guess than the centre)."""
    known = seen[labels] > 0
    if not bool(known.any()):
        return 0.0, 0.0
    r = rows[known]
    return float((r - table[labels[known]]).square().sum()), float((r - centre).square().sum())


def link_stats(inputs: torch.Tensor, outputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Second moments ``([1 X]^T [1 X] / n, [1 X]^T Y / n)`` of aligned input and output rows:
    what a ridge regression from a stage's input rows to its output rows needs."""
    x1 = torch.cat((inputs, torch.ones(inputs.shape[0], 1)), dim=1)
    return x1.T @ x1 / x1.shape[0], x1.T @ outputs / x1.shape[0]


def link_solve(sxx: torch.Tensor, sxy: torch.Tensor, ridge: float = 1e-2) -> torch.Tensor:
    """The ridge regression weights ``(Sxx + ridge I)^-1 Sxy`` (rows are unit-RMS, so one
    ridge fits every tensor)."""
    eye = torch.eye(sxx.shape[0], dtype=torch.float64)
    return torch.linalg.solve(sxx.double() + ridge * eye, sxy.double()).float()


def link_parts(inputs: torch.Tensor, outputs: torch.Tensor, weights: torch.Tensor) -> tuple[float, float]:
    """``(||Y - [1 X] W||^2, ||Y - mean(Y)||^2)``: their ratio is the share of the output
    the stage's learnt linear surrogate does not explain (~0.01-0.05 for honest
    residual stages, >= 1 for an output of other data, ~4 for a sign flip)."""
    x1 = torch.cat((inputs, torch.ones(inputs.shape[0], 1)), dim=1)
    resid = outputs - x1 @ weights
    return float(resid.square().sum()), float((outputs - outputs.mean(dim=0)).square().sum())


def replay_score(sketch: torch.Tensor, past: torch.Tensor) -> float:
    """``-log10(1 - max cosine)`` between ``sketch [K]`` and the rows of ``past [R, K]``.

    Honest tensors of different batches give a small score (cosine well below
    1); a byte-for-byte replay gives the cap. The log scale separates "0.99
    similar" from "identical" by orders of magnitude.
    """
    if past.numel() == 0 or sketch.numel() == 0:
        return 0.0
    norms = past.norm(dim=1) * sketch.norm()
    cos = ((past @ sketch) / norms.clamp_min(EPS)).clamp(0.0, 1.0)
    gap = float(1.0 - cos.max())
    return min(REPLAY_SCORE_CAP, -math.log10(max(gap, 10.0 ** -REPLAY_SCORE_CAP)))


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
``spectral`` (needs the reference's principal basis), ``binding`` and ``link``
(learnt predictors) and ``replay`` (a history of sketches) are computed by the
monitor from the functions above."""
