"""Cost models: devices, clusters, profiling, and pure compute/communication/memory costs."""
from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "load_cluster": ("cost_models.cluster_file", "load_cluster"),
    "ClusterSpec": ("cost_models.cluster", "ClusterSpec"),
    "DeviceSpec": ("cost_models.devices", "DeviceSpec"),
    "TrainingConfig": ("cost_models.training", "TrainingConfig"),
    "get_device_spec": ("cost_models.devices", "get_device_spec"),
    "CATALOG": ("cost_models.devices", "CATALOG"),
    "DEFAULT_CLUSTER_PATH": ("cost_models.cluster", "DEFAULT_CLUSTER_PATH"),
    "Link": ("cost_models.cluster", "Link"),
    "Device": ("cost_models.cluster", "Device"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'cost_models' has no attribute {name!r}")
