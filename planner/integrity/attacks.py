"""The attack harness: what a malicious rank does to the tensors it sends.

``stagewise run --attack "rank=2,kind=scale,factor=-1,start=5,p=1.0,dir=act"``
makes rank 2 multiply every activation it sends by -1 from step 5 on. The
attacker applies the corruption once, to the tensor it sends both to its
consumer and to the verifier. Kinds (SENTINEL's attack set):

============  ==================================================================
constant      every element = ``value`` (default 1.0)
zeros         every element = 0
random        i.i.d. normal values with the honest tensor's global mean and std
scale         ``factor`` * x (default -1: the sign flip)
sign_flip     -x (default direction: gradients)
random_sign   each element's sign flipped with probability 1/2 (default: gradients)
delay         a stale worker: sends, for each microbatch, its honest result of ``steps``
              steps ago (the first ``steps`` steps replay tensors the verifier saw,
              later ones are results it never saw)
bias          x + ``value`` * u, or x + ``rel`` * std(x) * u when no value is given
              (rel 1.0); u is a fixed random +-1 pattern over the features. (A
              uniform shift would be no attack at all on a transformer: the next
              LayerNorm subtracts it exactly.)
noise         x + N(0, (``std`` * std(x))^2): small, "invisible" noise (std 0.5)
mixed         one of the kinds above, chosen at random per microbatch
adaptive      stays just inside the running average (see :class:`AdaptiveState`;
              ``model=full``: the white-box variant that also models the link tests)
quant_bias    x + ``frac`` * (``codec``'s quantization step at x) * u, u the fixed
              +-1 feature pattern of ``bias``: a bias the size of the boundary codec's
              rounding error (:func:`quant_step`), sent in place of honest rounding noise
============  ==================================================================

Common keys: ``rank`` (required), ``kind`` (required), ``start`` (first
attacked step, default 0), ``p`` (probability per microbatch, default 1.0),
``dir`` (``act``, ``grad``, ``both``, or ``params``: the rank's gradient contribution to its
stage's replicas' all-reduce, as ``gradient scale / sign flip / noise`` poisoning; ``inputs``: the inputs a
replica forwards its auditor where its stage is audited from signed inputs, a forgery). Everything is deterministic given the
seed: the random draws of a microbatch depend on (seed, step, mb, direction)
only, never on the global torch RNG or on call order.
"""
from __future__ import annotations

import torch

from planner.errors import InvalidInputError
from planner.integrity.adaptive_attack import AdaptiveState
from planner.integrity.attack_spec import (
    KIND_PARAMS,
    MIXED_KINDS,
    AttackSpec,
    parse_attack,
)
from planner.integrity.corruptions import (
    corrupt,
    feature_pattern,
    quant_step,
    stable_seed,
)

__all__ = ["KIND_PARAMS", "AdaptiveState", "AttackSpec", "Attacker", "corrupt", "feature_pattern", "parse_attack",
           "quant_step", "stable_seed"]


class Attacker:
    """Applies an :class:`AttackSpec` to the tensors its rank sends.

    ``log`` lists ``(step, mb, direction, kind)`` of every tensor actually
    corrupted (ground truth for detection metrics); a delay with no old tensor
    to replay yet, or a draw above ``p``, leaves the tensor honest.
    """

    def __init__(self, spec: AttackSpec, seed: int = 0) -> None:
        self.spec = spec
        self.seed = int(seed)
        self.log: list[tuple[int, int, str, str]] = []
        self._sent: dict[tuple[str, int, int], torch.Tensor] = {}
        self._adaptive: dict[str, AdaptiveState] = {}

    def attacked_steps(self) -> set[int]:
        return {step for step, _, _, _ in self.log}

    def apply(self, tensor: torch.Tensor, *, direction: str, step: int, mb: int,
              stage_input: torch.Tensor | None = None) -> torch.Tensor:
        """What this rank sends instead of ``tensor`` (``tensor`` itself when it stays honest).

        ``stage_input``: what the stage computed ``tensor`` from (its input activation,
        or the gradient it received), for the white-box adaptive attacker only."""
        if direction not in ("act", "grad", "params", "inputs"):
            raise InvalidInputError("attack direction", expected="act, grad, params or inputs", found=repr(direction))
        honest = tensor.detach()
        if self.spec.kind in ("delay", "mixed"):
            self._remember(honest, direction, step, mb)
        kind, gen = self._draw(direction, step, mb)
        out = None if kind is None else self._corrupt(kind, honest, direction, step, mb, gen, stage_input)
        if out is None:
            if self.spec.kind == "adaptive":
                self._adaptive_state(direction).observe(honest, stage_input)
            return tensor
        self.log.append((step, mb, direction, kind))
        return out.to(dtype=tensor.dtype, device=tensor.device)

    def _draw(self, direction: str, step: int, mb: int) -> tuple[str | None, torch.Generator]:
        """The kind of corruption for this microbatch (None: stay honest) and its generator."""
        spec = self.spec
        gen = torch.Generator().manual_seed(stable_seed(self.seed, spec.rank, step, mb, direction))
        if not spec.targets(direction) or step < spec.start or float(torch.rand((), generator=gen)) >= spec.p:
            return None, gen
        if spec.kind == "mixed":
            return MIXED_KINDS[int(torch.randint(len(MIXED_KINDS), (), generator=gen))], gen
        return spec.kind, gen

    def _corrupt(self, kind: str, honest: torch.Tensor, direction: str, step: int, mb: int,
                 gen: torch.Generator, stage_input: torch.Tensor | None = None) -> torch.Tensor | None:
        """The corrupted tensor, or None when this kind has nothing to send yet."""
        if kind == "adaptive":
            target_kind = self.spec.param("target")
            target = corrupt(target_kind, honest, dict(KIND_PARAMS[target_kind]), gen, pattern_seed=self.seed)
            out = self._adaptive_state(direction).blend(honest, target, stage_input)   # learns from what it sends
            return None if out is honest else out
        if kind == "quant_bias":
            p = dict(self.spec.params)
            step_size = quant_step(honest, p["codec"], direction)
            return honest.float() + float(p["frac"]) * step_size * feature_pattern(honest, self.seed)
        if kind == "delay":
            old = self._sent.get((direction, step - self._delay_steps(), mb))
            return None if old is None or old.shape != honest.shape else old.clone()
        params = dict(self.spec.params) if kind == self.spec.kind else dict(KIND_PARAMS[kind])
        return corrupt(kind, honest, params, gen, pattern_seed=self.seed)

    def _adaptive_state(self, direction: str) -> AdaptiveState:
        if direction not in self._adaptive:
            self._adaptive[direction] = AdaptiveState(dict(self.spec.params), seed=self.seed)
        return self._adaptive[direction]

    def _delay_steps(self) -> int:
        return int(self.spec.param("steps") if self.spec.kind == "delay" else KIND_PARAMS["delay"]["steps"])

    def _remember(self, honest: torch.Tensor, direction: str, step: int, mb: int) -> None:
        """Keep the honest result for a later replay, and only what a replay can still need."""
        self._sent[(direction, step, mb)] = honest.to("cpu", copy=True)
        for key in [k for k in self._sent if k[1] < step - self._delay_steps()]:
            del self._sent[key]
