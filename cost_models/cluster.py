"""Clusters: hosts, their devices and trust domains, and the links between them.

A cluster file (YAML or JSON; see ``examples/clusters/default.yaml``) lists
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
Every parse error names the field and, for YAML, the line.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml

from cost_models.devices import (CATALOG, DeviceSpec, is_profile_reference, load_profile_spec,
                                  suggest_device_names)
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
class RegionLink:
    """The link between any two hosts of regions ``between`` (order does not matter; may be equal)."""

    between: tuple[str, str]
    link: Link

    def to_dict(self) -> dict[str, Any]:
        return {"between": list(self.between), **self.link.to_dict()}


@dataclass(frozen=True, slots=True, kw_only=True)
class HostLink:
    """A measured or contracted link between two specific hosts; overrides region links."""

    between: tuple[str, str]
    link: Link

    def to_dict(self) -> dict[str, Any]:
        return {"between": list(self.between), **self.link.to_dict()}


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
                raise InvalidInputError(f"host {self.name}: device {d.id}", expected=f"id {self.name}/{i}")

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
        try:
            return self._by_id[device_id]
        except KeyError:
            raise InvalidInputError(f"cluster {self.name}: no device {device_id!r}",
                                    expected=f"one of {', '.join(self._by_id)}") from None

    def host(self, name: str) -> Host:
        try:
            return self._hosts_by_name[name]
        except KeyError:
            raise InvalidInputError(f"cluster {self.name}: no host {name!r}",
                                    expected=f"one of {', '.join(self._hosts_by_name)}") from None

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

    # --- (de)serialisation ----------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        links: dict[str, Any] = {"intra_host": self.intra_host.to_dict(), "default": self.default.to_dict()}
        if self.regions:
            links["regions"] = [r.to_dict() for r in self.regions]
        if self.host_links:
            links["hosts"] = [h.to_dict() for h in self.host_links]
        return {"name": self.name, "hosts": [h.to_dict() for h in self.hosts], "links": links}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, base_dir: str | Path | None = None) -> "ClusterSpec":
        """Build from the file shape; profile paths resolve against ``base_dir`` (default: cwd)."""
        return _parse_cluster(d, _Source(file=None, lines={}, base_dir=Path(base_dir or ".")))


def _pair_table(pairs: tuple[RegionLink, ...] | tuple[HostLink, ...], known: set[str],
                kind: str) -> dict[frozenset[str], Link]:
    table: dict[frozenset[str], Link] = {}
    for p in pairs:
        for end in p.between:
            if end not in known:
                raise InvalidInputError(f"{kind} link between {list(p.between)}: undefined {kind} {end!r}",
                                        expected=f"one of {', '.join(sorted(known))}")
        key = frozenset(p.between)
        if key in table:
            raise InvalidInputError(f"{kind} link between {list(p.between)}", expected="each pair once",
                                    found="a duplicate")
        table[key] = p.link
    return table


def load_cluster(path: str | Path) -> ClusterSpec:
    """Load a cluster file (``.yaml``/``.yml``/``.json``).

    A bare name such as ``default`` or ``swarm-t4`` that is not a file names a
    cluster shipped in ``cost_models/clusters/``.
    """
    p = Path(path)
    if not p.exists() and p.suffix == "" and len(p.parts) == 1:
        packaged = PACKAGED_CLUSTERS_DIR / f"{p.name}.yaml"
        if packaged.is_file():
            p = packaged
    if not p.is_file():
        known = sorted(f.stem for f in PACKAGED_CLUSTERS_DIR.glob("*.yaml"))
        raise InvalidInputError(f"cluster file {str(path)!r}", expected="an existing YAML or JSON file",
                                found="no such file", fix=f"check the path, or name a packaged cluster: "
                                                          f"{', '.join(known)}")
    return _load_cluster_file(p)


def default_cluster() -> ClusterSpec:
    """The embedded default cluster (``cost_models/clusters/default.yaml``)."""
    return load_cluster(DEFAULT_CLUSTER_PATH)


# --- parsing: file shape -> ClusterSpec, with located errors ---------------
_DEFAULT_INTRA_HOST = Link(bandwidth_gbps=256.0, latency_ms=0.01)  # PCIe 4.0 x16, ~32 GB/s
_DEFAULT_DEFAULT = Link(bandwidth_gbps=10.0, latency_ms=1.0)  # 10 GbE within a site
Path_ = tuple[str | int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class _Source:
    """Where the data came from, so errors can say ``file line N: hosts[1].trust: ...``."""

    file: str | None
    lines: Mapping[Path_, int]
    base_dir: Path

    def error(self, path: Path_, what: str, *, expected: str | None = None, found: str | None = None,
              fix: str | None = None) -> InvalidInputError:
        head = f"cluster file {self.file}" if self.file else "cluster"
        for cut in range(len(path), -1, -1):  # a missing key is reported at its parent's line
            if path[:cut] in self.lines:
                head += f" line {self.lines[path[:cut]]}"
                break
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
        return InvalidInputError(f"{head}: {where}: {what}" if where else f"{head}: {what}",
                                 expected=expected, found=found, fix=fix)

    def rewrap(self, path: Path_, exc: InvalidInputError) -> InvalidInputError:
        return self.error(path, exc.what, expected=exc.expected, found=exc.found, fix=exc.fix)


def _yaml_lines(node: yaml.Node | None, path: Path_, out: dict[Path_, int], src: _Source) -> None:
    """Record the 1-based line of every value; reject duplicate keys (YAML keeps the last silently)."""
    if node is None:
        return
    out[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = str(key_node.value)
            if key in seen:
                out[path + (key,)] = key_node.start_mark.line + 1
                raise src.error(path + (key,), "duplicate key", fix="keep one of the entries")
            seen.add(key)
            _yaml_lines(value_node, path + (key,), out, src)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _yaml_lines(item, path + (i,), out, src)


def _load_cluster_file(p: Path) -> ClusterSpec:
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"cluster file {str(p)!r}", expected="a readable text file", found=str(exc)) from None
    src = _Source(file=str(p), lines={}, base_dir=p.resolve().parent)
    if p.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidInputError(f"cluster file {p} line {exc.lineno}: invalid JSON", found=exc.msg) from None
        return _parse_cluster(data, src)
    lines: dict[Path_, int] = {}
    src = _Source(file=str(p), lines=lines, base_dir=src.base_dir)
    try:
        _yaml_lines(yaml.compose(text, Loader=yaml.SafeLoader), (), lines, src)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise InvalidInputError(f"cluster file {p}{where}: invalid YAML", found=problem) from None
    return _parse_cluster(data, src)


def _mapping(src: _Source, path: Path_, value: Any, allowed: tuple[str, ...]) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise src.error(path, "wrong type", expected=f"a mapping with keys {', '.join(allowed)}",
                        found=type(value).__name__)
    for key in value:
        if key not in allowed:
            raise src.error(path + (str(key),), "unknown key", expected=f"one of {', '.join(allowed)}",
                            found=repr(key))
    return value


def _string(src: _Source, path: Path_, m: Mapping[str, Any], key: str, what: str, fix: str) -> str:
    value = m.get(key)
    if value is None:
        raise src.error(path + (key,), f"missing {what}", expected=f"`{key}: <name>`", fix=fix)
    if not isinstance(value, str) or not value.strip():
        raise src.error(path + (key,), f"bad {what}", expected="a non-empty string", found=repr(value))
    return value


def _number(src: _Source, path: Path_, value: Any, *, positive: bool, what: str) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (value <= 0 if positive else value < 0):
        raise src.error(path, f"bad {what}", expected="a positive number" if positive else "a number >= 0",
                        found=repr(value))
    return float(value)


def _parse_link(src: _Source, path: Path_, value: Any, extra: tuple[str, ...] = ()) -> Link:
    m = _mapping(src, path, value, ("bandwidth_gbps", "latency_ms") + extra)
    if "bandwidth_gbps" not in m:
        raise src.error(path + ("bandwidth_gbps",), "missing bandwidth", expected="bandwidth_gbps in Gb/s")
    bw = _number(src, path + ("bandwidth_gbps",), m["bandwidth_gbps"], positive=True, what="bandwidth (Gb/s)")
    lat = _number(src, path + ("latency_ms",), m.get("latency_ms", 0.0), positive=False, what="latency (ms)")
    return Link(bandwidth_gbps=bw, latency_ms=lat)


def _resolve_device(src: _Source, path: Path_, entry: Mapping[str, Any]) -> DeviceSpec:
    type_name = entry.get("type")
    if not isinstance(type_name, str) or not type_name:
        raise src.error(path + ("type",), "missing device type",
                        expected=f"a catalog name ({', '.join(CATALOG)}) or a profile JSON path",
                        found=repr(type_name))
    if "spec" in entry:  # inline spec, as written by ClusterSpec.to_dict for profiled devices
        try:
            spec = DeviceSpec.from_dict(entry["spec"], where="inline spec")
        except InvalidInputError as exc:
            raise src.rewrap(path + ("spec",), exc) from None
    elif type_name in CATALOG:
        spec = CATALOG[type_name]
    elif is_profile_reference(type_name):
        profile = src.base_dir / type_name
        if not profile.is_file():
            raise src.error(path + ("type",), f"profile file {type_name!r} does not exist",
                            expected=f"a profile JSON at {profile}",
                            fix="run `stagewise profile -o FILE.json` on that machine; paths are relative "
                                "to the cluster file")
        try:
            spec = load_profile_spec(profile)
        except InvalidInputError as exc:
            raise src.rewrap(path + ("type",), exc) from None
    else:
        close = suggest_device_names(type_name)
        raise src.error(path + ("type",), f"unknown device type {type_name!r}",
                        expected=f"one of {', '.join(CATALOG)} or a profile JSON path",
                        fix=f"did you mean {' or '.join(close)}?" if close else
                        "profile the device with `stagewise profile` and give the JSON's path")
    if "efficiency" in entry:
        eff = entry["efficiency"]
        if isinstance(eff, bool) or not isinstance(eff, (int, float)) or not 0 < eff <= 1:
            raise src.error(path + ("efficiency",), "bad efficiency", expected="a fraction in (0, 1]",
                            found=repr(eff))
        spec = spec.with_efficiency(float(eff))
    return spec


def _parse_host(src: _Source, path: Path_, value: Any) -> Host:
    m = _mapping(src, path, value, ("name", "region", "trust", "trusted", "role", "devices", "intra_host"))
    name = _string(src, path, m, "name", "host name", "give every host a unique name")
    if "/" in name:
        raise src.error(path + ("name",), "bad host name", expected="a name without '/'", found=repr(name))
    region = _string(src, path, m, "region", "region", "name the host's region, e.g. `region: us-east`")
    trust = _string(src, path, m, "trust", "trust domain",
                    "add `trust: <domain>`; devices in one domain trust each other")
    trusted = m.get("trusted", False)
    if not isinstance(trusted, bool):
        raise src.error(path + ("trusted",), "bad trusted flag", expected="true or false", found=repr(trusted))
    role = m.get("role", "worker")
    if role not in ("worker", "verifier"):
        raise src.error(path + ("role",), "bad role", expected="worker or verifier", found=repr(role))
    if role == "verifier" and not trusted:
        raise src.error(path + ("trusted",), "a verifier host must be trusted", expected="trusted: true",
                        found=repr(trusted))
    entries = m.get("devices", [{"type": "CPU", "count": 1}] if role == "verifier" else None)
    if not isinstance(entries, list) or not entries:
        raise src.error(path + ("devices",), "no devices", expected="a list like [{type: A100-80GB, count: 2}]",
                        found=repr(entries))
    devices: list[Device] = []
    for j, entry in enumerate(entries):
        epath = path + ("devices", j)
        e = _mapping(src, epath, entry, ("type", "count", "efficiency", "spec"))
        spec = _resolve_device(src, epath, e)
        count = e.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise src.error(epath + ("count",), "bad count", expected="an integer >= 1", found=repr(count))
        if role == "verifier" and spec.kind != "cpu":
            raise src.error(epath + ("type",), "a verifier host is CPU-only", expected="a CPU device",
                            found=spec.name, fix="move the GPU to a worker host")
        for _ in range(count):
            devices.append(Device(id=f"{name}/{len(devices)}", host=name, region=region, trust=trust,
                                  trusted=trusted, spec=spec, cpu_only=spec.kind == "cpu" or role == "verifier"))
    intra = _parse_link(src, path + ("intra_host",), m["intra_host"]) if "intra_host" in m else None
    return Host(name=name, region=region, trust=trust, trusted=trusted, devices=tuple(devices), role=role,
                intra_host=intra)


def _parse_pairs(src: _Source, path: Path_, value: Any, known: Mapping[str, Any],
                 kind: str) -> list[tuple[tuple[str, str], Link]]:
    if not isinstance(value, list):
        raise src.error(path, "wrong type", expected=f"a list of {{between: [a, b], bandwidth_gbps, latency_ms}}",
                        found=type(value).__name__)
    out: list[tuple[tuple[str, str], Link]] = []
    seen: set[frozenset[str]] = set()
    for i, item in enumerate(value):
        link = _parse_link(src, path + (i,), item, extra=("between",))
        between = item.get("between")
        if not (isinstance(between, list) and len(between) == 2 and all(isinstance(b, str) for b in between)):
            raise src.error(path + (i, "between"), "bad pair", expected=f"two {kind} names", found=repr(between))
        for b in between:
            if b not in known:
                raise src.error(path + (i, "between"), f"undefined {kind} {b!r}",
                                expected=f"one of {', '.join(known)}", fix=f"fix the name or define the {kind}")
        if frozenset(between) in seen:
            raise src.error(path + (i, "between"), f"{kind} pair {between} given twice", fix="keep one")
        seen.add(frozenset(between))
        out.append(((between[0], between[1]), link))
    return out


def _parse_cluster(data: Any, src: _Source) -> ClusterSpec:
    if data is None:
        raise src.error((), "empty cluster", expected="a mapping with hosts and links", found="nothing")
    m = _mapping(src, (), data, ("name", "hosts", "links"))
    name = m.get("name") or (Path(src.file).stem if src.file else "cluster")
    if not isinstance(name, str):
        raise src.error(("name",), "bad cluster name", expected="a string", found=repr(name))
    raw_hosts = m.get("hosts")
    if not isinstance(raw_hosts, list) or not raw_hosts:
        raise src.error(("hosts",), "empty cluster", expected="a non-empty list of hosts", found=repr(raw_hosts),
                        fix="list at least one host with devices")
    hosts: dict[str, Host] = {}
    for i, raw in enumerate(raw_hosts):
        host = _parse_host(src, ("hosts", i), raw)
        if host.name in hosts:
            raise src.error(("hosts", i, "name"), f"duplicate host name {host.name!r}",
                            expected="unique host names", fix="rename one of the hosts")
        hosts[host.name] = host
    links = _mapping(src, ("links",), m.get("links", {}), ("intra_host", "default", "regions", "hosts"))
    intra = _parse_link(src, ("links", "intra_host"), links["intra_host"]) if "intra_host" in links \
        else _DEFAULT_INTRA_HOST
    default = _parse_link(src, ("links", "default"), links["default"]) if "default" in links else _DEFAULT_DEFAULT
    regions = dict.fromkeys(h.region for h in hosts.values())
    region_links = _parse_pairs(src, ("links", "regions"), links.get("regions", []), regions, "region")
    host_links = _parse_pairs(src, ("links", "hosts"), links.get("hosts", []), hosts, "host")
    try:
        return ClusterSpec(name=name, hosts=tuple(hosts.values()), intra_host=intra, default=default,
                           regions=tuple(RegionLink(between=b, link=lk) for b, lk in region_links),
                           host_links=tuple(HostLink(between=b, link=lk) for b, lk in host_links))
    except InvalidInputError as exc:
        raise src.rewrap((), exc) from None
