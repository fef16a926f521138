"""The replay test's memory of one monitor: the recent sketches of its accepted samples (near copies, by
cosine) and the fingerprints of many more (exact copies), and a sample's replay score against them."""
from __future__ import annotations

import torch

from planner.integrity import predictors as pred
from planner.integrity.history import CopyMemory, SketchRing

__all__ = ["EXACT_REPLAY_FACTOR", "ReplayMemory"]

# The replay test compares a sample with the last ``replay_window`` sketches by cosine (near
# copies), and with this many times as many by exact fingerprint: a stale worker sends its own
# old results bit for bit, and at 16 microbatches a step the ring of 256 reaches back only 16
# steps (a replay of 20-step-old activations went unseen, gpt-tiny on four T4 hosts, 2026-12-03).
# 64 x 256 fingerprints: 1024 steps of 16 microbatches, about 1.8 MB a monitor.
EXACT_REPLAY_FACTOR = 64


class ReplayMemory:
    """The last ``window`` sketches per sketch length, and ``EXACT_REPLAY_FACTOR`` times as many fingerprints."""

    def __init__(self, window: int) -> None:
        self._window = window
        self._rings: dict[int, SketchRing] = {}  # sketch length -> recent sketches
        self._copies = CopyMemory(window * EXACT_REPLAY_FACTOR)   # older ones, exact

    def score(self, sketch: torch.Tensor, data_key: int | None) -> float:
        """How close ``sketch`` comes to one of another data's (``data_key``; see ``history.CopyMemory``):
        ``predictors.replay_score`` against the recent ones, capped where it copies an older one exactly."""
        ring = self._rings.get(sketch.numel())
        score = pred.replay_score(sketch, *ring.others(data_key)) if ring else 0.0
        if sketch.numel() and self._copies.copied(sketch, data_key):
            score = pred.REPLAY_SCORE_CAP
        return score

    def push(self, sketch: torch.Tensor, data_key: int | None) -> None:
        """Remember an accepted sample's ``sketch`` (none: an empty one)."""
        length = sketch.numel()
        if length:
            if length not in self._rings:
                self._rings[length] = SketchRing(self._window, length)
            self._rings[length].push(sketch, data_key)
            self._copies.push(sketch, data_key)
