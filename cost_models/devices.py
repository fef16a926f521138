"""Accelerator specifications: a catalog of datasheet figures, and measured profiles.

A :class:`DeviceSpec` is what the pure cost functions (``compute.py``) need to
price a block on a device: peak dense FLOP/s per dtype, memory size and
bandwidth, and an ``efficiency`` factor (the fraction of peak that real
training blocks reach). Catalog entries carry vendor datasheet figures and a
typical efficiency; a profile JSON written by ``stagewise profile`` carries
figures measured on this machine and an efficiency fitted to measured block
times (see ``cost_models/profile.py``).

All FLOP/s figures are *dense* (no 2:4 structured sparsity). ``float32`` is
plain FP32 (PyTorch does not use TF32 for matmuls unless asked to);
``tfloat32`` is listed separately where the hardware has it. Half-precision
tensor-core figures are with FP32 accumulation, which is what PyTorch uses.
"""
from __future__ import annotations

import difflib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, Mapping

from planner.errors import InvalidInputError

DeviceKind = Literal["gpu", "cpu"]
KNOWN_DTYPES: tuple[str, ...] = ("float32", "tfloat32", "bfloat16", "float16", "float64")
PROFILE_SCHEMA = "stagewise-profile/1"

_TERA = 1e12
_GB = 1e9  # datasheets quote decimal GB/s for bandwidth
_GIB = 1 << 30  # ... and binary GB for memory size


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceSpec:
    """One kind of device.

    ``peak_flops`` maps dtype name -> dense FLOP/s as ``(dtype, flops)`` pairs.
    A dtype the device lacks native support for (bfloat16 on T4/V100) falls
    back to the float32 rate, which is how PyTorch runs it there (upcast).
    ``op_overhead_ms`` is the fixed cost of launching/dispatching one op
    (calibrated by a profile; 0 for catalog entries). ``measured`` marks a spec
    that came from a profile; ``p2p_*`` are the measured local point-to-point
    figures from that profile, if any.
    """

    name: str
    peak_flops: tuple[tuple[str, float], ...]
    mem_bytes: int
    mem_bw_bytes_per_s: float
    efficiency: float = 0.5
    kind: DeviceKind = "gpu"
    op_overhead_ms: float = 0.0
    source: str = ""
    measured: bool = False
    p2p_bandwidth_gbps: float | None = None
    p2p_latency_ms: float | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise InvalidInputError("device name", expected="a non-empty string", found=repr(self.name))
        if not self.peak_flops:
            raise InvalidInputError(f"device {self.name}: peak_flops", expected="at least a float32 entry",
                                    found="none")
        seen: set[str] = set()
        for dtype, flops in self.peak_flops:
            if dtype not in KNOWN_DTYPES:
                raise InvalidInputError(f"device {self.name}: peak_flops dtype", expected=f"one of {KNOWN_DTYPES}",
                                        found=repr(dtype))
            if dtype in seen:
                raise InvalidInputError(f"device {self.name}: peak_flops", expected="each dtype once",
                                        found=f"{dtype} twice")
            seen.add(dtype)
            _check_positive(f"device {self.name}: peak_flops[{dtype}]", flops)
        if "float32" not in seen:
            raise InvalidInputError(f"device {self.name}: peak_flops", expected="a float32 entry",
                                    found=", ".join(sorted(seen)))
        if not isinstance(self.mem_bytes, int) or self.mem_bytes <= 0:
            raise InvalidInputError(f"device {self.name}: mem_bytes", expected="a positive int",
                                    found=repr(self.mem_bytes))
        _check_positive(f"device {self.name}: mem_bw_bytes_per_s", self.mem_bw_bytes_per_s)
        if not (0.0 < self.efficiency <= 1.0):
            raise InvalidInputError(f"device {self.name}: efficiency", expected="a fraction in (0, 1]",
                                    found=repr(self.efficiency))
        if self.kind not in ("gpu", "cpu"):
            raise InvalidInputError(f"device {self.name}: kind", expected="gpu or cpu", found=repr(self.kind))
        if not (self.op_overhead_ms >= 0.0 and math.isfinite(self.op_overhead_ms)):
            raise InvalidInputError(f"device {self.name}: op_overhead_ms", expected=">= 0",
                                    found=repr(self.op_overhead_ms))
        if self.p2p_bandwidth_gbps is not None:
            _check_positive(f"device {self.name}: p2p_bandwidth_gbps", self.p2p_bandwidth_gbps)
        if self.p2p_latency_ms is not None and not self.p2p_latency_ms >= 0.0:
            raise InvalidInputError(f"device {self.name}: p2p_latency_ms", expected=">= 0",
                                    found=repr(self.p2p_latency_ms))

    def flops_per_s(self, dtype: str) -> float:
        """Peak dense FLOP/s for ``dtype`` (unsupported low precision runs at the float32 rate)."""
        key = dtype.removeprefix("torch.")
        if key not in KNOWN_DTYPES:
            raise InvalidInputError(f"dtype for device {self.name}", expected=f"one of {KNOWN_DTYPES}",
                                    found=repr(dtype))
        table = dict(self.peak_flops)
        if key in table:
            return table[key]
        return table["float32"]

    def effective_flops_per_s(self, dtype: str) -> float:
        """What training blocks actually reach: peak times efficiency."""
        return self.flops_per_s(dtype) * self.efficiency

    @property
    def mem_gib(self) -> float:
        return self.mem_bytes / _GIB

    def with_efficiency(self, efficiency: float) -> "DeviceSpec":
        """A copy with another efficiency (e.g. a calibrated one from a cluster file)."""
        return _replace(self, efficiency=efficiency)

    # --- (de)serialisation ----------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "kind": self.kind,
            "peak_flops": {k: v for k, v in self.peak_flops},
            "mem_bytes": self.mem_bytes,
            "mem_bw_bytes_per_s": self.mem_bw_bytes_per_s,
            "efficiency": self.efficiency,
            "op_overhead_ms": self.op_overhead_ms,
            "source": self.source,
            "measured": self.measured,
        }
        if self.p2p_bandwidth_gbps is not None:
            d["p2p_bandwidth_gbps"] = self.p2p_bandwidth_gbps
        if self.p2p_latency_ms is not None:
            d["p2p_latency_ms"] = self.p2p_latency_ms
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str = "device spec") -> "DeviceSpec":
        allowed = {"name", "kind", "peak_flops", "mem_bytes", "mem_bw_bytes_per_s", "efficiency",
                   "op_overhead_ms", "source", "measured", "p2p_bandwidth_gbps", "p2p_latency_ms"}
        if not isinstance(d, Mapping):
            raise InvalidInputError(where, expected="a mapping", found=type(d).__name__)
        unknown = sorted(set(d) - allowed)
        if unknown:
            raise InvalidInputError(f"{where}: unknown field {unknown[0]!r}", expected=f"fields {sorted(allowed)}")
        missing = sorted({"name", "peak_flops", "mem_bytes", "mem_bw_bytes_per_s"} - set(d))
        if missing:
            raise InvalidInputError(f"{where}: missing field {missing[0]!r}",
                                    expected="name, peak_flops, mem_bytes, mem_bw_bytes_per_s")
        flops = d["peak_flops"]
        if not isinstance(flops, Mapping):
            raise InvalidInputError(f"{where}: peak_flops", expected="a mapping dtype -> FLOP/s",
                                    found=type(flops).__name__)
        kwargs = {k: v for k, v in d.items() if k != "peak_flops"}
        try:
            return cls(peak_flops=tuple((str(k), float(v)) for k, v in flops.items()), **kwargs)
        except (TypeError, ValueError) as exc:
            raise InvalidInputError(where, expected="numbers for the figures", found=str(exc)) from None


def _check_positive(what: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (value > 0 and math.isfinite(value)):
        raise InvalidInputError(what, expected="a positive finite number", found=repr(value))


def _replace(spec: DeviceSpec, **changes: Any) -> DeviceSpec:
    fields = {f: getattr(spec, f) for f in DeviceSpec.__dataclass_fields__}
    fields.update(changes)
    return DeviceSpec(**fields)


def _gpu(name: str, *, fp32: float, bf16: float | None, fp16: float, tf32: float | None,
         mem_gib: float, bw_gbs: float, efficiency: float, source: str) -> DeviceSpec:
    flops = [("float32", fp32 * _TERA), ("float16", fp16 * _TERA)]
    if bf16 is not None:
        flops.append(("bfloat16", bf16 * _TERA))
    if tf32 is not None:
        flops.append(("tfloat32", tf32 * _TERA))
    return DeviceSpec(name=name, peak_flops=tuple(flops), mem_bytes=int(mem_gib * _GIB),
                      mem_bw_bytes_per_s=bw_gbs * _GB, efficiency=efficiency, kind="gpu", source=source)


# Efficiency: the fraction of peak a transformer training step reaches. Large
# datacenter parts reach ~0.4-0.5 MFU in practice (PaLM / Megatron reports);
# consumer and inference cards with small caches somewhat less. A profile
# replaces these guesses with a fitted figure.
CATALOG: Mapping[str, DeviceSpec] = MappingProxyType({s.name: s for s in (
    # NVIDIA T4 Tensor Core GPU datasheet: FP32 8.1 TF, mixed FP16/FP32 65 TF, 16 GB GDDR6, 320 GB/s.
    # Turing has no BF16: bfloat16 runs at the FP32 rate.
    _gpu("T4", fp32=8.1, bf16=None, fp16=65.0, tf32=None, mem_gib=16, bw_gbs=320, efficiency=0.35,
         source="NVIDIA T4 Tensor Core GPU datasheet"),
    # NVIDIA Tesla V100 datasheet (SXM2): FP32 15.7 TF, Tensor 125 TF, HBM2 900 GB/s; 16 or 32 GB.
    _gpu("V100-16GB", fp32=15.7, bf16=None, fp16=125.0, tf32=None, mem_gib=16, bw_gbs=900, efficiency=0.4,
         source="NVIDIA Tesla V100 GPU datasheet (SXM2)"),
    _gpu("V100-32GB", fp32=15.7, bf16=None, fp16=125.0, tf32=None, mem_gib=32, bw_gbs=900, efficiency=0.4,
         source="NVIDIA Tesla V100 GPU datasheet (SXM2)"),
    # A10G (AWS EC2 G5 variant of the A10; NVIDIA publishes no separate sheet): FP32 35 TF,
    # TF32 35 TF, BF16/FP16 tensor 70 TF dense, 24 GB GDDR6 at 600 GB/s (AWS G5 / Baseten "A10 vs A10G").
    _gpu("A10G", fp32=35.0, bf16=70.0, fp16=70.0, tf32=35.0, mem_gib=24, bw_gbs=600, efficiency=0.4,
         source="AWS EC2 G5 A10G specification"),
    # NVIDIA L4 Tensor Core GPU datasheet: FP32 30.3 TF, TF32 60 TF, BF16/FP16 121 TF dense
    # (242 with sparsity), 24 GB GDDR6, 300 GB/s.
    _gpu("L4", fp32=30.3, bf16=121.0, fp16=121.0, tf32=60.0, mem_gib=24, bw_gbs=300, efficiency=0.35,
         source="NVIDIA L4 Tensor Core GPU datasheet"),
    # NVIDIA A100 Tensor Core GPU datasheet (SXM): FP32 19.5 TF, TF32 156 TF, BF16/FP16 312 TF;
    # 40 GB HBM2 at 1,555 GB/s, 80 GB HBM2e at 2,039 GB/s.
    _gpu("A100-40GB", fp32=19.5, bf16=312.0, fp16=312.0, tf32=156.0, mem_gib=40, bw_gbs=1555, efficiency=0.5,
         source="NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB)"),
    _gpu("A100-80GB", fp32=19.5, bf16=312.0, fp16=312.0, tf32=156.0, mem_gib=80, bw_gbs=2039, efficiency=0.5,
         source="NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB)"),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM): FP32 67 TF, TF32 494.5 TF, BF16/FP16 989.5 TF dense
    # (the sheet's 1,979 is with sparsity), 80 GB HBM3 at 3.35 TB/s.
    _gpu("H100-80GB", fp32=67.0, bf16=989.5, fp16=989.5, tf32=494.5, mem_gib=80, bw_gbs=3350, efficiency=0.45,
         source="NVIDIA H100 Tensor Core GPU datasheet (SXM5)"),
    # NVIDIA Ampere GA102 GPU architecture whitepaper (GeForce RTX 3090): FP32 35.6 TF; FP16/BF16
    # tensor with FP32 accumulate 71 TF dense; TF32 35.6 TF; 24 GB GDDR6X at 936 GB/s.
    _gpu("RTX3090", fp32=35.6, bf16=71.0, fp16=71.0, tf32=35.6, mem_gib=24, bw_gbs=936, efficiency=0.4,
         source="NVIDIA Ampere GA102 GPU architecture whitepaper (RTX 3090)"),
    # NVIDIA Ada GPU architecture whitepaper (GeForce RTX 4090): FP32 82.6 TF; FP16/BF16 tensor
    # with FP32 accumulate 165.2 TF dense; TF32 82.6 TF; 24 GB GDDR6X at 1,008 GB/s.
    _gpu("RTX4090", fp32=82.6, bf16=165.2, fp16=165.2, tf32=82.6, mem_gib=24, bw_gbs=1008, efficiency=0.4,
         source="NVIDIA Ada GPU architecture whitepaper (RTX 4090)"),
    # A nominal server CPU, for CPU-only trusted verifier hosts: 16 cores x 2 AVX2 FMA units x 8 fp32 lanes
    # x 2 flops x 3.0 GHz = 1.5 TF fp32 (bf16 via AVX-512 BF16 where present: same order); 64 GiB of
    # DDR4-3200 in 4 channels = 4 x 25.6 = 102.4 GB/s (JEDEC DDR4-3200 figure). Profile the real host.
    DeviceSpec(name="CPU", kind="cpu", peak_flops=(("float32", 1.536 * _TERA), ("bfloat16", 1.536 * _TERA)),
               mem_bytes=64 * _GIB, mem_bw_bytes_per_s=102.4 * _GB, efficiency=0.3,
               source="nominal: 16-core AVX2 server at 3.0 GHz, 4-channel DDR4-3200"),
)})


def is_profile_reference(name: str) -> bool:
    """Whether a device type string names a profile JSON file rather than a catalog entry."""
    return name.endswith(".json") or "/" in name or "\\" in name


def suggest_device_names(name: str) -> list[str]:
    """Close catalog names for a misspelt type (case-insensitive)."""
    lower = {k.lower(): k for k in CATALOG}
    hits = difflib.get_close_matches(name.lower().replace(" ", ""), list(lower), n=3, cutoff=0.5)
    return [lower[h] for h in hits]


def load_profile_spec(path: str | Path) -> DeviceSpec:
    """The DeviceSpec stored in a profile JSON written by ``stagewise profile``."""
    p = Path(path)
    if not p.is_file():
        raise InvalidInputError(f"device profile {str(p)!r}", expected="an existing profile JSON file",
                                found="no such file", fix="run `stagewise profile -o FILE.json` on that machine")
    try:
        data = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidInputError(f"device profile {str(p)!r}", expected="a JSON file",
                                found=f"unreadable: {exc}") from None
    if not isinstance(data, dict) or data.get("schema") != PROFILE_SCHEMA or "device" not in data:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise InvalidInputError(f"device profile {str(p)!r}", expected=f"schema {PROFILE_SCHEMA!r} with a 'device'",
                                found=repr(found), fix="regenerate it with `stagewise profile`")
    return DeviceSpec.from_dict(data["device"], where=f"device profile {str(p)!r}")


def get_device_spec(name_or_profile_path: str | Path) -> DeviceSpec:
    """A catalog entry by name (``A100-80GB``), or the spec in a profile JSON (by path)."""
    key = str(name_or_profile_path)
    if key in CATALOG:
        return CATALOG[key]
    if isinstance(name_or_profile_path, Path) or is_profile_reference(key):
        return load_profile_spec(key)
    close = suggest_device_names(key)
    raise InvalidInputError(f"unknown device type {key!r}", expected=f"one of {', '.join(CATALOG)} "
                            "or a path to a profile JSON",
                            fix=f"did you mean {' or '.join(close)}?" if close else
                            "add the device to cost_models/devices.py or profile it with `stagewise profile`")
