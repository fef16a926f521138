"""The records a monitor keeps of one sample: its evidence for the learnt predictors (``Fit``) and, once
it passed its own checks, the sample held until its step closes (``Sample``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from planner.integrity import summaries as summ

__all__ = ["Fit", "Sample"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Fit:
    """One sample's evidence for a learnt predictor of its rows (``binding``: the
    label table; ``link``: the linear surrogate of the sending stage): the energy
    the predictor leaves unexplained, the energy around the centre, what the
    sample adds to the predictor if it is accepted and (``link`` only) the
    residual's second moment ``[K, K]`` (None before the surrogate exists) and
    the stage input's signed size change (``distances.log_size_change``; None
    before the input's monitor had a reference) and the stage's log gain on this sample
    (``ln rms(output) - ln rms(input)``)."""

    num: float
    den: float
    update: tuple[torch.Tensor, ...]
    moment: torch.Tensor | None = None
    input_dlog: float | None = None
    input_sender: int | None = None   # who sent the stage's input (None: a trusted sender, watched)
    gain: float | None = None
    spread: float | None = None       # the sample's own centred energy per row (``den`` before LINK_SPREAD_FLOOR)


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """A sample that passed its own checks, held until its step closes."""

    sender: int
    summary: summ.Summary
    scores: dict[str, float]
    fits: dict[str, Fit]
    data_key: int | None = None
    mb: int | None = None   # its microbatch (None: unknown, never vouched for by an audit)
