"""Cost models: devices, clusters, and pure compute / communication / memory / verification costs."""
from __future__ import annotations

from cost_models.cluster import DEFAULT_CLUSTER_PATH, ClusterSpec, Device, Link
from cost_models.cluster_file import load_cluster
from cost_models.devices import CATALOG, DeviceSpec, get_device_spec
from cost_models.training import TrainingConfig

__all__ = ["CATALOG", "DEFAULT_CLUSTER_PATH", "ClusterSpec", "Device", "DeviceSpec", "Link", "TrainingConfig",
           "get_device_spec", "load_cluster"]
