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

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from cost_models.codecs import BITS, BLOCK
from planner.errors import InvalidInputError
from planner.integrity import distances as dist
from planner.integrity import predictors as pred
from planner.integrity import summaries as summ
from planner.integrity.thresholds import IQRFence
from planner.verifier_config import DEFAULT_FLOORS, DEFAULT_RATIOS, DEFAULT_STEP_FLOORS

COMMON_KEYS = ("rank", "kind", "start", "p", "dir")
# kind -> {parameter: default}; None means "not set" (see the kind's rule).
KIND_PARAMS: Mapping[str, Mapping[str, Any]] = {
    "constant": {"value": 1.0},
    "zeros": {},
    "random": {},
    "scale": {"factor": -1.0},
    "sign_flip": {},
    "random_sign": {},
    "delay": {"steps": 2},
    "bias": {"value": None, "rel": 1.0},
    "noise": {"std": 0.5},
    "mixed": {},
    "adaptive": {"target": "random", "margin": 0.7, "beta": 0.9, "model": "summary"},
    "quant_bias": {"codec": "int8", "frac": 0.9},
}
GRAD_KINDS = ("sign_flip", "random_sign")
MIXED_KINDS = ("constant", "zeros", "random", "scale", "sign_flip", "random_sign", "delay", "bias", "noise")
TARGET_KINDS = ("constant", "zeros", "random", "scale", "sign_flip", "random_sign", "bias", "noise")
# ``dir=params``: all-reduce poisoning, the attacker's gradient contribution to its stage's replicas' sum
# (``both`` means act and grad only: a boundary tensor and a contribution are checked by different monitors)
DIRECTIONS = ("act", "grad", "both", "params", "inputs")
PARAMS_KINDS = ("constant", "zeros", "random", "scale", "sign_flip", "random_sign", "bias", "noise")
INT_PARAMS = ("steps",)
STR_PARAMS = ("target", "model", "codec")
DISTANCE_NAMES = tuple(dist.DISTANCES)  # the distances the adaptive attacker estimates


@dataclass(frozen=True, slots=True, kw_only=True)
class AttackSpec:
    """A parsed ``--attack`` spec; ``params`` holds the kind's parameters (defaults filled in)."""

    rank: int
    kind: str
    start: int = 0
    p: float = 1.0
    direction: str = "act"
    params: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KIND_PARAMS:
            raise InvalidInputError("attack key 'kind'", expected=f"one of {sorted(KIND_PARAMS)}",
                                    found=repr(self.kind))
        if self.rank < 0:
            raise InvalidInputError("attack key 'rank'", expected="a rank >= 0", found=str(self.rank))
        if self.start < 0:
            raise InvalidInputError("attack key 'start'", expected="a step >= 0", found=str(self.start))
        if not 0.0 < self.p <= 1.0:
            raise InvalidInputError("attack key 'p'", expected="a probability in (0, 1]", found=str(self.p))
        if self.direction not in DIRECTIONS:
            raise InvalidInputError("attack key 'dir'", expected="act, grad, both, params or inputs",
                                    found=repr(self.direction))
        if self.direction == "params" and self.kind not in PARAMS_KINDS:
            raise InvalidInputError(f"attack kind {self.kind!r} with dir=params", expected=f"one of {PARAMS_KINDS}",
                                    found=repr(self.kind), fix="dir=params poisons a replica's gradient contribution")
        _check_params(self.kind, dict(self.params))

    def param(self, name: str) -> Any:
        return dict(self.params)[name]

    def targets(self, direction: str) -> bool:
        return self.direction == direction or (self.direction == "both" and direction in ("act", "grad"))

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "kind": self.kind, "start": self.start, "p": self.p,
                "dir": self.direction, **dict(self.params)}


def _check_params(kind: str, params: Mapping[str, Any]) -> None:
    if kind == "delay" and params["steps"] < 1:
        raise InvalidInputError("attack key 'steps'", expected="a delay of >= 1 steps", found=str(params["steps"]))
    if kind == "noise" and params["std"] <= 0:
        raise InvalidInputError("attack key 'std'", expected="> 0 (relative to the tensor's std)",
                                found=str(params["std"]))
    if kind == "bias" and params["value"] is not None and params["rel"] != KIND_PARAMS["bias"]["rel"]:
        raise InvalidInputError("attack key 'rel'", expected="either value= or rel= for kind bias, not both",
                                found=f"value={params['value']}, rel={params['rel']}")
    if kind == "quant_bias":
        if params["codec"] not in QUANT_CODECS:
            raise InvalidInputError("attack key 'codec'", expected=f"one of {QUANT_CODECS}", found=repr(params["codec"]))
        if not 0.0 < params["frac"] <= 4.0:
            raise InvalidInputError("attack key 'frac'", expected="a fraction of the quantization step in (0, 4]",
                                    found=str(params["frac"]))
    if kind == "adaptive":
        if params["target"] not in TARGET_KINDS:
            raise InvalidInputError("attack key 'target'", expected=f"one of {TARGET_KINDS}",
                                    found=repr(params["target"]))
        if not 0.0 < params["margin"] <= 1.0:
            raise InvalidInputError("attack key 'margin'", expected="a fraction in (0, 1]",
                                    found=str(params["margin"]))
        if not 0.0 < params["beta"] < 1.0:
            raise InvalidInputError("attack key 'beta'", expected="a number in (0, 1)", found=str(params["beta"]))
        if params["model"] not in ("summary", "full"):
            raise InvalidInputError("attack key 'model'", expected="summary or full", found=repr(params["model"]))


def _convert(key: str, raw: str) -> Any:
    try:
        if key in ("rank", "start") or key in INT_PARAMS:
            return int(raw)
        if key in ("kind", "dir") or key in STR_PARAMS:
            return raw
        return float(raw)
    except ValueError:
        kind = "an integer" if key in ("rank", "start", *INT_PARAMS) else "a number"
        raise InvalidInputError(f"attack key {key!r}", expected=kind, found=repr(raw)) from None


def parse_attack(spec: str) -> AttackSpec:
    """Parse ``"rank=2,kind=scale,factor=-1,start=5,p=1.0,dir=act"`` into an :class:`AttackSpec`."""
    fields: dict[str, Any] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        key, sep, raw = part.partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep or not key or not raw:
            raise InvalidInputError(f"attack spec part {part!r}", expected="key=value",
                                    fix='e.g. --attack "rank=2,kind=scale,factor=-1,start=5"')
        if key in fields:
            raise InvalidInputError(f"attack key {key!r}", expected="each key once", found="it twice")
        fields[key] = _convert(key, raw)
    for key in ("rank", "kind"):
        if key not in fields:
            raise InvalidInputError(f"attack key {key!r}", expected="present", found=f"spec {spec!r}",
                                    fix='e.g. --attack "rank=2,kind=zeros"')
    kind = fields["kind"]
    if kind not in KIND_PARAMS:
        raise InvalidInputError("attack key 'kind'", expected=f"one of {sorted(KIND_PARAMS)}", found=repr(kind))
    allowed = KIND_PARAMS[kind]
    for key in fields:
        if key not in COMMON_KEYS and key not in allowed:
            expected = f"one of {sorted((*COMMON_KEYS, *allowed))}"
            raise InvalidInputError(f"attack key {key!r} (kind {kind})", expected=expected, found=repr(key))
    params = tuple((k, fields.get(k, default)) for k, default in allowed.items())
    direction = fields.get("dir", "grad" if kind in GRAD_KINDS else "act")
    return AttackSpec(rank=fields["rank"], kind=kind, start=fields.get("start", 0), p=fields.get("p", 1.0),
                      direction=direction, params=params)


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts``, identical in every process (``hash`` is salted)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def feature_pattern(x: torch.Tensor, seed: int) -> torch.Tensor:
    """A fixed random +-1 pattern over the features of ``x`` (the last dim; channels of a
    4-D feature map), shaped to broadcast against ``x``; the same for every call with ``seed``."""
    dim = 1 if x.dim() == 4 else x.dim() - 1
    gen = torch.Generator().manual_seed(stable_seed("pattern", seed, x.shape[dim]))
    signs = torch.randint(0, 2, (x.shape[dim],), generator=gen).float() * 2 - 1
    shape = [1] * x.dim()
    shape[dim] = x.shape[dim]
    return signs.reshape(shape)


def corrupt(kind: str, x: torch.Tensor, params: Mapping[str, Any], gen: torch.Generator, *,
            pattern_seed: int = 0) -> torch.Tensor:
    """Apply one stateless attack ``kind`` to ``x``; returns a new tensor of ``x``'s dtype.
    ``gen`` drives the per-call randomness; ``pattern_seed`` fixes the bias pattern."""
    xf = x.detach().float()
    if kind == "constant":
        out = torch.full_like(xf, float(params.get("value", 1.0)))
    elif kind == "zeros":
        out = torch.zeros_like(xf)
    elif kind == "random":
        noise = torch.randn(xf.shape, generator=gen)
        out = xf.mean() + xf.std(correction=0) * noise
    elif kind == "scale":
        out = xf * float(params.get("factor", -1.0))
    elif kind == "sign_flip":
        out = -xf
    elif kind == "random_sign":
        signs = torch.randint(0, 2, xf.shape, generator=gen).float() * 2 - 1
        out = xf * signs
    elif kind == "bias":
        value = params.get("value")
        shift = float(value) if value is not None else float(params.get("rel", 1.0)) * float(xf.std(correction=0))
        out = xf + shift * feature_pattern(xf, pattern_seed)
    elif kind == "noise":
        out = xf + float(params.get("std", 0.5)) * xf.std(correction=0) * torch.randn(xf.shape, generator=gen)
    else:
        raise AssertionError(f"{kind} is not a stateless attack")
    return out.to(dtype=x.dtype)


QUANT_CODECS = ("fp8", "int8", "int4")
# float8 formats' mantissa bits and smallest normal exponent (activations e4m3fn, gradients e5m2: the wire's choice)
_FP8_FORMATS = {"act": (3, -6, torch.float8_e4m3fn), "grad": (2, -14, torch.float8_e5m2)}


def quant_step(x: torch.Tensor, codec: str, direction: str) -> torch.Tensor:
    """The spacing of ``codec``'s grid at each element of ``x`` (the wire's scheme, ``planner.runtime.wire.codecs``):
    for int8/int4 its block's absmax / (2^(bits-1) - 1) over the flattened tensor, for fp8 the float8 spacing at
    the element under its block's (else the tensor's) absmax scale. Rounding to nearest errs by half of it."""
    flat = x.detach().float().reshape(-1)
    block = BLOCK.get(codec, max(1, flat.numel()))
    pad = (-flat.numel()) % block
    blocks = torch.nn.functional.pad(flat, (0, pad)).reshape(-1, block)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    if codec == "fp8":
        mantissa, min_exp, fmt = _FP8_FORMATS["grad" if direction == "grad" else "act"]
        scale = absmax.clamp_min(1e-30) / torch.finfo(fmt).max
        exp = torch.floor(torch.log2((blocks.abs() / scale).clamp_min(1e-30))).clamp_min(min_exp)
        steps = torch.exp2(exp - mantissa) * scale
    else:
        steps = (absmax / (2 ** (BITS[codec] - 1) - 1)).expand_as(blocks)
    return steps.reshape(-1)[:flat.numel()].reshape(x.shape)


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
