"""SENTINEL-style integrity monitors for the tensors that cross stage boundaries.

A verifier rank receives a copy of every checked boundary tensor (activations
forward, gradients backward) and decides, without recomputing anything,
whether the sender corrupted it:

1. Per (boundary, direction) a :class:`Monitor` keeps an exponential moving
   average of the tensors' distribution summary (``distances.Summary``:
   per-feature mean/std and sliced quantiles; activations beta 0.9, gradients
   0.8) and a history of sketches of recent tensors.
2. Each microbatch is scored against the average with several scale-free
   distances (mean absolute difference, normalised L2, sign-flip ratio, sliced
   Wasserstein) and against the history (replay).
3. Each distance has its own IQR fence over a rolling window of accepted
   scores; a sample is flagged when any distance is above its fence. Flagged
   and tainted samples never update the average, the windows or the history.
4. At the end of a step all verifiers' flags are gathered; per microbatch only
   the most upstream flagged sender is blamed (a corruption upstream makes
   everything downstream look odd), and a sender blamed in ``ban_after`` of
   the last ``ban_window`` steps is banned.

Why summaries rather than raw tensors: consecutive microbatches hold different
data, so an elementwise average of them is a blur that every honest tensor is
far from. The statistics above are what stays stable from batch to batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import torch

from planner.errors import InvalidInputError
from planner.runtime import distances as dist
from planner.runtime.thresholds import IQRFence

DIRECTIONS = ("act", "grad")
ALL_DISTANCES = ("mad", "l2", "scale", "sign", "skew", "swd", "spectral", "replay")
# Fence floors: sign and skew scores above 0.5 mean "points the other way than the
# reference", whatever the window says; a replay floor of 6 only flags copies
# within 1e-6 of cosine 1; a scale floor of 1.0 tolerates honest gradient
# spikes of up to e times the usual size.
DEFAULT_FLOORS = {"mad": 0.0, "l2": 0.0, "scale": 1.0, "sign": 0.5, "skew": 0.75, "swd": 0.0, "spectral": 0.0,
                  "replay": 6.0}
# A step's average is less noisy than one microbatch: its skew may be held closer.
DEFAULT_STEP_FLOORS = {**DEFAULT_FLOORS, "skew": 0.6}
# Fence ratios (fence >= ratio * median): the magnitude distances swing with
# the data and with bursts of training instability (gradients above all), so
# they only flag gross corruption; the spectral share is stable from batch to
# batch and is the sensitive test.
DEFAULT_RATIOS = {"mad": 5.0, "l2": 5.0, "scale": 5.0, "sign": 3.0, "skew": 3.0, "swd": 5.0, "spectral": 3.0,
                  "replay": 3.0}
PER_SAMPLE_ONLY = ("replay",)  # a replay is a property of one tensor, not of a step's average
STEP_MB = -1                   # the "microbatch" of a step-level flag


@dataclass(frozen=True, slots=True, kw_only=True)
class VerifierConfig:
    """The knobs of the monitors (the plan's ``verifier_config``; every key optional).

    ``warmup`` counts steps from the first step a monitor sees: they are taken
    as honest and only teach the reference and the windows. ``min_samples``
    scores are needed before a fence exists. ``floors`` are per-distance lower
    bounds of the fences (the replay floor only lets near-bitwise copies
    through: honest batches never come that close).
    """

    beta_act: float = 0.9
    beta_grad: float = 0.8
    window: int = 96
    iqr_k: float = 3.0
    warmup: int = 10
    min_samples: int = 8
    ban_after: int = 3
    ban_window: int = 20
    distances: tuple[str, ...] = ALL_DISTANCES
    floors: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_FLOORS))
    step_floors: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_STEP_FLOORS))
    ratios: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_RATIOS))
    projections: int = 16
    quantiles: int = 32
    replay_window: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.iqr_k > 0:
            raise InvalidInputError("verifier_config.iqr_k", expected="a number > 0 (e.g. 3.0)",
                                    found=str(self.iqr_k))
        for table in ("floors", "step_floors", "ratios"):
            for name, value in getattr(self, table).items():
                if not value >= 0:
                    raise InvalidInputError(f"verifier_config.{table}.{name}", expected="a number >= 0",
                                            found=str(value))
        for name in ("beta_act", "beta_grad"):
            if not 0.0 < getattr(self, name) < 1.0:
                raise InvalidInputError(f"verifier_config.{name}", expected="a number in (0, 1)",
                                        found=str(getattr(self, name)))
        for name in ("window", "min_samples", "ban_after", "ban_window", "projections", "quantiles",
                     "replay_window"):
            if int(getattr(self, name)) < 1:
                raise InvalidInputError(f"verifier_config.{name}", expected=">= 1",
                                        found=str(getattr(self, name)))
        if self.warmup < 0:
            raise InvalidInputError("verifier_config.warmup", expected=">= 0 steps", found=str(self.warmup))
        if self.ban_after > self.ban_window:
            raise InvalidInputError("verifier_config.ban_after", expected=f"<= ban_window ({self.ban_window})",
                                    found=str(self.ban_after))
        unknown = [d for d in (*self.distances, *self.floors, *self.step_floors, *self.ratios)
                   if d not in ALL_DISTANCES]
        if unknown or not self.distances:
            raise InvalidInputError("verifier_config.distances", expected=f"a non-empty subset of {ALL_DISTANCES}",
                                    found=repr(unknown or list(self.distances)))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "VerifierConfig":
        d = dict(d or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise InvalidInputError(f"verifier_config key {unknown[0]!r}", expected=f"one of {sorted(known)}",
                                    found=repr(unknown), fix="remove or rename the key")
        if "distances" in d:
            d["distances"] = tuple(d["distances"])
        if "floors" in d:
            d["floors"] = {**DEFAULT_FLOORS, **dict(d["floors"])}
        if "step_floors" in d:
            d["step_floors"] = {**DEFAULT_STEP_FLOORS, **dict(d["step_floors"])}
        if "ratios" in d:
            d["ratios"] = {**DEFAULT_RATIOS, **dict(d["ratios"])}
        try:
            return cls(**d)
        except (TypeError, ValueError) as exc:
            raise InvalidInputError("verifier_config", expected="numbers and lists as documented",
                                    found=str(exc)) from exc

    def to_dict(self) -> dict[str, Any]:
        return {name: (list(v) if isinstance(v, tuple) else dict(v) if isinstance(v, Mapping) else v)
                for name in self.__dataclass_fields__ for v in (getattr(self, name),)}


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    """What a check decided about one received microbatch tensor.

    ``flagged``: this sample is judged corrupted (blame its sender).
    ``tainted``: the consumer must not use it (flagged, or it arrived tainted
    because its input was already dropped upstream). ``scores``: distance ->
    score; ``reasons``: the distances that exceeded their fence.
    """

    flagged: bool
    tainted: bool
    scores: dict[str, float] = field(default_factory=dict)
    reasons: tuple[str, ...] = ()


class _Ring:
    """The last ``capacity`` sketches in one preallocated ``[capacity, length]`` tensor."""

    def __init__(self, capacity: int, length: int) -> None:
        self._data = torch.zeros(capacity, length)
        self._count = 0

    def __len__(self) -> int:
        return min(self._count, self._data.shape[0])

    def push(self, sketch: torch.Tensor) -> None:
        self._data[self._count % self._data.shape[0]] = sketch
        self._count += 1

    def rows(self) -> torch.Tensor:
        return self._data[: len(self)]


class Monitor:
    """Reference statistics and fences of one (boundary, direction).

    Within a step the model's weights are fixed, so every microbatch of the
    step is scored against the reference as it was when the step began; the
    samples that pass are held back and folded in when the step closes.
    Closing also scores each sender's step as a whole (the average of its
    accepted summaries): averaging four microbatches halves the noise, which
    is what exposes attacks too subtle for any single microbatch (a gradient
    sign flip late in training, low-level noise). A sender whose step fails
    that test is flagged for the step and its samples are not folded in.
    """

    def __init__(self, cfg: VerifierConfig, boundary: int, direction: str) -> None:
        self.cfg = cfg
        self.boundary = boundary
        self.direction = direction
        self.beta = cfg.beta_act if direction == "act" else cfg.beta_grad
        self.ref: dist.Summary | None = None
        self.first_step: int | None = None
        self.step: int | None = None  # the open step
        self._pending: list[tuple[int, dist.Summary, dict[str, float]]] = []
        self._dirs: torch.Tensor | None = None
        self._spectral: torch.Tensor | None = None
        self._basis: torch.Tensor | None = None
        self._sketch_at: dict[int, torch.Tensor] = {}
        self._levels = dist.quantile_levels(cfg.quantiles)
        self._history: dict[int, _Ring] = {}  # sketch length -> recent sketches
        self.fences = {name: self._fence(name, cfg.floors) for name in cfg.distances}
        self.step_fences = {name: self._fence(name, cfg.step_floors)
                            for name in cfg.distances if name not in PER_SAMPLE_ONLY}
        self.checked = 0
        self.flagged = 0
        self.tainted = 0
        self.step_flags = 0

    def _fence(self, name: str, floors: Mapping[str, float]) -> IQRFence:
        return IQRFence(window=self.cfg.window, k=self.cfg.iqr_k, min_samples=self.cfg.min_samples,
                        floor=floors.get(name, 0.0), ratio=self.cfg.ratios.get(name, 0.0))

    def _seed(self, salt: int) -> int:
        # Distinct, fixed projections per monitor: the same on every rank and run.
        return self.cfg.seed * 1_000_003 + self.boundary * 2 + DIRECTIONS.index(self.direction) + salt

    def summarize(self, tensor: torch.Tensor) -> dist.Summary | None:
        """The sample's summary, or None if its feature size differs from earlier samples'."""
        rows_dim = dist.feature_size(tensor)
        if self._dirs is None:
            self._dirs = dist.random_directions(rows_dim, self.cfg.projections, self._seed(0))
            self._spectral = dist.spectral_projection(rows_dim, self._seed(3))
        elif self._dirs.shape[0] != rows_dim:
            return None
        sketch_at = None
        if "replay" in self.fences:
            numel = tensor.numel()
            if numel not in self._sketch_at:
                self._sketch_at[numel] = dist.sketch_positions(numel, dist.SKETCH_SIZE, self._seed(7))
            sketch_at = self._sketch_at[numel]
        return dist.summarize(tensor, directions=self._dirs, levels=self._levels, spectral=self._spectral,
                              sketch_at=sketch_at)

    def score(self, summary: dist.Summary, *, per_sample: bool = True) -> dict[str, float]:
        """Distances of ``summary`` to the reference (empty before the first step closed)."""
        if self.ref is None:
            return {}
        names = self.fences if per_sample else self.step_fences
        scores = {name: dist.DISTANCES[name](summary, self.ref) for name in names if name in dist.DISTANCES}
        if "spectral" in names:
            if self._basis is None:
                self._basis = dist.principal_basis(self.ref.cov)
            scores["spectral"] = dist.spectral_residual(summary, self.ref, self._basis)
        if "replay" in names:
            ring = self._history.get(summary.sketch.numel())
            scores["replay"] = dist.replay_score(summary.sketch, ring.rows()) if ring else 0.0
        return scores

    def warming(self, step: int) -> bool:
        return self.first_step is None or step < self.first_step + self.cfg.warmup

    def exceeded(self, scores: Mapping[str, float], step: int, *, per_sample: bool = True) -> tuple[str, ...]:
        if self.warming(step):
            return ()
        fences = self.fences if per_sample else self.step_fences
        return tuple(name for name, value in scores.items() if fences[name].exceeds(value))

    def hold(self, sender: int, summary: dist.Summary, scores: dict[str, float]) -> None:
        """Keep a sample that passed until its step closes."""
        self._pending.append((sender, summary, scores))

    def close(self) -> list[tuple[int, dict[str, float], tuple[str, ...]]]:
        """Close the open step: test each sender's step as a whole, fold in the samples
        of the senders that pass; returns ``(sender, scores, reasons)`` of those that fail."""
        if self.step is None:
            return []
        step, self.step = self.step, None
        pending, self._pending = self._pending, []
        by_sender: dict[int, list[dist.Summary]] = {}
        for sender, summary, _ in pending:
            by_sender.setdefault(sender, []).append(summary)
        failed: list[tuple[int, dict[str, float], tuple[str, ...]]] = []
        for sender, summaries in by_sender.items():
            scores = self.score(dist.mean_summary(summaries), per_sample=False)
            reasons = self.exceeded(scores, step, per_sample=False)
            if reasons:
                failed.append((sender, scores, reasons))
                continue
            for name, value in scores.items():
                self.step_fences[name].update(value)
        bad = {sender for sender, _, _ in failed}
        self.step_flags += len(bad)
        for sender, summary, scores in pending:
            if sender not in bad:
                self._fold(summary, scores)
        return failed

    def _fold(self, summary: dist.Summary, scores: Mapping[str, float]) -> None:
        """Fold an honest sample into the average, the windows and the history."""
        self.ref = summary if self.ref is None else self.ref.blend(summary, self.beta)
        self._basis = None  # the principal subspace follows the reference
        for name, value in scores.items():
            self.fences[name].update(value)
        length = summary.sketch.numel()
        if length:
            if length not in self._history:
                self._history[length] = _Ring(self.cfg.replay_window, length)
            self._history[length].push(summary.sketch)

    def fence_values(self, *, per_sample: bool = True) -> dict[str, float | None]:
        fences = self.fences if per_sample else self.step_fences
        return {name: fence.fence() for name, fence in fences.items()}


class Verifier:
    """The monitors of the boundaries one verifier rank checks, plus blame and bans.

    ``config``: the plan's ``verifier_config`` (see :class:`VerifierConfig`).
    ``boundaries``: ``(boundary index, "act" | "grad")`` pairs this verifier checks.
    """

    def __init__(self, config: Mapping[str, Any], boundaries: Sequence[tuple[int, str]]) -> None:
        self.config = VerifierConfig.from_dict(config)
        self._monitors: dict[tuple[int, str], Monitor] = {}
        for boundary, direction in boundaries:
            if direction not in DIRECTIONS:
                raise InvalidInputError(f"verifier boundary {boundary} direction", expected="act or grad",
                                        found=repr(direction))
            self._monitors[(int(boundary), direction)] = Monitor(self.config, int(boundary), direction)
        self.events: list[dict[str, Any]] = []
        self._step_flags: dict[int, list[dict[str, Any]]] = {}
        self._blamed_steps: dict[int, list[int]] = {}
        self.banned: set[int] = set()

    def monitor(self, boundary: int, direction: str) -> Monitor:
        key = (boundary, direction)
        if key not in self._monitors:
            raise InvalidInputError(f"verifier check of boundary {boundary} ({direction})",
                                    expected=f"one of {sorted(self._monitors)}", found=repr(key),
                                    fix="the plan's VERIFY instructions and verifier boundaries disagree")
        return self._monitors[key]

    def check(self, boundary: int, direction: str, tensor: torch.Tensor, *, step: int, mb: int,
              sender: int, tainted: bool = False) -> Verdict:
        """Score one received tensor; flagged samples are recorded for :meth:`end_step`."""
        mon = self.monitor(boundary, direction)
        mon.checked += 1
        if mon.first_step is None:
            mon.first_step = step
        if mon.step != step:
            self._close(mon)  # the executor skipped flag_events for the previous step
            mon.step = step
        if not bool(torch.isfinite(tensor).all()):
            return self._flag(mon, step, mb, sender, {}, ("nonfinite",))
        summary = mon.summarize(tensor)
        if summary is None:
            return self._flag(mon, step, mb, sender, {}, ("shape",))
        scores = mon.score(summary)
        if tainted:
            # Its input was already dropped upstream: whatever it looks like, the
            # sender is not to blame, and it must not teach the reference.
            mon.tainted += 1
            self.events.append(self._event("tainted", mon, step, mb, sender, scores, ()))
            return Verdict(flagged=False, tainted=True, scores=scores)
        reasons = mon.exceeded(scores, step)
        if reasons:
            return self._flag(mon, step, mb, sender, scores, reasons)
        mon.hold(sender, summary, scores)
        return Verdict(flagged=False, tainted=False, scores=scores)

    def _flag(self, mon: Monitor, step: int, mb: int, sender: int, scores: dict[str, float],
              reasons: tuple[str, ...]) -> Verdict:
        mon.flagged += 1
        event = self._event("flag", mon, step, mb, sender, scores, reasons)
        self.events.append(event)
        self._step_flags.setdefault(step, []).append(event)
        return Verdict(flagged=True, tainted=True, scores=scores, reasons=reasons)

    def _close(self, mon: Monitor) -> None:
        step = mon.step
        for sender, scores, reasons in mon.close():
            event = self._event("flag", mon, step, STEP_MB, sender, scores, reasons, per_sample=False)
            self.events.append(event)
            self._step_flags.setdefault(step, []).append(event)

    @staticmethod
    def _event(kind: str, mon: Monitor, step: int, mb: int, sender: int, scores: Mapping[str, float],
               reasons: tuple[str, ...], *, per_sample: bool = True) -> dict[str, Any]:
        fences = mon.fence_values(per_sample=per_sample)
        return {"type": kind, "step": int(step), "mb": int(mb), "boundary": mon.boundary,
                "direction": mon.direction, "sender": int(sender),
                "scope": "microbatch" if per_sample else "step",
                "scores": {k: round(float(v), 6) for k, v in scores.items()},
                "fences": {k: (None if v is None else round(v, 6)) for k, v in fences.items()},
                "reasons": list(reasons)}

    def flag_events(self, step: int) -> list[dict[str, Any]]:
        """This verifier's flags of ``step`` as plain dicts (for ``all_gather_object``).

        Call it once every microbatch of the step was checked: it closes the
        step (the step-level tests run here).
        """
        for mon in self._monitors.values():
            if mon.step == step:
                self._close(mon)
        return [dict(e) for e in self._step_flags.get(step, ())]

    def end_step(self, step: int, all_flag_events: Iterable[Any]) -> set[int]:
        """Resolve blame for ``step`` from every verifier's flags; return all banned ranks.

        ``all_flag_events``: the flags of every verifier rank, flat or one list
        per rank (as ``all_gather_object`` returns them). Every verifier gets
        the same input, so every verifier reaches the same bans.
        """
        flags = [e for e in _flatten(all_flag_events) if int(e["step"]) == step]
        for sender in sorted(blame(flags)):
            steps = self._blamed_steps.setdefault(sender, [])
            if step not in steps:
                steps.append(step)
            recent = [s for s in steps if s > step - self.config.ban_window]
            if sender not in self.banned and len(recent) >= self.config.ban_after:
                self.banned.add(sender)
                self.events.append({"type": "ban", "step": int(step), "sender": sender,
                                    "blamed_steps": list(recent)})
        self._step_flags.pop(step, None)
        return set(self.banned)

    def summary(self) -> dict[str, Any]:
        """Counts, current fences and bans, for logs and the ``--report`` file."""
        monitors = [{"boundary": b, "direction": d, "checked": m.checked, "flagged": m.flagged,
                     "step_flags": m.step_flags, "tainted": m.tainted, "fences": m.fence_values(),
                     "step_fences": m.fence_values(per_sample=False)}
                    for (b, d), m in sorted(self._monitors.items())]
        return {"monitors": monitors, "banned": sorted(self.banned),
                "blamed_steps": {str(k): list(v) for k, v in sorted(self._blamed_steps.items())},
                "flags": sum(1 for e in self.events if e["type"] == "flag"),
                "config": self.config.to_dict()}


def _flatten(events: Iterable[Any]) -> Iterable[Mapping[str, Any]]:
    for item in events:
        if isinstance(item, Mapping):
            yield item
        elif item is not None:
            yield from _flatten(item)


def _upstream_key(event: Mapping[str, Any]) -> tuple[int, int]:
    # Causal order of a microbatch: activations cross boundaries 0, 1, ... then
    # gradients cross them back from the last boundary down to 0.
    b = int(event["boundary"])
    return (0, b) if event["direction"] == "act" else (1, -b)


def blame(flags: Iterable[Mapping[str, Any]]) -> set[int]:
    """Senders to blame: per (step, microbatch), only the most upstream flag's sender."""
    first: dict[tuple[int, int], Mapping[str, Any]] = {}
    for event in flags:
        key = (int(event["step"]), int(event["mb"]))
        if key not in first or _upstream_key(event) < _upstream_key(first[key]):
            first[key] = event
    return {int(e["sender"]) for e in first.values()}
