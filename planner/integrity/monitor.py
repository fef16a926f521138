"""The reference statistics, fences and learnt predictors of one (boundary, direction) a verifier
checks, and the per-sample and step-level tests against them (``verifier`` says how they fit together)."""
from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

from planner.integrity import distances as dist
from planner.integrity import evidence
from planner.integrity import predictors as pred
from planner.integrity import summaries as summ
from planner.integrity.history import CopyMemory, SketchRing
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
# The replay test compares a sample with the last ``replay_window`` sketches by cosine (near
# copies), and with this many times as many by exact fingerprint: a stale worker sends its own
# old results bit for bit, and at 16 microbatches a step the ring of 256 reaches back only 16
# steps (a replay of 20-step-old activations went unseen, gpt-tiny on four T4 hosts, 2026-12-03).
# 64 x 256 fingerprints: 1024 steps of 16 microbatches, about 1.8 MB a monitor.
EXACT_REPLAY_FACTOR = 64
# The link share divides what the stage's surrogate leaves unexplained by the sample's own spread
# around its mean. A window of one repeated byte ("####...", "----...") has almost none: its
# stage-output rows differ only by position (centred share of the unit rows 0.3-3% against 49%
# typical; 3-30% against 96% for gradients), so an ordinary residual read as a link share of 0.6-5.8,
# over GROSS times the floor: 16 of the 17 honest microbatch flags of the replicated gpt-tiny runs
# (seeds 0, 1, 3, lr 1e-3, 200 steps; 4 flags with this floor). The share is read against at least this
# fraction of the honest samples' spread (an EMA, learnt from accepted samples only), so it stays the
# share of an ordinary sample's variation; a sample spread at least that much is scored as before.
LINK_SPREAD_FLOOR = 0.5
# A replica's step that fails a test its twin's step scores at least this share of the fence on moved with its
# twin: after an attacker's ban (issue 37's shape, adaptive attack, seed 2) both replicas' steps failed the
# label-binding test by 1.2-1.9x its fence, by turns, for 20 steps (flagged steps teach nothing, so the
# reference never caught up) and the honest twin was banned.
TWIN_SHARE = 0.8
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


@dataclass(frozen=True, slots=True, kw_only=True)
class _Fit:
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
class _Sample:
    """A sample that passed its own checks, held until its step closes."""

    sender: int
    summary: summ.Summary
    scores: dict[str, float]
    fits: dict[str, _Fit]
    data_key: int | None = None
    mb: int | None = None   # its microbatch (None: unknown, never vouched for by an audit)


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
        self._pending: list[_Sample] = []
        self._dirs: torch.Tensor | None = None
        self.spectral: torch.Tensor | None = None
        self._ref: dist.Reference | None = None   # self.ref's sample-independent terms
        # Eigendecompositions (the principal basis, the residual whitener) cost as much as
        # a check: they are redone once every ``cfg.basis_refresh`` steps (the reference
        # moves only when a step closes), at the first score that needs them.
        self._basis: torch.Tensor | None = None
        self._basis_step = -1
        self._whitener_step = -1
        self._sketch_at: dict[int, torch.Tensor] = {}
        self._levels = summ.quantile_levels(cfg.quantiles)
        self._history: dict[int, SketchRing] = {}  # sketch length -> recent sketches
        self._copies = CopyMemory(cfg.replay_window * EXACT_REPLAY_FACTOR)   # older ones, exact
        self._table: torch.Tensor | None = None   # label bucket -> mean (normalised) row
        self._seen = torch.zeros(pred.LABEL_BUCKETS)
        self._centre: torch.Tensor | None = None
        self._link: tuple[torch.Tensor, torch.Tensor] | None = None   # EMA of (Sxx, Sxy)
        self._link_w: torch.Tensor | None = None
        self._gain: float | None = None               # EMA of honest samples' log gain (``_Fit.gain``)
        self._spread: float | None = None             # EMA of honest samples' ``_Fit.spread``
        self._resid: torch.Tensor | None = None     # EMA of honest residuals' shape (moment / trace)
        self._whitener: torch.Tensor | None = None
        self._drift: dict[int, Cusum] = {}           # sender -> CUSUM of its residual scores
        self._size = TrendLevel()   # the log size of accepted steps, trend and all: what ``scale`` is read against
        # sender -> (EMA of its steps' per-feature mean / spread, CUSUM of their cosine with it, its in-control
        # cosines): ``PERSIST_K``
        self._persist: dict[int, tuple[torch.Tensor, float, deque[float]]] = {}
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
             log_size: float | None = None) -> dict[str, _Fit]:
        """The sample's evidence for the label table and for the stage's linear surrogate
        (each only with aligned labels / the stage's input rows of the same microbatch,
        ``stage_input``: those rows, their size change, their log size and their sender;
        ``log_size``: the sample's, for the stage's gain)."""
        inputs, input_dlog, input_size, input_sender = stage_input if stage_input is not None else (None,) * 4
        fits: dict[str, _Fit] = {}
        buckets = None if labels is None or "binding" not in self.fences else pred.label_buckets(labels, len(rows))
        if buckets is not None:
            num = den = 0.0
            if self._table is not None and self._centre is not None:
                num, den = pred.binding_parts(rows, buckets, self._table, self._seen, self._centre)
            fits["binding"] = _Fit(num=num, den=den, update=(*pred.label_means(rows, buckets), rows.mean(dim=0)))
        linked = "link" in self.fences or "residual" in self.fences
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
            fits["link"] = _Fit(num=num, den=den, update=update, moment=moment, input_dlog=input_dlog,
                                input_sender=input_sender,
                                gain=None if log_size is None else log_size - input_size, spread=spread)
        return fits

    def score(self, summary: summ.Summary, fits: Sequence[Mapping[str, _Fit]] = (), *,
              per_sample: bool = True, data_key: int | None = None) -> dict[str, float]:
        """Distances of ``summary`` (and of the ``fits`` of its samples) to the reference
        (empty before the first step closed); ``data_key``: which data the sample is of (a
        replay is a copy of another data's tensor, see ``history.CopyMemory``)."""
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
        if ("scale" in names or "gain" in names) and self._gain is not None and links and len(links) == len(fits) \
                and all(f.input_dlog is not None and f.gain is not None for f in links):
            # With the stage's input at hand, the stage's own share of a size change: its log gain
            # (output's log size minus its input's, per sample) against the honest samples' (an
            # EMA, learnt only from accepted ones, so an attacker's gain is never taught), per
            # e-fold its input moved (``gain``, with fences of its own). A loss spike's gradients
            # grow on their way back through every stage (d=256, lr 1e-3 after a 20-step lr
            # warm-up: +0.3, +0.7, +1.5 e-folds at boundaries 2, 1, 0; the last over the raw 1.0
            # floor 7 times in 30 steps, and a ban), and a stage amplifies the spike it receives
            # about twofold (input +1.1, output +2.1: +1.0 of its own; at most 0.5 per
            # 1 + |input e-folds| in those runs). A sender that rescales what it sends moves its
            # gain by the whole factor. (Before, the own share was the output's size change minus
            # the input's, each against its own reference: once the output's stopped learning, a
            # flagged sender's, every honest move of the input's counted as the stage's.) A plan
            # made before ``gain`` scores it as ``scale``.
            d_in = sum(f.input_dlog for f in links) / len(links)
            own = sum(f.gain for f in links) / len(links) - self._gain
            scores.pop("scale", None)
            scores["gain" if "gain" in names else "scale"] = abs(own) / (1.0 + abs(d_in))
        elif "scale" in scores:
            # Without the stage's input, the size against the trend of accepted steps (``TrendLevel``), not
            # against the EMA reference, which trails a trend; none before the trend has a slope (the warm-up).
            expected = self._size.predict(self._age_step())
            if expected is None:
                del scores["scale"]
            else:
                scores["scale"] = abs(dist.log_size(summary) - expected)
        if "replay" in names:
            ring = self._history.get(summary.sketch.numel())
            scores["replay"] = pred.replay_score(summary.sketch, *ring.others(data_key)) if ring else 0.0
            if summary.sketch.numel() and self._copies.copied(summary.sketch, data_key):
                scores["replay"] = pred.REPLAY_SCORE_CAP
        for name in ("binding", "link"):
            parts = [f[name] for f in fits if name in f]
            den = sum(p.den for p in parts)
            if name in names and den > 0:
                scores[name] = sum(p.num for p in parts) / den
        moments = [f["link"].moment for f in fits if "link" in f and f["link"].moment is not None]
        if "residual" in names and moments and self._resid is not None:
            if self._whitener is None or self._stale(self._whitener_step):
                self._whitener, self._whitener_step = pred.residual_whitener(self._resid), self._age_step()
            if self._whitener.shape == moments[0].shape:
                scores["residual"] = pred.residual_shape(sum(moments), self._whitener)
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

    def hold(self, sender: int, summary: summ.Summary, scores: dict[str, float], fits: dict[str, _Fit],
             data_key: int | None = None, *, mb: int | None = None) -> None:
        """Keep a sample that passed until its step closes."""
        self._pending.append(_Sample(sender=sender, summary=summary, scores=scores, fits=fits, data_key=data_key,
                                     mb=mb))

    def close(self, audited: Collection[tuple[int, int]] = ()) -> list[tuple[int, dict[str, float], tuple[str, ...],
                                                                          int | None]]:
        """Close the open step: test each sender's step as a whole, fold in the samples
        of the senders that pass (or raise only an alert); returns ``(sender, scores, reasons, upstream)`` of those that
        fail (``upstream``: see :func:`upstream_culprit`). ``audited``: the ``(sender, mb)`` pairs of this step whose
        tensor here passed an audit (``audit``: the stage recomputed on the very input it received); a sender whose
        every averaged sample did is vouched for: its step passes whatever its scores (:meth:`_vouched`)."""
        if self.step is None:
            return []
        step, self.step = self.step, None
        self._closed_step = step
        pending, self._pending = self._pending, []
        by_sender: dict[int, list[_Sample]] = {}
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
                held = self._persistence(sender, samples, step)
                if held is not None and held > PERSIST_H:
                    scores, reasons = {**scores, "persist": held}, (*reasons, "persist")
            judged[sender] = (scores, reasons, drifting)
        for sender, samples in by_sender.items():
            scores, reasons, drifting = judged[sender]
            if reasons and _vouched(sender, samples, audited) and \
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
        ``PERSIST_K``; activations' per-feature means persist honestly)."""
        return self.codec != "none" and self.direction == "grad" and not self.watch_only

    def _persistence(self, sender: int, samples: Sequence[_Sample], step: int) -> float | None:
        """The CUSUM of the cosine between ``sender``'s step mean (per feature, over its spread) and its EMA of
        them, this step's added (None while warming up). Every step teaches the EMA, flagged or not: the test
        is of the sender's own sequence, and a bias that keeps its direction keeps the cosine high."""
        mean = torch.stack([x.summary.mean for x in samples]).mean(0)
        spread = torch.stack([x.summary.std for x in samples]).mean(0)
        m = mean / spread.clamp_min(summ.EPS)
        old = self._persist.get(sender)
        if old is None or old[0].shape != m.shape:
            self._persist[sender] = (m, 0.0, deque(maxlen=PERSIST_WINDOW))
            return None
        ema, total, honest = old
        cos = float(torch.nn.functional.cosine_similarity(m, ema, dim=0, eps=summ.EPS))
        if not math.isfinite(cos):
            cos = 0.0
        allowance = max(PERSIST_K, statistics.median(honest) + PERSIST_MARGIN) if honest else math.inf
        if cos <= allowance or self.warming(step):
            honest.append(cos)   # in control: the sender's own level of persistence
        total = 0.0 if self.warming(step) else max(0.0, total + cos - allowance)
        self._persist[sender] = (PERSIST_BETA * ema + (1 - PERSIST_BETA) * m, total, honest)
        return None if self.warming(step) else total

    def _shared_by_twins(self, sender: int, reasons: tuple[str, ...],
                         judged: Mapping[int, tuple[dict[str, float], tuple[str, ...], bool]]) -> bool:
        """True when every test ``sender``'s step fails is also near its fence (``TWIN_SHARE``) on a twin's
        step: the replicas of one stage share its weights and differ only by data, so a move they all
        make is the stage's (or its input's), not one replica's corruption."""
        twins = [scores for other, (scores, _, _) in judged.items() if other != sender]
        if not twins or evidence.DECISIVE.intersection(reasons):
            return False
        for name in reasons:
            limit = self.step_fences[name].fence() if name in self.step_fences else None
            if limit is None or not any(TWIN_SHARE * limit <= s.get(name, 0.0) < math.inf for s in twins):
                return False
        return True

    def culprit(self, sender: int, fits: Sequence[Mapping[str, _Fit]], reasons: Sequence[str]) -> int | None:
        """Where a flag of ``sender``'s is laid (None: on ``sender``): a run of its flags, unbroken by a
        step that passes, stays where its first flag pointed (:func:`upstream_culprit`), its link flags
        laid on the input's sender. The input's monitor learns a moved size within a step or two, but
        the flags it caused go on; and a run that began while its input kept its size is the sender's
        own, whatever its input does later (a sign-flipping attacker's flags, laid on the honest stage
        after it from the step its input grew 0.36 e-folds in training: emulation, seed 0, 2026-12-03)."""
        if sender not in self._runs:
            self._runs[sender] = upstream_culprit(fits, reasons)
        up = self._runs[sender]
        return up if up is not None and set(reasons) <= _LINKED_REASONS else None

    def _fold(self, summary: summ.Summary, scores: Mapping[str, float],
              fits: Mapping[str, _Fit] | None = None, data_key: int | None = None) -> None:
        """Fold an honest sample into the average, the windows, the history and the predictors."""
        fits = fits or {}
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
                self._gain = gain if self._gain is None else self.beta * self._gain + (1 - self.beta) * gain
            spread = fits["link"].spread
            if spread is not None:
                self._spread = spread if self._spread is None else \
                    self.beta * self._spread + (1 - self.beta) * spread
        self.ref = summary if self.ref is None else self.ref.blend(summary, self.beta)
        self._ref = None  # its derived terms follow the reference
        for name, value in scores.items():
            self.fences[name].update(value)
        length = summary.sketch.numel()
        if length:
            if length not in self._history:
                self._history[length] = SketchRing(self.cfg.replay_window, length)
            self._history[length].push(summary.sketch, data_key)
            self._copies.push(summary.sketch, data_key)

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

    def fence_values(self, *, per_sample: bool = True) -> dict[str, float | None]:
        fences = self.fences if per_sample else self.step_fences
        return {name: fence.fence() for name, fence in fences.items()}



# The link-derived tests judge a stage's output against a surrogate of its input; fed an input whose
# size moved this many e-folds from its reference (0.35: -30% or +42%; damping by 0.5 is 0.69), they
# judge the input, not the stage.
UPSTREAM_EFOLDS = 0.35
_LINKED_REASONS = frozenset({"link", "residual", "drift"})


def _vouched(sender: int, samples: Sequence[_Sample], audited: Collection[tuple[int, int]]) -> bool:
    """Whether an audit passed on every one of ``samples`` (``sender``'s step average): then its step is what the
    stage computes from its inputs, and a step-level failure of its own is the statistics' error (one laid on its
    input's sender stands: the audit says nothing of the input). A sample of unknown microbatch is never vouched
    for. The price: a corruption within the audit's tolerance (``audit.TOLERANCE``) on an audited step is no longer
    the step test's to catch. Issue 37 (``verification_twins.py``, 1 in 2, attack at 40, seed 2): after the
    re-plan the honest twin's gradient step means failed the sign test alone at 16 of the 34 steps from 46 on,
    every one of its microbatches audited and passing from 47, and it was banned at 60 on the statistics alone;
    its failed steps never taught the reference, which could not follow."""
    return bool(samples) and all(x.mb is not None and (sender, x.mb) in audited for x in samples)


def upstream_culprit(fits: Sequence[Mapping[str, _Fit]], reasons: Sequence[str]) -> int | None:
    """The sender of the flagged samples' input when only link-derived tests failed and that input
    (untrusted, as the samples saw it) moved more than ``UPSTREAM_EFOLDS`` in size: a stage that damps
    or inflates what it sends just under its own fences makes the honest stage after it fail its
    link test, and the blame is the input's. None otherwise."""
    links = [f.get("link") for f in fits]
    if not reasons or not set(reasons) <= _LINKED_REASONS or any(
            f is None or f.input_dlog is None or f.input_sender is None for f in links):
        return None
    if abs(sum(f.input_dlog for f in links) / len(links)) <= UPSTREAM_EFOLDS:
        return None
    senders = [f.input_sender for f in links]
    return max(set(senders), key=senders.count)
