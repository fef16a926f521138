"""Distribution summaries of boundary tensors for the integrity monitors (pure functions).

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
  test needs neither labels nor recomputation. Its *residual* is sharper
  still: what the surrogate leaves unexplained is the stage's nonlinearity,
  confined to a few directions, while anything the stage did not compute
  spreads over all of them (``residual_shape``);
- a *sketch*: a fixed random subset of the centred tensor, used only to spot a
  replay of an earlier tensor (the "delay" attack), which no distribution
  statistic can see because an old tensor is a perfectly plausible sample.

The distances between a summary and a reference are ``distances``; the learnt
predictors (binding, link, residual) and the replay score ``predictors``.
Functions here are pure: no state, no randomness except from explicit seeds.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from planner.errors import InvalidInputError

EPS = 1e-12
# Rows used for everything but the per-feature mean and the sketch (which see every row):
# the per-feature spread and skew, the quantiles, the projections, the covariance and the
# learnt predictors. Larger tensors are subsampled to this many rows (a fresh subset per
# microbatch, see :func:`row_subset`), which keeps a check at one read of the tensor plus
# a constant. A subset's noise lifts the honest link residual score (d=256, 256 of 384 rows:
# ~1.3-1.6 vs ~1.0-1.2) and moves it from step to step; when the drift test summed it per
# microbatch that set it off (~150 flags in 60 clean steps); counted once per step, none.
MAX_PROJECTED_ROWS = 1024
# Wider features are randomly projected down to this many. The covariance, the link
# regression and both eigendecompositions cost O(K^2)-O(K^3) per check or step: 128 cost
# ~1.2x per check at d=384-768. Not fewer: at d=256, 64 let the adaptive attack through
# for 4 steps (F1 0.91; 96 and 128: 1.0, caught at once).
MAX_SPECTRAL_DIMS = 96
SKETCH_SIZE = 2048
# Every statistic but the sketch (and a subsampled tensor's per-feature mean) sees each row's energy capped at this
# many times the median nonzero row's. Honest gradient rows are heavy-tailed: in a tiny HF Llama (3 stages, 40 steps) the
# first token's row (the attention sink) held 0.1-2000x the median row's energy (99th percentile 200x), other
# positions up to 150x (99.9th: 30x); one sink row at 1144x was 93% of its microbatch's energy and failed the size,
# spectral and label tests together (a dropped honest microbatch, issue 37). Capped, it counts as a heavy row, not
# as the whole tensor. Every corruption of the attack suite moves all rows together (a scale or noise moves the
# median with them), so none is hidden; a corruption of a few rows, which no honest-looking heavy row can be told
# from, is seen at this weight.
ROW_ENERGY_CAP = 16.0


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

    def blend(self, other: Summary, beta: float) -> Summary:
        """EMA step ``beta * self + (1 - beta) * other`` (the sketch is not averaged)."""
        def mix(name: str) -> torch.Tensor:   # numpy: a tenth of torch's cost per call on small arrays
            return torch.from_numpy(beta * as_numpy(getattr(self, name)) + (1 - beta) * as_numpy(getattr(other, name)))

        return Summary(mean=mix("mean"), std=mix("std"), skew=mix("skew"), quantiles=mix("quantiles"),
                       pmean=mix("pmean"), cov=mix("cov"), sketch=other.sketch)


def mean_summary(summaries: Sequence[Summary]) -> Summary:
    """The average of several summaries (a step's microbatches): one less noisy sample."""
    if not summaries:
        raise InvalidInputError("summaries to average", expected="at least one", found="none")
    n = len(summaries)

    def avg(name: str) -> torch.Tensor:
        return torch.from_numpy(sum(as_numpy(getattr(s, name)) for s in summaries) / n)

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
    idx = _rank_index(values.shape[0], levels)
    if values.device.type == "cpu" and values.dtype in (torch.float32, torch.float64):
        # numpy's vectorised sort is 6-16x faster than torch's on CPU at these sizes (512 x 16: 0.02 vs 0.35 ms)
        ordered = torch.from_numpy(np.sort(values.detach().T.numpy(), axis=1))
        return ordered.index_select(1, idx)
    ordered = values.sort(dim=0).values
    return ordered.index_select(0, idx).T.contiguous()


def _rank_index(n: int, levels: torch.Tensor) -> torch.Tensor:
    # The same few (n, levels) pairs come back every check: keep their indices (and
    # the levels tensor itself, so that its id cannot be reused by another one).
    cached = _RANK_INDEX.get((n, id(levels)))
    if cached is not None and cached[0] is levels:
        return cached[1]
    idx = (levels * n).floor().long().clamp(0, n - 1)
    if len(_RANK_INDEX) < 64:
        _RANK_INDEX[(n, id(levels))] = (levels, idx)
    return idx


_RANK_INDEX: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def stable_mix(*parts: int) -> int:
    """A 63-bit seed from integers, the same in every process (``hash`` of a tuple is
    not salted for ints, but this does not depend on that)."""
    acc = 0x9E3779B97F4A7C15
    for part in parts:
        acc = (acc ^ (int(part) & 0xFFFFFFFFFFFFFFFF)) * 0x100000001B3 & 0xFFFFFFFFFFFFFFFF
    return acc & ((1 << 63) - 1)


def row_subset(rows: int, seed: int, count: int = MAX_PROJECTED_ROWS) -> torch.Tensor | None:
    """Sorted indices of ``count`` of ``rows`` rows drawn from ``seed``, or None (use them all)
    when there are no more than ``count``. A verifier draws a fresh subset per
    microbatch (the seed mixes in step and microbatch) and uses the same subset on
    every boundary of that microbatch, so a stage's input and output rows stay aligned."""
    if rows <= count:
        return None
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(rows, generator=gen)[:count].sort().values


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
              spectral: torch.Tensor | None = None, sketch_at: torch.Tensor | None = None,
              subset: torch.Tensor | None = None) -> Summary:
    """The :class:`Summary` of ``x`` with the given projection directions and levels.

    ``spectral``: the projection from :func:`spectral_projection` (None: identity);
    ``sketch_at``: flat positions from :func:`sketch_positions` (None: no sketch);
    ``subset``: the rows used for everything but the per-feature mean and the
    sketch (from :func:`row_subset`; None: every row).
    """
    return summarize_rows(x, directions=directions, levels=levels, spectral=spectral, sketch_at=sketch_at,
                          subset=subset)[0]


def summarize_rows(x: torch.Tensor, *, directions: torch.Tensor, levels: torch.Tensor,
                   spectral: torch.Tensor | None = None, sketch_at: torch.Tensor | None = None,
                   subset: torch.Tensor | None = None) -> tuple[Summary, torch.Tensor]:
    """:func:`summarize`, plus the (``subset`` of the) rows in the spectral basis divided
    by their RMS (what the label table and the stage's linear surrogate predict),
    from one projection."""
    rows = as_rows(x)
    if directions.shape[0] != rows.shape[1]:
        raise InvalidInputError("projection directions", expected=f"{rows.shape[1]} rows (the feature size)",
                                found=f"{directions.shape[0]}")
    # The mean sees every row (one read): the sketch is centred by it, and a replayed tensor
    # must give back its own sketch exactly, whichever subset its second arrival draws.
    mean = rows.mean(dim=0)
    some = rows if subset is None else rows.index_select(0, subset)
    capped = cap_heavy_rows(some)
    if capped is not None:
        some = capped
    # Capped rows are centred on their own mean (the summary's, for every row: a subset's heavy rows are
    # diluted in the mean of its thousands of rows).
    centre = some.mean(dim=0) if capped is not None else mean
    centred = some - centre
    power = centred.square()
    var = power.mean(dim=0)
    std = var.sqrt()
    # Features with no spread (a constant input, a dead unit) have no skew: 0. The cube
    # overwrites the square: one [rows, D] temporary less (a third of the moments' time).
    skew = power.mul_(centred).mean(dim=0) / (var * std).clamp_min(EPS)
    skew = torch.where(std > EPS ** 0.5 * (centre.abs() + EPS), skew, torch.zeros_like(skew))
    # One product for the quantile directions and the spectral basis: one pass over the rows.
    both = some @ _projection(directions, spectral)
    count = directions.shape[1]
    quantiles = sorted_quantiles(both[:, :count], levels)
    if spectral is None:
        prows = some
        pmean = centre if subset is None else some.mean(dim=0)
        pcentred = centred if subset is None else some - pmean
    else:
        prows = both[:, count:]
        pmean = prows.mean(dim=0)
        pcentred = prows - pmean
    cov = pcentred.T @ pcentred / pcentred.shape[0]
    # Centring removes the part every batch shares (the per-feature mean), so two
    # different batches are far apart and only a replay is near-identical.
    sketch = torch.empty(0) if sketch_at is None else _sketch(rows, mean, sketch_at)
    unit = prows / (cov.trace() + pmean.square().sum()).div(prows.shape[1]).sqrt().clamp_min(EPS)
    return Summary(mean=centre if subset is None else mean, std=std, skew=skew, quantiles=quantiles, pmean=pmean,
                   cov=cov, sketch=sketch), unit


def cap_heavy_rows(rows: torch.Tensor, cap: float = ROW_ENERGY_CAP) -> torch.Tensor | None:
    """``rows`` with each row's energy capped at ``cap`` times the median nonzero row's (see
    ``ROW_ENERGY_CAP``), or None when no row is over it (the common case: nothing copied)."""
    energy = torch.linalg.vector_norm(rows, dim=1).square()
    nonzero = energy[energy > 0]
    if nonzero.numel() == 0:
        return None
    limit = cap * float(nonzero.median())
    top = float(energy.max())
    if not top > limit or not math.isfinite(top):
        return None     # (a NaN or inf is left for the verifier's own test of it)
    return rows * (limit / energy.clamp_min(limit)).sqrt()[:, None]


def _projection(directions: torch.Tensor, spectral: torch.Tensor | None) -> torch.Tensor:
    """``[D, P (+ K)]``: the quantile directions, then the spectral projection if any (the
    concatenation is kept: a monitor passes the same two tensors every check)."""
    if spectral is None:
        return directions
    cached = _PROJECTIONS.get((id(directions), id(spectral)))
    if cached is not None and cached[0] is directions and cached[1] is spectral:
        return cached[2]
    both = torch.cat((directions, spectral), dim=1)
    if len(_PROJECTIONS) >= 64:
        _PROJECTIONS.clear()
    _PROJECTIONS[(id(directions), id(spectral))] = (directions, spectral, both)
    return both


_PROJECTIONS: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _sketch(rows: torch.Tensor, mean: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The values of ``rows`` at flat ``positions``, each minus its feature's mean."""
    return torch.take(rows, positions) - torch.take(mean, positions % rows.shape[1])


def as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()
