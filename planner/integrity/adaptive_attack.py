"""The adaptive attacker (``attacks`` kind ``adaptive``): the blend of an honest tensor and a corruption that
it estimates the verifier's fences let through, learnt from what it sends."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from planner.integrity import distances as dist
from planner.integrity import predictors as pred
from planner.integrity import summaries as summ
from planner.integrity.corruptions import stable_seed
from planner.integrity.thresholds import IQRFence
from planner.verifier_config import DEFAULT_FLOORS, DEFAULT_RATIOS, DEFAULT_STEP_FLOORS

__all__ = ["DISTANCE_NAMES", "AdaptiveState"]

DISTANCE_NAMES = tuple(dist.DISTANCES)  # the distances the adaptive attacker estimates


class AdaptiveState:
    """An attacker that knows the verification algorithm (not its secret seed).

    It keeps its own EMA of the distribution summary of what it sends and a
    window of its own honest scores for every distance the verifier uses,
    estimates the verifier's fences from them (``Q3 + 3 IQR``) and, per
    microbatch, sends the blend ``(1 - a) * x + a * target`` with the largest
    ``a`` (bisection) whose estimated scores all stay under ``margin`` times the
    estimated fences. What it sends also feeds its EMA, as it would feed the
    verifier's, so the reference creeps toward the corruption over time: the
    strongest simple attack on an EMA monitor.

    ``model=summary`` (the default) estimates the distances of the summary alone
    (what it sends is all it needs for them). ``model=full`` is the white-box
    attacker: given its stage's input (``stage_input``; the runtime's harness
    does not pass it, the benchmark's emulation does) it also fits the stage's
    linear surrogate and its residuals' shape, as the verifier does, and takes
    each fence as at least the verifier's published floor and ratio (per sample
    and per step: ``thresholds``), so it uses every bit of room the verifier
    leaves.
    """

    _BISECTIONS = 8
    _NAMES = (*DISTANCE_NAMES, "spectral")
    _LINKED = ("link", "residual")

    def __init__(self, params: Mapping[str, Any], seed: int) -> None:
        self.beta = float(params["beta"])
        self.margin = float(params["margin"])
        self.full = params.get("model", "summary") == "full"
        self.seed = seed
        self.ref: summ.Summary | None = None
        self._reference: dist.Reference | None = None
        self._dirs: torch.Tensor | None = None
        self._spectral: torch.Tensor | None = None
        self._levels = summ.quantile_levels(32)
        names = (*self._NAMES, *self._LINKED) if self.full else self._NAMES
        self._fences = {name: IQRFence(window=64, k=3.0, min_samples=8) for name in names}
        self._link: tuple[torch.Tensor, torch.Tensor] | None = None
        self._link_w: torch.Tensor | None = None
        self._resid: torch.Tensor | None = None
        self._whitener: torch.Tensor | None = None

    def _summary(self, x: torch.Tensor) -> tuple[summ.Summary, torch.Tensor]:
        if self._dirs is None:
            dim = summ.feature_size(x)
            self._dirs = summ.random_directions(dim, 16, stable_seed("adaptive", self.seed))
            self._spectral = summ.spectral_projection(dim, stable_seed("adaptive-spectral", self.seed))
        return summ.summarize_rows(x, directions=self._dirs, levels=self._levels, spectral=self._spectral)

    def _rows(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """The verifier's view of the stage input's rows (unit RMS, in the spectral basis)."""
        if x is None or not self.full or not x.is_floating_point():
            return None
        return self._summary(x)[1]

    def _scores(self, summary: summ.Summary, rows: torch.Tensor, inputs: torch.Tensor | None) -> dict[str, float]:
        assert self.ref is not None, "scores need a reference"
        if self._reference is None:
            self._reference = dist.reference(self.ref)
        scores = dist.summary_scores(summary, self._reference, self._NAMES)
        if inputs is not None and self._link_w is not None and len(inputs) == len(rows):
            num, den, moment = pred.link_parts(inputs, rows, self._link_w)
            scores["link"] = num / max(den, summ.EPS)
            if self._whitener is not None:
                scores["residual"] = pred.residual_shape(moment, self._whitener)
        return scores

    def _fold(self, summary: summ.Summary, rows: torch.Tensor, inputs: torch.Tensor | None) -> None:
        if self.ref is not None:
            for name, value in self._scores(summary, rows, inputs).items():
                self._fences[name].update(value)
        if inputs is not None and len(inputs) == len(rows):
            self._fold_link(inputs, rows)
        self.ref = summary if self.ref is None else self.ref.blend(summary, self.beta)
        self._reference = None

    def _fold_link(self, inputs: torch.Tensor, rows: torch.Tensor) -> None:
        if self._link_w is not None:
            moment = pred.link_parts(inputs, rows, self._link_w)[2]
            shape = moment / moment.trace().clamp_min(summ.EPS)
            self._resid = shape if self._resid is None else self.beta * self._resid + (1 - self.beta) * shape
            self._whitener = pred.residual_whitener(self._resid)
        stats = pred.link_stats(inputs, rows)
        self._link = stats if self._link is None else tuple(  # type: ignore[assignment]
            self.beta * old + (1 - self.beta) * new for old, new in zip(self._link, stats))
        self._link_w = pred.link_solve(*self._link)

    def observe(self, x: torch.Tensor, stage_input: torch.Tensor | None = None) -> None:
        """Learn from a tensor sent unchanged."""
        self._fold(*self._summary(x), self._rows(stage_input))

    def _limit(self, name: str, fence: IQRFence) -> float:
        estimate = fence.fence() or 0.0
        if not self.full:
            return estimate
        # The verifier's fence is at least its floor and its ratio times its median, per
        # sample and (a tighter floor) per step: the white-box attacker stays under both.
        per_sample = max(estimate, DEFAULT_FLOORS.get(name, 0.0), DEFAULT_RATIOS.get(name, 0.0) * fence.quantile(0.5))
        per_step = max(estimate, DEFAULT_STEP_FLOORS.get(name, 0.0),
                       DEFAULT_RATIOS.get(name, 0.0) * fence.quantile(0.5))
        return min(per_sample, per_step)

    def _inside(self, candidate: torch.Tensor, inputs: torch.Tensor | None) -> bool:
        scores = self._scores(*self._summary(candidate), inputs)
        return all(scores.get(n, 0.0) <= self.margin * self._limit(n, f) for n, f in self._fences.items()
                   if f.ready)

    def blend(self, honest: torch.Tensor, target: torch.Tensor,
              stage_input: torch.Tensor | None = None) -> torch.Tensor:
        """The most corrupted blend estimated to pass (and learnt from); ``honest`` itself if
        none does (the caller then sends it unchanged and :meth:`observe` s it)."""
        inputs = self._rows(stage_input)
        needed = (*self._NAMES, *(self._LINKED if inputs is not None else ()))
        if self.ref is None or not all(self._fences[n].ready for n in needed):
            return honest
        lo, hi = 0.0, 1.0
        h, t = honest.float(), target.float()
        if not self._inside(t, inputs):
            for _ in range(self._BISECTIONS):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if self._inside((1 - mid) * h + mid * t, inputs) else (lo, mid)
            hi = lo
        if hi <= 0.0:
            return honest
        out = (1 - hi) * h + hi * t
        self._fold(*self._summary(out), inputs)
        return out
