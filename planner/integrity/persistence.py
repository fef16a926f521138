"""The persistence test of a compressed boundary's gradients: a CUSUM, per sender, of how much its steps'
per-feature means keep one direction (a bias hidden in the codec's rounding keeps it; honest rounding does not)."""
from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence

import torch

from planner.integrity import summaries as summ

__all__ = ["PERSIST_H", "Persistence"]

# On a compressed boundary a sender may round every element the way it likes: a bias of up to the codec's
# step per element, in a fixed direction, passes every test of one tensor (``attacks`` kind ``quant_bias``;
# gpt-tiny, int4 gradients at 0.9 steps: +0.10 nats of validation loss in 28 steps, never flagged). Honest
# rounding errs without direction, so a gradient's per-feature mean (in units of its spread) turns from step to
# step (cosine with the sender's EMA of it: -0.65..+0.80, around +0.1, clean gpt-tiny at every codec); a
# fixed bias holds it (+0.75..+0.94 from the second attacked step). A CUSUM of that cosine flags the step it
# passes PERSIST_H: three steps of the attack, never two honest 0.8s. Its allowance is PERSIST_K or, where the
# sender's honest means do persist (a constant offset: cosine ~1 from the start), PERSIST_MARGIN over the
# median of its in-control cosines: a bias there is a change the test cannot see, and no honest sender is flagged.
PERSIST_BETA = 0.8
PERSIST_K = 0.4
PERSIST_H = 1.0
PERSIST_MARGIN = 0.3
# The in-control cosines the median is of: a short memory, so that a mean drifting honestly (persistence rising
# step by step) is followed, while a bias's jump (a tenth to 0.9 in a step or two) is never learnt.
PERSIST_WINDOW = 16


class Persistence:
    """Per sender: the EMA of its steps' per-feature mean / spread, the CUSUM of their cosine with it and its
    in-control cosines (``PERSIST_K``)."""

    def __init__(self) -> None:
        self._state: dict[int, tuple[torch.Tensor, float, deque[float]]] = {}

    def step(self, sender: int, summaries: Sequence[summ.Summary], warming: bool) -> float | None:
        """The CUSUM of the cosine between ``sender``'s step mean (per feature, over its spread; ``summaries``: its
        step's samples) and its EMA of them, this step's added (None while warming up). Every step teaches the EMA,
        flagged or not: the test is of the sender's own sequence, and a bias that keeps its direction keeps the
        cosine high."""
        mean = torch.stack([x.mean for x in summaries]).mean(0)
        spread = torch.stack([x.std for x in summaries]).mean(0)
        m = mean / spread.clamp_min(summ.EPS)
        old = self._state.get(sender)
        if old is None or old[0].shape != m.shape:
            self._state[sender] = (m, 0.0, deque(maxlen=PERSIST_WINDOW))
            return None
        ema, total, honest = old
        cos = float(torch.nn.functional.cosine_similarity(m, ema, dim=0, eps=summ.EPS))
        if not math.isfinite(cos):
            cos = 0.0
        allowance = max(PERSIST_K, statistics.median(honest) + PERSIST_MARGIN) if honest else math.inf
        if cos <= allowance or warming:
            honest.append(cos)   # in control: the sender's own level of persistence
        total = 0.0 if warming else max(0.0, total + cos - allowance)
        self._state[sender] = (PERSIST_BETA * ema + (1 - PERSIST_BETA) * m, total, honest)
        return None if warming else total
