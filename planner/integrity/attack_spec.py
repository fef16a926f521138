"""The ``--attack`` spec: its kinds, their parameters and defaults, and the parser (``attacks`` says what each
kind does)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from planner.errors import InvalidInputError

__all__ = ["KIND_PARAMS", "AttackSpec", "parse_attack"]

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
    # the tensor sent honest, its taint header set: a drop the sender makes up (``AttackHooks.taints``)
    "taint": {},
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
QUANT_CODECS = ("fp8", "int8", "int4")   # the codecs ``quant_bias`` rounds for


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
