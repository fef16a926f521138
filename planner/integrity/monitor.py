"""The reference statistics, fences and learnt predictors of one (boundary, direction) a verifier
checks, and the per-sample and step-level tests against them (``verifier`` says how they fit together)."""
from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch

from planner.integrity import distances as dist
from planner.integrity import evidence
from planner.integrity import summaries as summ
from planner.integrity.culprits import (
    LINKED_REASONS,
    shared_by_twins,
    upstream_culprit,
    vouched,
)
from planner.integrity.fits import Fit, Sample
from planner.integrity.learnt import Learnt
from planner.integrity.persistence import PERSIST_H, Persistence
from planner.integrity.replays import ReplayMemory
from planner.integrity.thresholds import Cusum, IQRFence, TrendLevel
from planner.verifier_config import DIRECTIONS, VerifierConfig

__all__ = ["Monitor", "upstream_culprit"]


# A replay is a property of one tensor: it has no step-average version. The drift is one of a
# sender's sequence of *steps*: the microbatches of a step share the weights, the stage's
# surrogate and the residual whitener, so their residual scores move together (at d=256, lr
# 1e-3, a whole step's scores sat 1.5-1.9x the baseline while the whitener caught up with the
# stage), and a CUSUM that counted them as four independent samples summed one honest
# excursion four times (~25% of clean microbatches flagged). It runs once per step, on the
# step's residual score.
PER_SAMPLE_ONLY = ("replay",)
STEP_ONLY = ("drift",)
DRIFT_CAP = 8.0   # the most one step adds to the CUSUM, in robust deviations (before the allowance)


class Monitor:
    """Reference statistics and fences of one (boundary, direction).

    Within a step the model's weights are fixed, so every microbatch of the
    step is scored against the reference as it was when the step began; the
    samples that pass are held back and folded in when the step closes.
    Closing also scores each sender's step as a whole (the average of its
    accepted summaries): averaging four microbatches halves the noise, which
    is what exposes attacks too subtle for any single microbatch (a gradient
    sign flip late in training, low-level noise). A sender whose step fails
    that test is flagged for the step and its samples are not folded in,
    unless the flag is an alert (``evidence.alert_only``: the reference must
    follow a change nothing can tell from an honest one).
    """

    def __init__(self, cfg: VerifierConfig, boundary: int, direction: str, *, watch_only: bool = False,
                 codec: str = "none") -> None:
        self.cfg = cfg
        self.codec = codec   # the boundary's wire codec (the plan stage's ``out_codec``): what it sends is rounded
        self.boundary = boundary
        self.direction = direction
        self.watch_only = watch_only  # a trusted sender's: learnt from, never failing a test
        self._runs: dict[int, int | None] = {}  # sender -> where its unbroken run of flags is laid (None: its own)
        self.beta = cfg.beta_act if direction == "act" else cfg.beta_grad
        self.ref: summ.Summary | None = None
        self.first_step: int | None = None
        self.step: int | None = None  # the open step
        self._closed_step = -1          # the last step closed
        self._pending: list[Sample] = []
        self._dirs: torch.Tensor | None = None
        self.spectral: torch.Tensor | None = None
        self._ref: dist.Reference | None = None   # self.ref's sample-independent terms
        # Eigendecompositions (the principal basis, the residual whitener) cost as much as
        # a check: they are redone once every ``cfg.basis_refresh`` steps (the reference
        # moves only when a step closes), at the first score that needs them.
        self._basis: torch.Tensor | None = None
        self._basis_step = -1
        self._sketch_at: dict[int, torch.Tensor] = {}
        self._levels = summ.quantile_levels(cfg.quantiles)
        self._replays = ReplayMemory(cfg.replay_window)
        self.learnt = Learnt(self.beta)   # the label table, the link surrogate, the residual shape
        self._drift: dict[int, Cusum] = {}           # sender -> CUSUM of its residual scores
        self._size = TrendLevel()   # the log size of accepted steps, trend and all: what ``scale`` is read against
        self._persist = Persistence()   # the persistence test's state, per sender
        floors, step_floors = cfg.floors, cfg.step_floors
        if direction == "act":
            floors, step_floors = {**floors, **cfg.act_floors}, {**step_floors, **cfg.act_floors}
        self.fences = {name: self._fence(name, floors) for name in cfg.distances if name not in STEP_ONLY}
        # A step's fence learns one score per step: it is ready ``min_samples`` steps after the
        # warm-up, its per-sample twin four times sooner. Until then the twin judges the step's
        # average (a looser fence than the step's own will be: an average is less noisy than
        # any of its samples). Without it, every sample held for its step's average (one test
        # a little over its fence) was folded in unjudged: a stale worker's outputs (the delay
        # attack, link share 1.0-1.5 against a fence of 0.6, just under GROSS) taught the link
        # fence and the surrogate their own scores within two steps and were never flagged again.
        # Once ready, a step's fence is also capped by its per-sample twin: the window of step scores
        # reaches back ``window`` steps, into early training's turbulence, while the samples' window
        # holds the last few; else noise whose samples failed one by one passed as a step and was learnt.
        self.step_fences = {name: self._fence(name, step_floors, self.fences.get(name))
                            for name in cfg.distances if name not in PER_SAMPLE_ONLY}
        self.checked = 0
        self.flagged = 0
        self.tainted = 0
        self.step_flags = 0
        self.twin_shared = 0   # step-level failures a twin shared (``_shared_by_twins``): not flagged
        self.vouched = 0       # step-level failures every sample of which passed an audit: not flagged

    def _fence(self, name: str, floors: Mapping[str, float], fallback: IQRFence | None = None) -> IQRFence:
        return IQRFence(window=self.cfg.window, k=self.cfg.iqr_k, min_samples=self.cfg.min_samples,
                        floor=floors.get(name, 0.0), ratio=self.cfg.ratios.get(name, 0.0), fallback=fallback,
                        capped=fallback is not None)

    def _seed(self, salt: int) -> int:
        # Distinct, fixed projections per monitor: the same on every rank and run.
        return self.cfg.seed * 1_000_003 + self.boundary * 2 + DIRECTIONS.index(self.direction) + salt

    def summarize(self, tensor: torch.Tensor, subset_seed: int = 0
                  ) -> tuple[summ.Summary, torch.Tensor, torch.Tensor | None] | None:
        """The sample's summary, unit rows and the subset of rows they are (see
        ``distances.summarize_rows`` and ``distances.row_subset``; ``subset_seed`` picks
        the subset of a large tensor), or None if its feature size differs from earlier
        samples'."""
        rows_dim = summ.feature_size(tensor)
        if self._dirs is None:
            self._dirs = summ.random_directions(rows_dim, self.cfg.projections, self._seed(0))
            self.spectral = summ.spectral_projection(rows_dim, self._seed(3))
        elif self._dirs.shape[0] != rows_dim:
            return None
        sketch_at = None
        if "replay" in self.fences:
            numel = tensor.numel()
            if numel not in self._sketch_at:
                self._sketch_at[numel] = summ.sketch_positions(numel, summ.SKETCH_SIZE, self._seed(7))
            sketch_at = self._sketch_at[numel]
        subset = summ.row_subset(tensor.numel() // rows_dim, subset_seed)
        summary, rows = summ.summarize_rows(tensor, directions=self._dirs, levels=self._levels,
                                            spectral=self.spectral, sketch_at=sketch_at, subset=subset)
        return summary, rows, subset

    def fits(self, rows: torch.Tensor, labels: torch.Tensor | None,
             stage_input: tuple[torch.Tensor, float | None, float, int | None] | None,
             log_size: float | None = None) -> dict[str, Fit]:
        """The sample's evidence for the label table and for the stage's linear surrogate
        (each only with aligned labels / the stage's input rows of the same microbatch,
        ``stage_input``: those rows, their size change, their log size and their sender;
        ``log_size``: the sample's, for the stage's gain)."""
        return self.learnt.fits(rows, labels, stage_input, log_size, binding="binding" in self.fences,
                                linked="link" in self.fences or "residual" in self.fences)

    def score(self, summary: summ.Summary, fits: Sequence[Mapping[str, Fit]] = (), *,
              per_sample: bool = True, data_key: int | None = None) -> dict[str, float]:
        """Distances of ``summary`` (and of the ``fits`` of its samples) to the reference
        (empty before the first step closed); ``data_key``: which data the sample is of (a
        replay is a copy of another data's tensor, see ``replays.ReplayMemory``)."""
        if self.ref is None:
            return {}
        names = self.fences if per_sample else self.step_fences
        if self._ref is None:
            spectral = "spectral" in self.fences
            if spectral and (self._basis is None or self._stale(self._basis_step)
                             or self._basis.shape[0] != self.ref.cov.shape[0]):
                self._basis, self._basis_step = dist.principal_basis(self.ref.cov), self._age_step()
            self._ref = dist.reference(self.ref, spectral=spectral, basis=self._basis)
        scores = dist.summary_scores(summary, self._ref, tuple(names))
        links = [f["link"] for f in fits if "link" in f]
        if ("scale" in names or "gain" in names) and self.learnt.gain is not None and links \
                and len(links) == len(fits) and all(f.input_dlog is not None and f.gain is not None for f in links):
            scores.pop("scale", None)
            scores["gain" if "gain" in names else "scale"] = self.learnt.gain_score(links)
        elif "scale" in scores:
            # Without the stage's input, the size against the trend of accepted steps (``TrendLevel``), not
            # against the EMA reference, which trails a trend; none before the trend has a slope (the warm-up).
            expected = self._size.predict(self._age_step())
            if expected is None:
                del scores["scale"]
            else:
                scores["scale"] = abs(dist.log_size(summary) - expected)
        if "replay" in names:
            scores["replay"] = self._replays.score(summary.sketch, data_key)
        for name in ("binding", "link"):
            parts = [f[name] for f in fits if name in f]
            den = sum(p.den for p in parts)
            if name in names and den > 0:
                scores[name] = sum(p.num for p in parts) / den
        moments = [f["link"].moment for f in fits if "link" in f and f["link"].moment is not None]
        residual = self.learnt.residual(moments, self._age_step(), self.cfg.basis_refresh) \
            if "residual" in names else None
        if residual is not None:
            scores["residual"] = residual
        return scores

    def size_change(self, summary: summ.Summary) -> float | None:
        """``summary``'s signed size change against this step's reference (None before one)."""
        return None if self._ref is None else dist.log_size_change(summary, self._ref)

    def _age_step(self) -> int:
        return self.step if self.step is not None else self._closed_step

    def _stale(self, computed_at: int) -> bool:
        return self._age_step() - computed_at >= self.cfg.basis_refresh

    def warming(self, step: int) -> bool:
        return self.first_step is None or step < self.first_step + self.cfg.warmup

    def exceeded(self, scores: Mapping[str, float], step: int, *, per_sample: bool = True) -> tuple[str, ...]:
        if self.warming(step) or self.watch_only:
            return ()
        fences = self.fences if per_sample else self.step_fences
        young = self.first_step is not None and step < self.first_step + self.cfg.warmup + evidence.YOUNG_STEPS
        return evidence.flag_reasons(scores, fences, per_sample=per_sample,
                                     gross=evidence.GROSS * (evidence.YOUNG_GROSS if young else 1.0))

    def drift(self, sender: int) -> Cusum:
        """The CUSUM of ``sender``'s step-level residual scores on this boundary (one per
        sender: an honest replica's steps must neither mask nor be blamed for another's).
        One sample per step (see ``STEP_ONLY``); it learns and sums only after the
        warm-up: early training's transients would make a baseline that later, calmer
        scores are judged against. It is stepped by every step the sender's samples
        reach (a step that fails for another reason too), so an alarm ends when the
        scores come back; only steps that pass teach its baseline.

        Its limit: an honest *rise* of the residual score that outlasts the alarm
        (several steps at more than ``drift_k`` robust deviations) reads as drift
        too; a model whose stage residuals keep changing shape should drop ``drift``
        from ``distances``."""
        if sender not in self._drift:
            spread = self.cfg.drift_spread_act if self.direction == "act" else self.cfg.drift_spread_grad
            self._drift[sender] = Cusum(window=self.cfg.window, k=self.cfg.drift_k, cap=DRIFT_CAP,
                                        min_samples=self.cfg.min_samples, min_spread=spread)
        return self._drift[sender]

    def hold(self, sender: int, summary: summ.Summary, scores: dict[str, float], fits: dict[str, Fit],
             data_key: int | None = None, *, mb: int | None = None) -> None:
        """Keep a sample that passed until its step closes."""
        self._pending.append(Sample(sender=sender, summary=summary, scores=scores, fits=fits, data_key=data_key,
                                     mb=mb))

    def close(self, audited: Collection[tuple[int, int]] = ()) -> list[tuple[int, dict[str, float], tuple[str, ...],
                                                                          int | None]]:
        """Close the open step: test each sender's step as a whole, fold in the samples
        of the senders that pass (or raise only an alert); returns ``(sender, scores, reasons, upstream)`` of those that
        fail (``upstream``: see :func:`upstream_culprit`). ``audited``: the ``(sender, mb)`` pairs of this step whose
        tensor here passed an audit (``audit``: the stage recomputed on the very input it received); a sender whose
        every averaged sample did is vouched for: its step passes whatever its scores (``culprits.vouched``)."""
        if self.step is None:
            return []
        step, self.step = self.step, None
        self._closed_step = step
        pending, self._pending = self._pending, []
        by_sender: dict[int, list[Sample]] = {}
        for sample in pending:
            by_sender.setdefault(sample.sender, []).append(sample)
        failed: list[tuple[int, dict[str, float], tuple[str, ...], int | None]] = []
        alerts: set[int] = set()
        judged: dict[int, tuple[dict[str, float], tuple[str, ...], bool]] = {}
        sizes: dict[int, float] = {}
        for sender, samples in by_sender.items():
            mean = summ.mean_summary([x.summary for x in samples])
            sizes[sender] = dist.log_size(mean)
            scores = self.score(mean, [x.fits for x in samples], per_sample=False)
            drifting = "drift" in self.step_fences and "residual" in scores and not self.warming(step)
            if drifting:
                scores["drift"] = self.drift(sender).step(scores["residual"])
            reasons = self.exceeded(scores, step, per_sample=False)
            if self.persists:
                held = self._persist.step(sender, [x.summary for x in samples], self.warming(step))
                if held is not None and held > PERSIST_H:
                    scores, reasons = {**scores, "persist": held}, (*reasons, "persist")
            judged[sender] = (scores, reasons, drifting)
        for sender, samples in by_sender.items():
            scores, reasons, drifting = judged[sender]
            if reasons and vouched(sender, samples, audited) and \
                    self.culprit(sender, [x.fits for x in samples], reasons) is None:
                self.vouched += 1
                reasons = ()   # the audit outranks the statistics on its own step (not one laid on its input)
            if reasons and self._shared_by_twins(sender, reasons, judged):
                self.twin_shared += 1
                alerts.add(sender)   # the stage moved, not this replica: its samples teach the reference
                continue
            if reasons:
                failed.append((sender, scores, reasons, self.culprit(sender, [x.fits for x in samples], reasons)))
                if evidence.alert_only(scores, reasons):
                    alerts.add(sender)   # its samples teach the reference, its scores not the step fences
                continue
            self._runs.pop(sender, None)
            for name, value in scores.items():
                if name in self.step_fences:
                    self.step_fences[name].update(value)
            if drifting:
                self.drift(sender).learn(scores["residual"])
        bad = {sender for sender, *_ in failed}
        self.step_flags += len(bad)
        kept = [size for sender, size in sizes.items() if sender not in bad - alerts]
        if kept:
            self._size.learn(step, sum(kept) / len(kept))
        for sample in pending:
            if sample.sender not in bad - alerts:
                self._fold(sample.summary, sample.scores, sample.fits, sample.data_key)
        return failed

    @property
    def persists(self) -> bool:
        """Whether this monitor runs the persistence test: gradients across a compressed boundary (see
        ``persistence.PERSIST_K``; activations' per-feature means persist honestly)."""
        return self.codec != "none" and self.direction == "grad" and not self.watch_only

    def _shared_by_twins(self, sender: int, reasons: tuple[str, ...],
                         judged: Mapping[int, tuple[dict[str, float], tuple[str, ...], bool]]) -> bool:
        """``culprits.shared_by_twins`` against this monitor's step fences."""
        return shared_by_twins(sender, reasons, judged, self.step_fences)

    def culprit(self, sender: int, fits: Sequence[Mapping[str, Fit]], reasons: Sequence[str]) -> int | None:
        """Where a flag of ``sender``'s is laid (None: on ``sender``): a run of its flags, unbroken by a
        step that passes, stays where its first flag pointed (:func:`upstream_culprit`), its link flags
        laid on the input's sender. The input's monitor learns a moved size within a step or two, but
        the flags it caused go on; and a run that began while its input kept its size is the sender's
        own, whatever its input does later (a sign-flipping attacker's flags, laid on the honest stage
        after it from the step its input grew 0.36 e-folds in training: emulation, seed 0, 2026-12-03)."""
        if sender not in self._runs:
            self._runs[sender] = upstream_culprit(fits, reasons)
        up = self._runs[sender]
        return up if up is not None and set(reasons) <= LINKED_REASONS else None

    def _fold(self, summary: summ.Summary, scores: Mapping[str, float],
              fits: Mapping[str, Fit] | None = None, data_key: int | None = None) -> None:
        """Fold an honest sample into the average, the windows, the history and the predictors."""
        self.learnt.fold(fits or {})
        self.ref = summary if self.ref is None else self.ref.blend(summary, self.beta)
        self._ref = None  # its derived terms follow the reference
        for name, value in scores.items():
            self.fences[name].update(value)
        self._replays.push(summary.sketch, data_key)

    def fence_values(self, *, per_sample: bool = True) -> dict[str, float | None]:
        fences = self.fences if per_sample else self.step_fences
        return {name: fence.fence() for name, fence in fences.items()}

