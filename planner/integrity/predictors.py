"""Learnt predictors of honest boundary tensors, and the replay score (pure functions).

``distances`` compares a sample's distribution summary with a reference; the
tests here instead predict the sample's *rows* from something the sender does
not control, so they catch data that is plausible in distribution but not the
data the sender was given:

- binding: a per-label table of mean rows (labels are a pure function of the
  step on every rank): rows of another batch are not predicted by their own
  labels' means;
- link: a ridge regression from the stage's input rows to its output rows,
  learnt online from honest microbatches, and its residual's shape
  (``residual_shape``): what the stage did not compute spreads over every
  direction;
- replay: the cosine of a fixed random sketch of the tensor with the sketches
  of earlier tensors (the "delay" attack).

No state here: the monitors (``verify``) keep the tables, moments and rings.
"""
from __future__ import annotations

import hashlib
import math

import torch

from planner.integrity.summaries import EPS

REPLAY_SCORE_CAP = 12.0  # -log10(1 - cos) of an exact replay, capped
LABEL_BUCKETS = 4096     # label ids are folded into this many rows of the binding table
RESIDUAL_RIDGE = 0.1     # whitening ridge, in units of the honest residuals' average eigenvalue
# The learnt predictors may be off in *size* by up to this factor either way. At d=256, lr 1e-3, an
# honest loss spike made a stage amplify its gradients differently from what its surrogate had
# learnt: the output pointed where the surrogate said (cosine ~0.9) at 0.6-0.8 times its size, a
# link share of 0.35-0.65 (fence 0.3), and once flagged those samples never taught the surrogate,
# which fell further behind (8 steps of flags, a ban). A gain within the bound is not evidence of
# corruption: gains beyond it are (the scale test, with its e-fold floor, is the test of size);
# a sign flip, zeros, noise and other data are as far from a rescaled guess as from the guess.
PREDICTOR_GAIN = 1.5


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
    r = rows[known] - centre
    guess = table[labels[known]] - centre
    return float((r - predictor_gain(r, guess) * guess).square().sum()), float(r.square().sum())


def predictor_gain(target: torch.Tensor, guess: torch.Tensor, bound: float = PREDICTOR_GAIN) -> float:
    """The least-squares gain of ``guess`` for ``target`` (``<target, guess> / <guess, guess>``),
    clamped to ``[1 / bound, bound]``: a predictor that points the right way but is off in
    size by less than ``bound`` is scored as if it had the size right (see ``PREDICTOR_GAIN``);
    a guess pointing elsewhere or the other way gets the bound's edge, no help."""
    energy = float(guess.square().sum())
    if energy <= EPS:
        return 1.0
    return min(bound, max(1.0 / bound, float((target * guess).sum()) / energy))


def link_stats(inputs: torch.Tensor, outputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Second moments ``([1 X]^T [1 X] / n, [1 X]^T Y / n)`` of aligned input and output rows:
    what a ridge regression from a stage's input rows to its output rows needs."""
    return _moments(_with_ones(inputs), outputs)


def _with_ones(inputs: torch.Tensor) -> torch.Tensor:
    return torch.cat((inputs, torch.ones(inputs.shape[0], 1)), dim=1)


def _moments(x1: torch.Tensor, outputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x1.T @ x1 / x1.shape[0], x1.T @ outputs / x1.shape[0]


def link_solve(sxx: torch.Tensor, sxy: torch.Tensor, ridge: float = 1e-2) -> torch.Tensor:
    """The ridge regression weights ``(Sxx + ridge I)^-1 Sxy`` (rows are unit-RMS, so one
    ridge fits every tensor)."""
    eye = torch.eye(sxx.shape[0], dtype=torch.float64)
    return torch.linalg.solve(sxx.double() + ridge * eye, sxy.double()).float()


def link_parts(inputs: torch.Tensor, outputs: torch.Tensor, weights: torch.Tensor
               ) -> tuple[float, float, torch.Tensor]:
    """``(||Y - [1 X] W||^2, ||Y - mean(Y)||^2, R^T R)`` with ``R = Y - [1 X] W`` the residual:
    the first two's ratio is the share of the output the stage's learnt linear
    surrogate does not explain (~0.01-0.05 for honest residual stages, >= 1 for an
    output of other data, ~4 for a sign flip); the residual's second moment ``[K, K]``
    is what :func:`residual_shape` scores."""
    return _parts(_with_ones(inputs), outputs, weights)


def _parts(x1: torch.Tensor, outputs: torch.Tensor, weights: torch.Tensor) -> tuple[float, float, torch.Tensor]:
    guess = x1 @ weights
    resid = outputs - predictor_gain(outputs, guess) * guess
    moment = resid.T @ resid
    return float(moment.trace()), centred_energy(outputs), moment


def centred_energy(rows: torch.Tensor) -> float:
    """``||rows - mean(rows)||^2``: the link share's denominator (the sample's own variation)."""
    return float((rows - rows.mean(dim=0)).square().sum())


def link_fit(inputs: torch.Tensor, outputs: torch.Tensor, weights: torch.Tensor | None
             ) -> tuple[tuple[float, float, torch.Tensor] | None, tuple[torch.Tensor, torch.Tensor]]:
    """:func:`link_parts` (None without ``weights``) and :func:`link_stats` of one sample,
    sharing their ``[1 X]``."""
    x1 = _with_ones(inputs)
    return (None if weights is None else _parts(x1, outputs, weights)), _moments(x1, outputs)


def residual_whitener(reference: torch.Tensor, ridge: float = RESIDUAL_RIDGE) -> torch.Tensor:
    """``[K, K]``: the inverse of the honest residuals' shape (their second moment divided
    by its trace), ridged by ``ridge`` times the average eigenvalue and scaled so that
    a residual of exactly the reference's shape scores 1 in :func:`residual_shape`."""
    k = reference.shape[0]
    ref = reference.double() / reference.trace().double().clamp_min(EPS)
    values, vectors = torch.linalg.eigh(ref)
    values = values.clamp_min(0.0)
    inverse = 1.0 / (values + ridge / k)
    norm = float((values * inverse).sum())
    return ((vectors * (inverse / max(norm, EPS))) @ vectors.T).float()


def residual_shape(moment: torch.Tensor, whitener: torch.Tensor) -> float:
    """``tr(A M) / tr(M)``: the whitened energy of a sample's link residual (``moment``, from
    :func:`link_parts`) relative to honest residuals' (``A`` from :func:`residual_whitener`).

    What a stage's linear surrogate leaves unexplained is the stage's own
    nonlinearity, which lives in a few directions; anything the stage did not
    compute (noise, another batch's rows, a blend toward either) spreads over
    all directions, including those where honest residuals have almost no
    energy. ~1 for honest samples, 5-10 for noise at 1% of the tensor's energy,
    far below what the link share itself (:func:`link_parts`) can see."""
    total = float(moment.trace())
    if total <= EPS:
        return 0.0
    return float((whitener * moment).sum()) / total


def replay_score(sketch: torch.Tensor, past: torch.Tensor, past_norms: torch.Tensor | None = None) -> float:
    """``-log10(1 - max cosine)`` between ``sketch [K]`` and the rows of ``past [R, K]``
    (``past_norms``: their norms, if known).

    Honest tensors of different batches give a small score (cosine well below
    1); a byte-for-byte replay gives the cap. The log scale separates "0.99
    similar" from "identical" by orders of magnitude.
    """
    if past.numel() == 0 or sketch.numel() == 0:
        return 0.0
    norms = (past.norm(dim=1) if past_norms is None else past_norms) * sketch.norm()
    cos = ((past @ sketch) / norms.clamp_min(EPS)).clamp(0.0, 1.0)
    gap = float(1.0 - cos.max())
    return min(REPLAY_SCORE_CAP, -math.log10(max(gap, 10.0 ** -REPLAY_SCORE_CAP)))


def sketch_fingerprint(sketch: torch.Tensor) -> int:
    """A 64-bit digest of a sketch's exact values: a replayed tensor gives back its own sketch
    bit for bit (``summaries.summarize_rows``), an honest one never repeats another's."""
    return _digest(sketch, torch.float32)


def ids_fingerprint(ids: torch.Tensor) -> int:
    """A 64-bit digest of a microbatch's label ids: which data a boundary tensor was computed from."""
    return _digest(ids, torch.int64)


def _digest(t: torch.Tensor, dtype: torch.dtype) -> int:
    data = t.detach().to("cpu", dtype).contiguous().numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
