"""The integrity verifier's configuration: one value the plan carries and the monitors read.

Its fields are the monitors' knobs (``planner.integrity``); a plan stores them
under ``verifier_config`` and ``stagewise run`` passes them on unchanged.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from planner.errors import InvalidInputError

DIRECTIONS = ("act", "grad")  # what a verifier can check at a boundary: activations forward, gradients back

ALL_DISTANCES = ("mad", "l2", "scale", "gain", "sign", "skew", "swd", "spectral", "binding", "link", "residual",
                 "drift", "replay")
# Fence floors, set on gpt-tiny training (benchmarks/verification.py; figures: benchmarks/README.md):
# sign and skew above 0.5 mean "points the other way than the reference" (one
# microbatch's skew is noisy: 0.9); a scale floor of 1.0 tolerates honest
# gradient spikes of up to e times the usual size; spectral 0.2 is four times the
# honest level of trained residual streams; binding and link near 1 mean
# "rows of other data"; residual 3 is twice its honest worst; drift 8 is the
# CUSUM's alarm level (``Cusum``, one sample per step of a sender): above clean
# training's drift, below what a residual held at 2x its median reaches in a few steps;
# replay 6 only flags copies within 1e-6 of cosine 1. ``gain`` is ``scale`` where the
# sending stage's input is at hand: the stage's own share of the size change, its input's
# removed (``Monitor.score``); a sample's may reach 1.0 honestly (0.91 at most on gpt-tiny).
DEFAULT_FLOORS = {"mad": 0.0, "l2": 0.0, "scale": 1.0, "gain": 1.0, "sign": 0.5, "skew": 0.9, "swd": 0.0,
                  "spectral": 0.2, "binding": 1.0, "link": 0.3, "residual": 3.0, "drift": 8.0, "replay": 6.0}
# A step's average is less noisy than one microbatch: it may be held closer. A step's gain
# is held at 0.5 e-folds (x1.65 or x0.61), where its raw scale needs 1.0 for the spikes a
# loss spike sends through every stage: with the input's share removed, honest steps stayed
# at most 0.22 (gpt-tiny on four T4 hosts, linked and replicated plans, lr 1e-3, seeds 0 and 1,
# 200 steps, every boundary;
# at 1.0, a sender scaling its gradients by 3, 1.1 e-folds, passed once and was learnt).
DEFAULT_STEP_FLOORS = {**DEFAULT_FLOORS, "gain": 0.5, "skew": 0.6, "spectral": 0.12, "link": 0.2, "residual": 2.5}
# Floors that replace the two above for activations (per sample and per step): an activation's size
# moves only as fast as the weights (loss spikes grow gradients, not activations), and the raw scale's
# 1.0, set for gradients, let damping by 0.5 pass where no ``gain`` test applies (calibration:
# benchmarks/README.md, tuning notes).
DEFAULT_ACT_FLOORS = {"scale": 0.5}
# Fence ratios (fence >= ratio * median): the magnitude distances swing with
# the data and with bursts of training instability (gradients above all), so
# they only flag gross corruption; the spectral share is stable from batch to
# batch and is the sensitive test.
DEFAULT_RATIOS = {"mad": 5.0, "l2": 5.0, "scale": 5.0, "gain": 5.0, "sign": 3.0, "skew": 3.0, "swd": 5.0,
                  "spectral": 2.5, "binding": 2.5, "link": 5.0, "residual": 3.0, "drift": 0.0, "replay": 3.0}


@dataclass(frozen=True, slots=True, kw_only=True)
class VerifierConfig:
    """The knobs of the monitors (the plan's ``verifier_config``; every key optional).

    ``beta_act``/``beta_grad``: EMA factors per accepted microbatch. ``window``:
    scores per fence. ``iqr_k``: the fence is ``Q3 + iqr_k * IQR``, at least
    ``floors[d]`` (``step_floors[d]`` for a step's average; ``act_floors[d]`` for both
    on activations, where given) and ``ratios[d]`` times the window's median. ``warmup`` counts steps from the first step a
    monitor sees: they are taken as honest and only teach the references.
    ``min_samples`` scores are needed before a fence exists. Bans follow a
    sequential test per sender (``planner.integrity.bans``): a CUSUM of the
    log-likelihood ratio of "blamed this step" under ``ban_attack_rate`` against
    ``ban_honest_rate``, banning at ``ln(ban_false_steps)``, so that an honest sender
    blamed in at most ``ban_honest_rate`` of its steps is banned once in
    ``ban_false_steps`` steps or fewer, on average; replay flags feed a CUSUM of their
    own, tuned to ``ban_replay_rate`` (see ``planner.integrity.bans``). ``distances``:
    the tests to run (``ALL_DISTANCES``). ``projections``/``quantiles``: the
    sliced-Wasserstein resolution; ``replay_window``: sketches remembered;
    ``drift_k``: the CUSUM's allowance per step (in robust standard deviations
    of a sender's step-level log residual score; see :class:`Cusum`, whose alarm
    level is ``step_floors["drift"]``); ``drift_spread_act``/``drift_spread_grad``:
    the least spread of that log score it assumes per direction (gradients swing
    more: a loss spike's gradients grow by e-folds on their way back while the
    activations barely move, so the activations' spread would read an honest
    stage's slow gradient rise as drift; see benchmarks/README.md).
    ``basis_refresh``: steps between two eigendecompositions of a reference (its
    principal subspace, its residuals' whitener; 1: every step, what early
    training needs, when the subspaces still turn fast); ``seed``: the
    projections' seed (the same on every verifier rank).
    """

    beta_act: float = 0.9
    beta_grad: float = 0.8
    window: int = 64
    iqr_k: float = 3.0
    warmup: int = 5
    min_samples: int = 8
    ban_false_steps: float = 1e5   # expected steps before an honest sender is banned, at least
    ban_honest_rate: float = 0.05  # the per-step blame rate honest senders stay under (clean runs: benchmarks/)
    ban_attack_rate: float = 0.6   # the per-step blame rate the test is tuned to catch fastest
    ban_replay_rate: float = 0.001  # the per-step rate of honest senders' replay flags (a CUSUM of its own)
    distances: tuple[str, ...] = ALL_DISTANCES
    floors: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_FLOORS))
    step_floors: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_STEP_FLOORS))
    ratios: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_RATIOS))
    act_floors: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_ACT_FLOORS))
    projections: int = 16
    quantiles: int = 32
    replay_window: int = 256
    drift_k: float = 1.5
    drift_spread_act: float = 0.1
    drift_spread_grad: float = 0.2
    basis_refresh: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.drift_spread_act > 0 and self.drift_spread_grad > 0):
            raise InvalidInputError("verifier_config.drift_spread_act / drift_spread_grad",
                                    expected="numbers > 0 (e.g. 0.1 / 0.2)",
                                    found=f"{self.drift_spread_act} / {self.drift_spread_grad}")
        if not self.drift_k > 0:
            raise InvalidInputError("verifier_config.drift_k", expected="a number > 0 (e.g. 1.5)",
                                    found=str(self.drift_k))
        if not self.iqr_k > 0:
            raise InvalidInputError("verifier_config.iqr_k", expected="a number > 0 (e.g. 3.0)",
                                    found=str(self.iqr_k))
        for table in ("floors", "step_floors", "ratios", "act_floors"):
            for name, value in getattr(self, table).items():
                if not value >= 0:
                    raise InvalidInputError(f"verifier_config.{table}.{name}", expected="a number >= 0",
                                            found=str(value))
        for name in ("beta_act", "beta_grad"):
            if not 0.0 < getattr(self, name) < 1.0:
                raise InvalidInputError(f"verifier_config.{name}", expected="a number in (0, 1)",
                                        found=str(getattr(self, name)))
        for name in ("window", "min_samples", "projections", "quantiles",
                     "replay_window", "basis_refresh"):
            if int(getattr(self, name)) < 1:
                raise InvalidInputError(f"verifier_config.{name}", expected=">= 1",
                                        found=str(getattr(self, name)))
        if self.warmup < 0:
            raise InvalidInputError("verifier_config.warmup", expected=">= 0 steps", found=str(self.warmup))
        if not 0.0 < self.ban_honest_rate < self.ban_attack_rate < 1.0:
            raise InvalidInputError("verifier_config.ban_honest_rate / ban_attack_rate",
                                    expected="0 < ban_honest_rate < ban_attack_rate < 1 (e.g. 0.05 / 0.6)",
                                    found=f"{self.ban_honest_rate} / {self.ban_attack_rate}")
        if not 0.0 < self.ban_replay_rate < 0.1:
            raise InvalidInputError("verifier_config.ban_replay_rate",
                                    expected="a rate in (0, 0.1): replays are rare in honest training (e.g. 0.001)",
                                    found=str(self.ban_replay_rate))
        if not self.ban_false_steps > 1.0:
            raise InvalidInputError("verifier_config.ban_false_steps", expected="a number of steps > 1 (e.g. 1e5)",
                                    found=str(self.ban_false_steps))
        unknown = [d for d in (*self.distances, *self.floors, *self.step_floors, *self.ratios, *self.act_floors)
                   if d not in ALL_DISTANCES]
        if unknown or not self.distances:
            raise InvalidInputError("verifier_config.distances", expected=f"a non-empty subset of {ALL_DISTANCES}",
                                    found=repr(unknown or list(self.distances)))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> VerifierConfig:
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
        if "act_floors" in d:
            d["act_floors"] = dict(d["act_floors"])   # replaces the defaults: {} keeps the shared floors
        try:
            return cls(**d)
        except (TypeError, ValueError) as exc:
            raise InvalidInputError("verifier_config", expected="numbers and lists as documented",
                                    found=str(exc)) from exc

    def to_dict(self) -> dict[str, Any]:
        return {name: (list(v) if isinstance(v, tuple) else dict(v) if isinstance(v, Mapping) else v)
                for name in self.__dataclass_fields__ for v in (getattr(self, name),)}
