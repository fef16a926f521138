"""Accelerator specifications: a catalog of datasheet figures, and measured profiles.

A :class:`DeviceSpec` is what the pure cost functions (``compute.py``) need to
price a block on a device: peak dense FLOP/s per dtype, memory size and
bandwidth, and an ``efficiency`` factor (the fraction of peak that real
training blocks reach), with per-dtype overrides (``dtype_efficiency``):
tensor-core half precision reaches a far smaller fraction of its peak than
FP32 does. Catalog entries carry vendor datasheet figures and typical
efficiencies; a profile JSON written by ``stagewise profile`` carries figures
measured on this machine and an efficiency fitted to measured block times (see
``planner/profiling/``); a Metis profile calibrates one dtype
(``cost_models/metis_profile.py``).

The catalog's figures, with their datasheet sources and conventions (dense
FLOP/s, FP32 accumulation, ...), are in ``cost_models/data/devices.yaml``.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, Mapping

import yaml

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
    back to the float32 rate and efficiency, which is how PyTorch runs it
    there (upcast). ``efficiency`` applies to every dtype but those in
    ``dtype_efficiency`` (``(dtype, fraction)`` pairs, each a dtype with its
    own peak, never float32).
    ``op_overhead_ms`` is the fixed cost of launching/dispatching one op
    (calibrated by a profile; 0 for catalog entries). ``optim_op_ms`` is the
    fixed cost of one element-wise kernel of an optimizer step (a profile times
    ``torch.optim.Adam`` over many small tensors: plain kernels without
    autograd, several times cheaper than a model op on a CPU); None: priced
    at ``op_overhead_ms``. ``measured`` marks a spec
    that came from a profile; ``p2p_*`` are the measured local point-to-point
    figures from that profile, if any.
    """

    name: str
    peak_flops: tuple[tuple[str, float], ...]
    mem_bytes: int
    mem_bw_bytes_per_s: float
    efficiency: float = 0.5
    dtype_efficiency: tuple[tuple[str, float], ...] = ()
    kind: DeviceKind = "gpu"
    op_overhead_ms: float = 0.0
    optim_op_ms: float | None = None
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
        self._check_dtype_efficiency(seen)
        if self.kind not in ("gpu", "cpu"):
            raise InvalidInputError(f"device {self.name}: kind", expected="gpu or cpu", found=repr(self.kind))
        if not (self.op_overhead_ms >= 0.0 and math.isfinite(self.op_overhead_ms)):
            raise InvalidInputError(f"device {self.name}: op_overhead_ms", expected=">= 0",
                                    found=repr(self.op_overhead_ms))
        if self.optim_op_ms is not None and not (self.optim_op_ms >= 0.0 and math.isfinite(self.optim_op_ms)):
            raise InvalidInputError(f"device {self.name}: optim_op_ms", expected=">= 0 (or absent)",
                                    found=repr(self.optim_op_ms), fix="regenerate it with `stagewise profile`")
        if self.p2p_bandwidth_gbps is not None:
            _check_positive(f"device {self.name}: p2p_bandwidth_gbps", self.p2p_bandwidth_gbps)
        if self.p2p_latency_ms is not None and not self.p2p_latency_ms >= 0.0:
            raise InvalidInputError(f"device {self.name}: p2p_latency_ms", expected=">= 0",
                                    found=repr(self.p2p_latency_ms))

    def _check_dtype_efficiency(self, peaks: set[str]) -> None:
        seen: set[str] = set()
        for dtype, eff in self.dtype_efficiency:
            where = f"device {self.name}: efficiency[{dtype}]"
            if dtype == "float32" or dtype not in peaks or dtype in seen:
                raise InvalidInputError(where, expected="once per dtype that has its own peak_flops entry, "
                                        "float32 being the plain efficiency",
                                        found=f"peaks for {sorted(peaks)}", fix="drop that efficiency entry")
            if isinstance(eff, bool) or not isinstance(eff, (int, float)) or not 0.0 < eff <= 1.0:
                raise InvalidInputError(where, expected="a fraction in (0, 1]", found=repr(eff))
            seen.add(dtype)

    def _dtype_key(self, dtype: str) -> str:
        key = dtype.removeprefix("torch.")
        if key not in KNOWN_DTYPES:
            raise InvalidInputError(f"dtype for device {self.name}", expected=f"one of {KNOWN_DTYPES}",
                                    found=repr(dtype))
        return key

    def flops_per_s(self, dtype: str) -> float:
        """Peak dense FLOP/s for ``dtype`` (unsupported low precision runs at the float32 rate)."""
        table = dict(self.peak_flops)
        return table.get(self._dtype_key(dtype), table["float32"])

    def efficiency_for(self, dtype: str) -> float:
        """The fraction of ``dtype``'s peak that training blocks reach (float32's where not overridden)."""
        return dict(self.dtype_efficiency).get(self._dtype_key(dtype), self.efficiency)

    def effective_flops_per_s(self, dtype: str) -> float:
        """What training blocks actually reach: peak times that dtype's efficiency."""
        return self.flops_per_s(dtype) * self.efficiency_for(dtype)

    @property
    def mem_gib(self) -> float:
        return self.mem_bytes / _GIB

    def with_efficiency(self, efficiency: float) -> "DeviceSpec":
        """A copy with one efficiency for every dtype (a cluster file's scalar ``efficiency:``), as before
        per-dtype figures existed."""
        return dataclasses.replace(self, efficiency=efficiency, dtype_efficiency=())

    def with_dtype_efficiency(self, dtype: str, efficiency: float) -> "DeviceSpec":
        """A copy whose ``dtype`` reaches ``efficiency`` of its peak (float32: the plain efficiency)."""
        key = self._dtype_key(dtype)
        if key == "float32":
            return dataclasses.replace(self, efficiency=efficiency)
        others = tuple((d, e) for d, e in self.dtype_efficiency if d != key)
        return dataclasses.replace(self, dtype_efficiency=others + ((key, efficiency),))

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
        if self.dtype_efficiency:  # absent when empty: older readers (and profiles) never see the key
            d["dtype_efficiency"] = dict(self.dtype_efficiency)
        if self.optim_op_ms is not None:
            d["optim_op_ms"] = self.optim_op_ms
        if self.p2p_bandwidth_gbps is not None:
            d["p2p_bandwidth_gbps"] = self.p2p_bandwidth_gbps
        if self.p2p_latency_ms is not None:
            d["p2p_latency_ms"] = self.p2p_latency_ms
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str = "device spec") -> "DeviceSpec":
        allowed = {"name", "kind", "peak_flops", "mem_bytes", "mem_bw_bytes_per_s", "efficiency",
                   "dtype_efficiency", "op_overhead_ms", "optim_op_ms", "source", "measured", "p2p_bandwidth_gbps",
                   "p2p_latency_ms"}
        if not isinstance(d, Mapping):
            raise InvalidInputError(where, expected="a mapping", found=type(d).__name__)
        unknown = sorted(set(d) - allowed)
        if unknown:
            raise InvalidInputError(f"{where}: unknown field {unknown[0]!r}", expected=f"fields {sorted(allowed)}",
                                    found=", ".join(unknown), fix="remove it, or regenerate with `stagewise profile`")
        missing = sorted({"name", "peak_flops", "mem_bytes", "mem_bw_bytes_per_s"} - set(d))
        if missing:
            raise InvalidInputError(f"{where}: missing field {missing[0]!r}",
                                    expected="name, peak_flops, mem_bytes, mem_bw_bytes_per_s",
                                    found=", ".join(sorted(d)) or "no fields",
                                    fix="regenerate it with `stagewise profile`")
        flops = d["peak_flops"]
        if not isinstance(flops, Mapping):
            raise InvalidInputError(f"{where}: peak_flops", expected="a mapping dtype -> FLOP/s",
                                    found=type(flops).__name__)
        per_dtype = d.get("dtype_efficiency", {})
        if not isinstance(per_dtype, Mapping):
            raise InvalidInputError(f"{where}: dtype_efficiency", expected="a mapping dtype -> fraction",
                                    found=type(per_dtype).__name__)
        kwargs = {k: v for k, v in d.items() if k not in ("peak_flops", "dtype_efficiency")}
        try:
            return cls(peak_flops=tuple((str(k), float(v)) for k, v in flops.items()),
                       dtype_efficiency=tuple((str(k), float(v)) for k, v in per_dtype.items()), **kwargs)
        except (TypeError, ValueError) as exc:
            raise InvalidInputError(where, expected="numbers for the figures", found=str(exc)) from None


def _check_positive(what: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (value > 0 and math.isfinite(value)):
        raise InvalidInputError(what, expected="a positive finite number", found=repr(value))


def _catalog_entry(name: str, entry: Any) -> DeviceSpec:
    """One entry of ``data/devices.yaml`` (TFLOP/s, GiB, decimal GB/s) as a DeviceSpec."""
    where = f"device catalog {_CATALOG_PATH.name}: {name}"
    keys = {"tflops", "mem_gib", "bw_gbs", "efficiency", "source", "kind"}
    if not isinstance(entry, Mapping) or not {"tflops", "mem_gib", "bw_gbs"} <= set(entry) <= keys:
        found = sorted(entry) if isinstance(entry, Mapping) else type(entry).__name__
        raise InvalidInputError(where, expected=f"a mapping with tflops, mem_gib, bw_gbs (and {keys})",
                                found=str(found), fix="fix the entry in cost_models/data/devices.yaml")
    try:
        efficiency, per_dtype = _catalog_efficiency(entry.get("efficiency", 0.5))
        return DeviceSpec(name=name, peak_flops=tuple((str(k), float(v) * _TERA) for k, v in entry["tflops"].items()),
                          mem_bytes=int(entry["mem_gib"] * _GIB), mem_bw_bytes_per_s=entry["bw_gbs"] * _GB,
                          efficiency=efficiency, dtype_efficiency=per_dtype, kind=entry.get("kind", "gpu"),
                          source=entry.get("source", ""))
    except (TypeError, ValueError, AttributeError) as exc:
        raise InvalidInputError(where, expected="numbers for the figures", found=str(exc),
                                fix="fix the entry in cost_models/data/devices.yaml") from None


def _catalog_efficiency(value: Any) -> tuple[float, tuple[tuple[str, float], ...]]:
    """A catalog ``efficiency``: one fraction for every dtype, or ``{float32: f, float16: g, ...}``."""
    if not isinstance(value, Mapping):
        return value, ()
    if "float32" not in value:
        raise ValueError(f"an efficiency mapping needs a float32 entry, found {sorted(value)}")
    return value["float32"], tuple((str(k), v) for k, v in value.items() if k != "float32")


def _load_catalog() -> Mapping[str, DeviceSpec]:
    # The figures are data (with their datasheet citations as comments), not code.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    entries = yaml.load(_CATALOG_PATH.read_text(encoding="utf-8"), Loader=loader)
    return MappingProxyType({name: _catalog_entry(name, e) for name, e in entries.items()})


_CATALOG_PATH = Path(__file__).resolve().parent / "data" / "devices.yaml"
CATALOG: Mapping[str, DeviceSpec] = _load_catalog()


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
