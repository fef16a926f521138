"""Metis's measured per-layer profiles, read as a device's calibration.

Metis (SamsungLabs/Metis, ``profile_data_samples/``) profiles one training
iteration per device type, tensor-parallel degree and batch size, one JSON file
each, named ``DeviceType.{device}_tp{tp}_bs{batch}.json``: per layer the
forward+backward time (``execution_time.layer_compute_total_ms``), the memory
(``execution_memory.layer_memory_total_mb``) and the parameter bytes, and the
iteration's totals. Its GPT profiles list the embedding first, the head last
and the transformer layers between them. The files do not record the layers'
shape (Metis takes hidden size and sequence length on its command line), so
the reader is told them (:class:`GPTLayerShape`).

A device's calibration (:func:`calibrate_from_metis`): the transformer layers
of its ``tp1`` files (at ``tp > 1`` a layer's time includes tensor-parallel
all-reduces, which a single device's rate must not absorb) beside what our
cost model prices for a GPT layer of that shape (:func:`gpt_layer_figures`),
fitted by :func:`cost_models.measured.fit_calibration`: the efficiency of the
profiled dtype and the per-op overhead. The files are data: parsed as JSON and
validated, never executed.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import jsonschema

from cost_models.compute import BWD_OPS_FACTOR, BWD_TRAFFIC_FACTOR, roofline_ms
from cost_models.devices import DeviceSpec
from cost_models.measured import BlockSample, Calibration, fit_calibration
from planner.errors import InvalidInputError
from planner.ir import dtype_bytes

FILE_NAME = re.compile(r"DeviceType\.(?P<device>[A-Za-z0-9-]+(?:_[A-Za-z0-9-]+)*?)_tp(?P<tp>\d+)_bs(?P<bs>\d+)\.json")
MAX_FILE_BYTES = 16 << 20  # a profile is a few kB; refuse to parse anything absurd
# The profile dtype's figure is fitted; the other half-precision dtype shares the tensor cores (and, in the
# catalog, the peak), so it takes the same figure where its peak is the same.
HALF = ("float16", "bfloat16")
FIT_DTYPES = ("float32",) + HALF
UNRELIABLE_FIT = 0.4  # median error above which the layers do not follow one rate (cf. planner.rehearsal)

# Our GPT layer (models.gpt.GPTBlock: pre-LayerNorm, causal attention, 4h GELU MLP) as our tracer counts it
# (tests/unit/test_metis_profile.py checks these against planner.trace): ops per forward, and the elements
# its ops read and write beyond the weights, per token and hidden unit.
GPT_LAYER_OPS = 22
GPT_LAYER_ACT_ELEMENTS_PER_TOKEN_H = 40

_NUMBERS = {"type": "array", "minItems": 3, "items": {"type": "number", "minimum": 0}}
_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["model", "execution_time", "execution_memory"],
    "properties": {
        "model": {
            "type": "object",
            "required": ["model_name", "num_layers", "parameters"],
            "properties": {
                "model_name": {"type": "string"},
                "num_layers": {"type": "integer", "minimum": 3},
                "parameters": {
                    "type": "object",
                    "required": ["parameters_per_layer_bytes"],
                    "properties": {"total_parameters_bytes": {"type": "number", "minimum": 0},
                                   "parameters_per_layer_bytes": _NUMBERS},
                },
            },
        },
        "execution_time": {
            "type": "object",
            "required": ["layer_compute_total_ms"],
            "properties": {
                "layer_compute_total_ms": {**_NUMBERS, "items": {"type": "number", "exclusiveMinimum": 0}},
                **{k: {"type": "number", "minimum": 0} for k in (
                    "total_time_ms", "forward_backward_time_ms", "batch_generator_time_ms",
                    "layernorm_grads_all_reduce_time_ms", "embedding_grads_all_reduce_time_ms",
                    "optimizer_time_ms")},
            },
        },
        "execution_memory": {
            "type": "object",
            "required": ["layer_memory_total_mb"],
            "properties": {"layer_memory_total_mb": _NUMBERS},
        },
    },
}


@dataclass(frozen=True, slots=True, kw_only=True)
class MetisProfile:
    """One Metis profile file: a device type, tensor-parallel degree and batch size, per layer figures."""

    path: str
    device: str
    tp: int
    batch_size: int
    model_name: str
    layer_compute_ms: tuple[float, ...]  # forward + backward, per layer
    layer_memory_mb: tuple[float, ...]
    layer_param_bytes: tuple[float, ...]
    optimizer_ms: float | None = None

    @property
    def transformer_layers(self) -> range:
        """Indices of the transformer layers: all but the first (embedding) and the last (head)."""
        return range(1, len(self.layer_compute_ms) - 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class GPTLayerShape:
    """What a Metis file leaves out: the profiled layer's hidden size and sequence length."""

    hidden_size: int
    seq_len: int

    def __post_init__(self) -> None:
        for name in ("hidden_size", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidInputError(f"Metis profile {name}", expected="a whole number >= 1", found=repr(value),
                                        fix="give the shape the profile was taken at (Metis's --hidden_size, "
                                            "--sequence_length)")


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerFigures:
    """What our cost model prices one GPT layer from, per microbatch (see :mod:`cost_models.compute`)."""

    fwd_flops: int
    bwd_flops: int
    mem_traffic_bytes: int
    n_ops: int


def gpt_layer_figures(shape: GPTLayerShape, batch: int, dtype: str) -> LayerFigures:
    """FLOPs, traffic and ops of one GPT layer: ``24*b*s*h^2 + 4*b*s^2*h`` FLOPs forward (the four h x h
    projections and the 4h MLP: 24 b s h^2; scores and weighted values: 4 b s^2 h, causal masking not
    subtracted, as SDPA computes it), backward twice that; traffic: the weights (12 h^2 + 13 h) and 40
    elements per token and hidden unit of activations, in ``dtype``'s bytes."""
    b, s, h = batch, shape.seq_len, shape.hidden_size
    fwd = 24 * b * s * h * h + 4 * b * s * s * h
    elements = 12 * h * h + 13 * h + GPT_LAYER_ACT_ELEMENTS_PER_TOKEN_H * b * s * h
    return LayerFigures(fwd_flops=fwd, bwd_flops=2 * fwd, mem_traffic_bytes=elements * dtype_bytes(dtype),
                        n_ops=GPT_LAYER_OPS)


def priced_layer_ms(spec: DeviceSpec, shape: GPTLayerShape, batch: int, dtype: str) -> float:
    """Forward + backward of one GPT layer on ``spec`` as :mod:`cost_models.compute` prices a block."""
    f = gpt_layer_figures(shape, batch, dtype)
    return (roofline_ms(f.fwd_flops, f.mem_traffic_bytes, f.n_ops, spec, dtype)
            + roofline_ms(f.bwd_flops, BWD_TRAFFIC_FACTOR * f.mem_traffic_bytes, BWD_OPS_FACTOR * f.n_ops, spec, dtype))


def layer_tflops(profile: MetisProfile, shape: GPTLayerShape, layer: int) -> float:
    """The FLOP rate one layer of ``profile`` reached (TFLOP/s, per tensor-parallel device)."""
    f = gpt_layer_figures(shape, profile.batch_size, "float16")
    return (f.fwd_flops + f.bwd_flops) / profile.tp / (profile.layer_compute_ms[layer] * 1e-3) / 1e12


# --- reading ---------------------------------------------------------------------------------------
def _bad(path: Path, what: str, *, expected: str, found: str, fix: str | None = None) -> InvalidInputError:
    return InvalidInputError(f"Metis profile {str(path)!r}: {what}" if what else f"Metis profile {str(path)!r}",
                             expected=expected, found=found,
                             fix=fix or "use a file written by Metis's profiler (see SamsungLabs/Metis README)")


def _load_json(path: Path) -> Any:
    if path.stat().st_size > MAX_FILE_BYTES:
        raise _bad(path, "", expected=f"a profile of at most {MAX_FILE_BYTES >> 20} MiB",
                   found=f"{path.stat().st_size} bytes")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise _bad(path, "", expected="a JSON file", found=f"unreadable: {exc}") from None


def _check_schema(path: Path, doc: Any) -> None:
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(_SCHEMA).iter_errors(doc))
    if error is not None:
        where = ".".join(str(p) for p in error.absolute_path) or "the document"
        raise _bad(path, where, expected="Metis's profile layout (model, execution_time, execution_memory)",
                   found=error.message[:200])


def read_metis_profile(path: str | Path) -> MetisProfile:
    """One Metis profile file, validated: its name gives the device, tp and batch size."""
    p = Path(path)
    if not p.is_file():
        raise _bad(p, "", expected="an existing file (or a directory of them)", found="no such file",
                   fix="check the path (relative to the cluster file)")
    name = FILE_NAME.fullmatch(p.name)
    if name is None:
        raise _bad(p, "file name", expected="DeviceType.{device}_tp{tp}_bs{batch}.json (Metis's naming)",
                   found=repr(p.name), fix="rename it: the batch size and tp degree are only in the name")
    doc = _load_json(p)
    _check_schema(p, doc)
    n = doc["model"]["num_layers"]
    per_layer = {"execution_time.layer_compute_total_ms": doc["execution_time"]["layer_compute_total_ms"],
                 "execution_memory.layer_memory_total_mb": doc["execution_memory"]["layer_memory_total_mb"],
                 "model.parameters.parameters_per_layer_bytes": doc["model"]["parameters"]["parameters_per_layer_bytes"]}
    for key, values in per_layer.items():
        if len(values) != n:
            raise _bad(p, key, expected=f"one value per layer (model.num_layers = {n})", found=f"{len(values)} values")
    tp, batch = int(name["tp"]), int(name["bs"])
    if tp < 1 or batch < 1:
        raise _bad(p, "file name", expected="tp and bs >= 1", found=repr(p.name))
    optimizer = doc["execution_time"].get("optimizer_time_ms")
    return MetisProfile(path=str(p), device=name["device"], tp=tp, batch_size=batch,
                        model_name=doc["model"]["model_name"],
                        layer_compute_ms=tuple(float(v) for v in per_layer["execution_time.layer_compute_total_ms"]),
                        layer_memory_mb=tuple(float(v) for v in per_layer["execution_memory.layer_memory_total_mb"]),
                        layer_param_bytes=tuple(float(v) for v in
                                                per_layer["model.parameters.parameters_per_layer_bytes"]),
                        optimizer_ms=None if optimizer is None else float(optimizer))


def read_metis_profiles(path: str | Path) -> tuple[MetisProfile, ...]:
    """A profile file, or every ``DeviceType.*.json`` of a directory (Metis's layout), sorted by name."""
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("DeviceType.*.json"))
        if not files:
            raise InvalidInputError(f"Metis profile directory {str(p)!r}",
                                    expected="DeviceType.{device}_tp{tp}_bs{batch}.json files", found="none",
                                    fix="point it at Metis's profile_data directory, or at one file")
        return tuple(read_metis_profile(f) for f in files)
    return (read_metis_profile(p),)


# --- calibration -----------------------------------------------------------------------------------
def metis_samples(profiles: Sequence[MetisProfile], shape: GPTLayerShape, dtype: str) -> list[BlockSample]:
    """The transformer layers of ``profiles`` beside our figures for them. Metis times forward and backward
    together; the sum is split in the ratio of their FLOPs (1:2), which is how the cost model prices a
    compute-bound layer, so the fit sees the measured total unchanged."""
    samples = []
    for prof in profiles:
        f = gpt_layer_figures(shape, prof.batch_size, dtype)
        fwd_share = f.fwd_flops / (f.fwd_flops + f.bwd_flops)
        for i in prof.transformer_layers:
            total = prof.layer_compute_ms[i]
            samples.append(BlockSample(name=f"{Path(prof.path).name}:layer{i}", fwd_ms=total * fwd_share,
                                       bwd_ms=total * (1 - fwd_share), fwd_flops=f.fwd_flops, bwd_flops=f.bwd_flops,
                                       mem_traffic_bytes=f.mem_traffic_bytes, n_ops=f.n_ops))
    return samples


def _normalised(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _own_tp1_files(profiles: Sequence[MetisProfile], spec: DeviceSpec) -> list[MetisProfile]:
    """The tp1 files of ``spec``'s device type among ``profiles`` (Metis keeps every device's files in one
    directory): ``DeviceType.A100`` is an ``A100-40GB``; the longest matching name wins (``A100-80GB``
    over ``A100``)."""
    matching = [p for p in profiles if _normalised(p.device) in _normalised(spec.name)]
    if not matching:
        raise InvalidInputError(f"Metis profiles for {spec.name}", expected="files of that device type",
                                found=", ".join(sorted({f"DeviceType.{p.device}" for p in profiles})),
                                fix="point it at this device type's profiles")
    device = max((p.device for p in matching), key=lambda d: len(_normalised(d)))
    own = [p for p in matching if p.device == device]
    tp1 = [p for p in own if p.tp == 1]
    if not tp1:
        raise InvalidInputError(f"Metis profiles for {spec.name}", expected="tp1 files (one device per layer)",
                                found=", ".join(sorted({f"tp{p.tp}" for p in own})),
                                fix="profile with tensor parallelism 1: at tp > 1 a layer's time includes "
                                    "its all-reduces")
    return tp1


def calibrate_from_metis(spec: DeviceSpec, profiles: Sequence[MetisProfile], shape: GPTLayerShape,
                         dtype: str = "float16") -> tuple[DeviceSpec, Calibration]:
    """``spec`` with the efficiency of ``dtype`` (and of the other half-precision dtype, where it has the same
    peak) and the per-op overhead fitted to the transformer layers of the tp1 files of ``spec``'s device
    type among ``profiles``."""
    if dtype not in FIT_DTYPES:
        raise InvalidInputError("Metis profile dtype", expected=f"one of {', '.join(FIT_DTYPES)}", found=repr(dtype))
    if not profiles:
        raise InvalidInputError(f"Metis profiles for {spec.name}", expected="at least one file", found="none")
    tp1 = _own_tp1_files(profiles, spec)
    peak = spec.flops_per_s(dtype)
    cal = fit_calibration(metis_samples(tp1, shape, dtype), peak_flops=peak, mem_bw_bytes_per_s=spec.mem_bw_bytes_per_s)
    files = ", ".join(sorted(Path(p.path).name for p in tp1))
    if cal.peak_scale > 1.0 or cal.median_abs_rel_err > UNRELIABLE_FIT:
        raise InvalidInputError(
            f"Metis profiles for {spec.name} ({files})",
            expected=f"layer times that {dtype} at {peak / 1e12:.0f} TFLOP/s peak can explain with one rate",
            found=f"efficiency {cal.efficiency * cal.peak_scale:.2f}, median error {cal.median_abs_rel_err:.0%}",
            fix="check hidden_size, seq_len and dtype: they must be those the profile was taken at")
    calibrated = spec.with_dtype_efficiency(dtype, cal.efficiency)
    if dtype in HALF:
        other = HALF[1 - HALF.index(dtype)]
        if other in dict(spec.peak_flops) and spec.flops_per_s(other) == peak:
            calibrated = calibrated.with_dtype_efficiency(other, cal.efficiency)
    source = f"{spec.source}; {dtype} efficiency fitted to Metis profiles {files}".lstrip("; ")
    return replace(calibrated, op_overhead_ms=cal.op_overhead_ms, measured=True, source=source), cal
