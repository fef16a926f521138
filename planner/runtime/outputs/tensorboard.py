"""Rank 0's optional TensorBoard log (``--tensorboard DIR``): per step the training loss, the learning
rate and the step time, and the validation loss where one was measured, through
``torch.utils.tensorboard.SummaryWriter`` (the ``tensorboard`` package is optional)."""
from __future__ import annotations

import math

from planner.errors import InvalidInputError
from planner.runtime.rank.metrics import StepSummary


def summary_writer_class() -> type:
    """torch's SummaryWriter, or a one-line error saying how to get the package it needs."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise InvalidInputError("--tensorboard", expected="the tensorboard package installed",
                                found="it cannot be imported", fix="pip install tensorboard") from None
    return SummaryWriter


class Board:
    """Writes StepSummaries as scalars into a folder; with no folder (every rank but 0), nothing."""

    def __init__(self, folder: str | None) -> None:
        self.writer = summary_writer_class()(log_dir=folder) if folder else None

    def write(self, s: StepSummary) -> None:
        if self.writer is None:
            return
        step = s.step + 1  # TensorBoard's x axis: optimizer steps done
        if math.isfinite(s.loss):
            self.writer.add_scalar("train/loss", s.loss, step)
        if s.eval_loss is not None and math.isfinite(s.eval_loss):
            self.writer.add_scalar("eval/loss", s.eval_loss, step)
        self.writer.add_scalar("train/lr", s.lr, step)
        self.writer.add_scalar("time/step_ms", s.step_ms, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
