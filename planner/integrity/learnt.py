"""The learnt predictors one monitor keeps of honest samples (the label table, the stage's linear surrogate,
its residuals' shape, the stage's gain and the samples' spread), the evidence a sample gives against them,
and how an accepted sample teaches them."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from planner.integrity import predictors as pred
from planner.integrity.fits import Fit

__all__ = ["LINK_SPREAD_FLOOR", "Learnt"]

# The link share divides what the stage's surrogate leaves unexplained by the sample's own spread
# around its mean. A window of one repeated byte ("####...", "----...") has almost none: its
# stage-output rows differ only by position (centred share of the unit rows 0.3-3% against 49%
# typical; 3-30% against 96% for gradients), so an ordinary residual read as a link share of 0.6-5.8,
# over GROSS times the floor: 16 of the 17 honest microbatch flags of the replicated gpt-tiny runs
# (seeds 0, 1, 3, lr 1e-3, 200 steps; 4 flags with this floor). The share is read against at least this
# fraction of the honest samples' spread (an EMA, learnt from accepted samples only), so it stays the
# share of an ordinary sample's variation; a sample spread at least that much is scored as before.
LINK_SPREAD_FLOOR = 0.5


class Learnt:
    """The predictors of one (boundary, direction), each an EMA (``beta``) of accepted samples only."""

    def __init__(self, beta: float) -> None:
        self.beta = beta
        self._table: torch.Tensor | None = None   # label bucket -> mean (normalised) row
        self._seen = torch.zeros(pred.LABEL_BUCKETS)
        self._centre: torch.Tensor | None = None
        self._link: tuple[torch.Tensor, torch.Tensor] | None = None   # EMA of (Sxx, Sxy)
        self._link_w: torch.Tensor | None = None
        self.gain: float | None = None                # EMA of honest samples' log gain (``Fit.gain``)
        self._spread: float | None = None             # EMA of honest samples' ``Fit.spread``
        self._resid: torch.Tensor | None = None     # EMA of honest residuals' shape (moment / trace)
        self._whitener: torch.Tensor | None = None
        self._whitener_step = -1

    def fits(self, rows: torch.Tensor, labels: torch.Tensor | None,
             stage_input: tuple[torch.Tensor, float | None, float, int | None] | None,
             log_size: float | None = None, *, binding: bool, linked: bool) -> dict[str, Fit]:
        """The sample's evidence for the label table (``binding``: the monitor runs that test) and for the
        stage's linear surrogate (``linked``: it runs the link or residual test); see ``Monitor.fits``."""
        inputs, input_dlog, input_size, input_sender = stage_input if stage_input is not None else (None,) * 4
        fits: dict[str, Fit] = {}
        buckets = None if labels is None or not binding else pred.label_buckets(labels, len(rows))
        if buckets is not None:
            num = den = 0.0
            if self._table is not None and self._centre is not None:
                num, den = pred.binding_parts(rows, buckets, self._table, self._seen, self._centre)
            fits["binding"] = Fit(num=num, den=den, update=(*pred.label_means(rows, buckets), rows.mean(dim=0)))
        if inputs is not None and linked and len(inputs) == len(rows):
            weights = None
            if self._link is not None:
                if self._link_w is None or self._link_w.shape[0] != inputs.shape[1] + 1:
                    self._link_w = pred.link_solve(*self._link)
                if self._link_w.shape[0] == inputs.shape[1] + 1:
                    weights = self._link_w
            parts, update = pred.link_fit(inputs, rows, weights)
            num, den, moment = parts if parts is not None else (0.0, 0.0, None)
            spread = (den if parts is not None else pred.centred_energy(rows)) / len(rows)
            if parts is not None and self._spread is not None:
                den = max(den, LINK_SPREAD_FLOOR * self._spread * len(rows))
            fits["link"] = Fit(num=num, den=den, update=update, moment=moment, input_dlog=input_dlog,
                               input_sender=input_sender,
                               gain=None if log_size is None else log_size - input_size, spread=spread)
        return fits

    def gain_score(self, links: Sequence[Fit]) -> float:
        """With the stage's input at hand, the stage's own share of a size change (``links``: the ``link`` fits of
        a sample, or of a step's samples, every one with its input's size change and its gain; a gain learnt).

        Its log gain (output's log size minus its input's, per sample) against the honest samples' (an
        EMA, learnt only from accepted ones, so an attacker's gain is never taught), per
        e-fold its input moved (``gain``, with fences of its own). A loss spike's gradients
        grow on their way back through every stage (d=256, lr 1e-3 after a 20-step lr
        warm-up: +0.3, +0.7, +1.5 e-folds at boundaries 2, 1, 0; the last over the raw 1.0
        floor 7 times in 30 steps, and a ban), and a stage amplifies the spike it receives
        about twofold (input +1.1, output +2.1: +1.0 of its own; at most 0.5 per
        1 + |input e-folds| in those runs). A sender that rescales what it sends moves its
        gain by the whole factor. (Before, the own share was the output's size change minus
        the input's, each against its own reference: once the output's stopped learning, a
        flagged sender's, every honest move of the input's counted as the stage's.) A plan
        made before ``gain`` scores it as ``scale``."""
        d_in = sum(f.input_dlog for f in links) / len(links)
        own = sum(f.gain for f in links) / len(links) - self.gain
        return abs(own) / (1.0 + abs(d_in))

    def residual(self, moments: Sequence[torch.Tensor], age_step: int, refresh_steps: int) -> float | None:
        """The residual-shape score of a step's (or a sample's) residual ``moments`` (None before the shape was
        learnt, or with moments of another size). The whitener is redone once every ``refresh_steps`` steps
        (``age_step``: the monitor's step): its eigendecomposition costs as much as a check."""
        if not moments or self._resid is None:
            return None
        if self._whitener is None or age_step - self._whitener_step >= refresh_steps:
            self._whitener, self._whitener_step = pred.residual_whitener(self._resid), age_step
        if self._whitener.shape != moments[0].shape:
            return None
        return pred.residual_shape(sum(moments), self._whitener)

    def fold(self, fits: Mapping[str, Fit]) -> None:
        """Teach the predictors an accepted sample's ``fits``."""
        if "binding" in fits:
            self._fold_binding(*fits["binding"].update)
        if "link" in fits:
            sxx, sxy = fits["link"].update
            same = self._link is not None and self._link[0].shape == sxx.shape and self._link[1].shape == sxy.shape
            self._link = (sxx, sxy) if not same else tuple(  # type: ignore[assignment]
                self.beta * old + (1 - self.beta) * new for old, new in zip(self._link, (sxx, sxy)))
            self._link_w = None
            self._fold_residual(fits["link"].moment)
            gain = fits["link"].gain
            if gain is not None:
                self.gain = gain if self.gain is None else self.beta * self.gain + (1 - self.beta) * gain
            spread = fits["link"].spread
            if spread is not None:
                self._spread = spread if self._spread is None else \
                    self.beta * self._spread + (1 - self.beta) * spread

    def _fold_residual(self, moment: torch.Tensor | None) -> None:
        if moment is None or float(moment.trace()) <= 0.0:
            return
        shape = moment / moment.trace()
        same = self._resid is not None and self._resid.shape == shape.shape
        self._resid = self.beta * self._resid + (1 - self.beta) * shape if same else shape
        if not same:
            self._whitener = None

    def _fold_binding(self, ids: torch.Tensor, means: torch.Tensor, counts: torch.Tensor,
                      centre: torch.Tensor) -> None:
        if self._table is None or self._centre is None or self._table.shape[1] != means.shape[1]:
            self._table = torch.zeros(pred.LABEL_BUCKETS, means.shape[1])
            self._seen.zero_()
            self._centre = centre
        old = self._seen[ids] > 0
        self._table[ids] = torch.where(old[:, None], self.beta * self._table[ids] + (1 - self.beta) * means, means)
        self._seen[ids] += counts
        self._centre = self.beta * self._centre + (1 - self.beta) * centre
