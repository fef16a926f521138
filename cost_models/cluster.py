"""Clusters: hosts, their devices and trust domains, and the links between them.

A cluster file (YAML or JSON; see ``cost_models/clusters/default.yaml``) lists
``hosts`` (``name``, ``region``, ``trust`` domain, ``trusted`` flag, optional
``role: verifier`` for a CPU-only trusted host that runs verifiers but no
stage, optional ``intra_host`` link, and ``devices: [{type, count}]``) and
``links``: ``intra_host``, ``default``, ``regions: [{between: [r1, r2],
bandwidth_gbps, latency_ms}]`` and ``hosts: [{between: [h1, h2], ...}]``.
A link between two devices is chosen by their actual pair: same host, then a
host pair, then a region pair (a region may pair with itself), then default.

A device ``type`` is a catalog name (``cost_models.devices.CATALOG``) or a path
(relative to the cluster file) to a profile JSON written by ``stagewise
profile``; an entry may override the ``efficiency`` or give the whole ``spec``
inline (``to_dict`` does that for profiled devices so a plan stays portable).
Bandwidths are in gigabits per second (network convention), latencies in ms.
Parsing the file, with errors that name the field and, for YAML, the line,
lives in ``cost_models.cluster_file``; this module holds the value types.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

from cost_models.devices import CATALOG, DeviceSpec
from planner.errors import InvalidInputError

HostRole = Literal["worker", "verifier"]

DEFAULT_CLUSTER_PATH: Path = Path(__file__).resolve().parent / "clusters" / "default.yaml"
PACKAGED_CLUSTERS_DIR: Path = DEFAULT_CLUSTER_PATH.parent


@dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    """A network path: ``bandwidth_gbps`` gigabits per second, one-way ``latency_ms``."""

    bandwidth_gbps: float
    latency_ms: float

    def __post_init__(self) -> None:
        bw, lat = self.bandwidth_gbps, self.latency_ms
        if isinstance(bw, bool) or not isinstance(bw, (int, float)) or not 0 < bw < float("inf"):
            raise InvalidInputError("link bandwidth_gbps", expected="a positive number", found=repr(bw))
        if isinstance(lat, bool) or not isinstance(lat, (int, float)) or not 0 <= lat < float("inf"):
            raise InvalidInputError("link latency_ms", expected="a number >= 0", found=repr(lat))

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9 / 8.0

    def to_dict(self) -> dict[str, float]:
        return {"bandwidth_gbps": self.bandwidth_gbps, "latency_ms": self.latency_ms}


@dataclass(frozen=True, slots=True, kw_only=True)
class _PairLink:
    """A link between the two named ends ``between`` (order does not matter; they may be equal)."""

    between: tuple[str, str]
    link: Link

    def __post_init__(self) -> None:
        if len(self.between) != 2 or not all(isinstance(end, str) and end for end in self.between):
            raise InvalidInputError(f"{type(self).__name__}.between", expected="two non-empty names",
                                    found=repr(self.between))

    def to_dict(self) -> dict[str, Any]:
        return {"between": list(self.between), **self.link.to_dict()}


@dataclass(frozen=True, slots=True, kw_only=True)
class RegionLink(_PairLink):
    """The link between any two hosts of regions ``between`` (order does not matter; may be equal)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HostLink(_PairLink):
    """A measured or contracted link between two specific hosts; overrides region links."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Device:
    """One device: ``id`` is ``"host/i"``; placement and trust come from its host."""

    id: str
    host: str
    region: str
    trust: str
    trusted: bool
    spec: DeviceSpec
    cpu_only: bool = False

    @property
    def type(self) -> str:
        return self.spec.name


@dataclass(frozen=True, slots=True, kw_only=True)
class Host:
    """A machine: its devices share ``intra_host`` (the cluster's unless overridden)."""

    name: str
    region: str
    trust: str
    trusted: bool
    devices: tuple[Device, ...]
    role: HostRole = "worker"
    intra_host: Link | None = None

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise InvalidInputError("host name", expected="a non-empty name without '/'", found=repr(self.name))
        if not self.trust:
            raise InvalidInputError(f"host {self.name}: trust", expected="a trust domain name", found="none")
        if self.role not in ("worker", "verifier"):
            raise InvalidInputError(f"host {self.name}: role", expected="worker or verifier", found=repr(self.role))
        if self.role == "verifier" and not self.trusted:
            raise InvalidInputError(f"host {self.name}: role verifier", expected="trusted: true",
                                    found="an untrusted host", fix="verifiers must run on trusted hosts")
        for i, d in enumerate(self.devices):
            if d.id != f"{self.name}/{i}" or d.host != self.name:
                raise InvalidInputError(f"host {self.name}: device {d.id}", expected=f"id {self.name}/{i}",
                                        found=f"id {d.id} on host {d.host}")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "region": self.region, "trust": self.trust,
                             "trusted": self.trusted}
        if self.role != "worker":
            d["role"] = self.role
        d["devices"] = _device_groups(self.devices)
        if self.intra_host is not None:
            d["intra_host"] = self.intra_host.to_dict()
        return d


def _device_entry(spec: DeviceSpec) -> dict[str, Any]:
    base = CATALOG.get(spec.name)
    if base == spec:
        return {"type": spec.name}
    if base is not None and base.with_efficiency(spec.efficiency) == spec:
        return {"type": spec.name, "efficiency": spec.efficiency}
    return {"type": spec.name, "spec": spec.to_dict()}  # profiled: inline so a plan stays portable


def _device_groups(devices: tuple[Device, ...]) -> list[dict[str, Any]]:
    groups: list[tuple[DeviceSpec, int]] = []
    for d in devices:
        if groups and groups[-1][0] == d.spec:
            groups[-1] = (d.spec, groups[-1][1] + 1)
        else:
            groups.append((d.spec, 1))
    return [{**_device_entry(spec), "count": n} for spec, n in groups]


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterSpec:
    """Hosts and links. ``devices`` lists every device in host order (a stable order)."""

    name: str
    hosts: tuple[Host, ...]
    intra_host: Link
    default: Link
    regions: tuple[RegionLink, ...] = ()
    host_links: tuple[HostLink, ...] = ()
    _by_id: dict[str, Device] = field(init=False, repr=False, compare=False, hash=False)
    _hosts_by_name: dict[str, Host] = field(init=False, repr=False, compare=False, hash=False)
    _region_links: dict[frozenset[str], Link] = field(init=False, repr=False, compare=False, hash=False)
    _host_links: dict[frozenset[str], Link] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not self.hosts or not any(h.devices for h in self.hosts):
            raise InvalidInputError(f"cluster {self.name}", expected="at least one host with a device",
                                    found="an empty cluster")
        hosts: dict[str, Host] = {}
        for h in self.hosts:
            if h.name in hosts:
                raise InvalidInputError(f"cluster {self.name}: host {h.name!r}", expected="unique host names",
                                        found="a duplicate")
            hosts[h.name] = h
        known_regions = {h.region for h in self.hosts}
        object.__setattr__(self, "_hosts_by_name", hosts)
        object.__setattr__(self, "_by_id", {d.id: d for h in self.hosts for d in h.devices})
        object.__setattr__(self, "_region_links", _pair_table(self.regions, known_regions, "region"))
        object.__setattr__(self, "_host_links", _pair_table(self.host_links, set(hosts), "host"))

    # --- lookups ---------------------------------------------------------
    @property
    def devices(self) -> tuple[Device, ...]:
        return tuple(self._by_id.values())

    @property
    def stage_devices(self) -> tuple[Device, ...]:
        """Devices that may run a pipeline stage (not on ``role: verifier`` hosts)."""
        return tuple(d for h in self.hosts if h.role == "worker" for d in h.devices)

    @property
    def trusted_devices(self) -> tuple[Device, ...]:
        """Devices that may host a verifier."""
        return tuple(d for d in self.devices if d.trusted)

    @property
    def region_names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(h.region for h in self.hosts))

    def device(self, device_id: str) -> Device:
        return self._lookup(self._by_id, device_id, "device", "device ids are host/index, as the cluster file lists")

    def host(self, name: str) -> Host:
        return self._lookup(self._hosts_by_name, name, "host", "use a host name from the cluster file")

    def _lookup(self, table: Mapping[str, Any], key: str, kind: str, fix: str) -> Any:
        try:
            return table[key]
        except KeyError:
            raise InvalidInputError(f"cluster {self.name}: no {kind} {key!r}", expected=f"one of {', '.join(table)}",
                                    found=repr(key), fix=fix) from None

    def link(self, a_id: str, b_id: str) -> Link:
        """The link between two devices: same host -> intra-host; then host pair; region pair; default."""
        a, b = self.device(a_id), self.device(b_id)
        if a.host == b.host:
            own = self._hosts_by_name[a.host].intra_host
            return own if own is not None else self.intra_host
        hit = self._host_links.get(frozenset((a.host, b.host)))
        if hit is not None:
            return hit
        hit = self._region_links.get(frozenset((a.region, b.region)))
        return hit if hit is not None else self.default

    def without_hosts(self, names: set[str]) -> "ClusterSpec":
        """This cluster less the hosts ``names`` (lost or excluded machines) and the links only they used."""
        hosts = tuple(h for h in self.hosts if h.name not in names)
        regions = {h.region for h in hosts}
        return dataclasses.replace(
            self, hosts=hosts,
            regions=tuple(r for r in self.regions if set(r.between) <= regions),
            host_links=tuple(h for h in self.host_links if not set(h.between) & names))

    # --- (de)serialisation ----------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        links: dict[str, Any] = {"intra_host": self.intra_host.to_dict(), "default": self.default.to_dict()}
        if self.regions:
            links["regions"] = [r.to_dict() for r in self.regions]
        if self.host_links:
            links["hosts"] = [h.to_dict() for h in self.host_links]
        return {"name": self.name, "hosts": [h.to_dict() for h in self.hosts], "links": links}



def _pair_table(pairs: tuple[RegionLink, ...] | tuple[HostLink, ...], known: set[str],
                kind: str) -> dict[frozenset[str], Link]:
    table: dict[frozenset[str], Link] = {}
    for p in pairs:
        for end in p.between:
            if end not in known:
                raise InvalidInputError(f"{kind} link between {list(p.between)}: undefined {kind} {end!r}",
                                        expected=f"one of {', '.join(sorted(known))}", found=repr(end),
                                        fix=f"fix the name or define the {kind}")
        key = frozenset(p.between)
        if key in table:
            raise InvalidInputError(f"{kind} link between {list(p.between)}", expected="each pair once",
                                    found="a duplicate")
        table[key] = p.link
    return table
