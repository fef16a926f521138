"""Which compute dtype a cluster trains in: the names users type, and the default per cluster."""
from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from cost_models.cluster import ClusterSpec
from planner.errors import InvalidInputError

# What a user types (CLI, API) -> the dtype name plans and cost models use.
DTYPE_NAMES: Mapping[str, str] = MappingProxyType({
    "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
    "fp32": "float32", "float32": "float32"})


def resolve_dtype(name: str, cluster: ClusterSpec) -> str:
    """``auto`` -> :func:`default_dtype`; an alias (``bf16``) -> its dtype name."""
    if name == "auto":
        return default_dtype(cluster)
    if name not in DTYPE_NAMES:
        raise InvalidInputError(f"dtype {name!r}", expected="auto, bf16, fp16 or fp32", found=repr(name),
                                fix="pass --dtype bf16 (or fp16 / fp32)")
    return DTYPE_NAMES[name]


def default_dtype(cluster: ClusterSpec) -> str:
    """bfloat16 where every GPU of the cluster runs it natively, float16 (with loss scaling) where one does
    not (T4, V100), float32 on a cluster without GPUs."""
    gpus = [d.spec for h in cluster.hosts for d in h.devices if d.spec.kind == "gpu"]
    if not gpus:
        return "float32"
    if all("bfloat16" in dict(spec.peak_flops) for spec in gpus):
        return "bfloat16"
    return "float16"
