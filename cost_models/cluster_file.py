"""Reading cluster files: YAML/JSON text -> :class:`~cost_models.cluster.ClusterSpec`, with located errors.

The file shape is described in ``cost_models.cluster``. Every error names the
field by its path (``hosts[1].trust``) and, for YAML files, the line it is on;
a missing key is reported at its parent's line. Duplicate YAML keys are an
error (YAML itself silently keeps the last one).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import yaml

from cost_models.cluster import (
    DEFAULT_CLUSTER_PATH,
    PACKAGED_CLUSTERS_DIR,
    ClusterSpec,
    Device,
    Host,
    HostLink,
    Link,
    RegionLink,
)
from cost_models.devices import (
    CATALOG,
    DeviceSpec,
    is_profile_reference,
    load_profile_spec,
    suggest_device_names,
)
from cost_models.metis_profile import (
    FIT_DTYPES,
    GPTLayerShape,
    calibrate_from_metis,
    read_metis_profiles,
)
from planner.errors import InvalidInputError

DEFAULT_INTRA_HOST = Link(bandwidth_gbps=256.0, latency_ms=0.01)  # PCIe 4.0 x16, ~32 GB/s
DEFAULT_LINK = Link(bandwidth_gbps=10.0, latency_ms=1.0)  # 10 GbE within a site
_HOST_KEYS = ("name", "region", "trust", "trusted", "role", "devices", "intra_host")
_DEVICE_KEYS = ("type", "count", "efficiency", "spec", "metis_profile")
_METIS_KEYS = ("path", "hidden_size", "seq_len", "dtype")
_LINKS_KEYS = ("intra_host", "default", "regions", "hosts")
FieldPath = tuple[str | int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class _Source:
    """Where the data came from, so errors can say ``file line N: hosts[1].trust: ...``."""

    file: str | None
    lines: Mapping[FieldPath, int]
    base_dir: Path

    def error(self, path: FieldPath, what: str, *, expected: str | None = None, found: str | None = None,
              fix: str | None = None) -> InvalidInputError:
        head = f"cluster file {self.file}" if self.file else "cluster"
        for cut in range(len(path), -1, -1):  # a missing key is reported at its parent's line
            if path[:cut] in self.lines:
                head += f" line {self.lines[path[:cut]]}"
                break
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
        return InvalidInputError(f"{head}: {where}: {what}" if where else f"{head}: {what}",
                                 expected=expected, found=found, fix=fix)

    def rewrap(self, path: FieldPath, exc: InvalidInputError) -> InvalidInputError:
        return self.error(path, exc.what, expected=exc.expected, found=exc.found, fix=exc.fix)


def parse_cluster(data: Any, *, base_dir: str | Path | None = None) -> ClusterSpec:
    """Build a cluster from the file shape (already parsed); profile paths resolve against ``base_dir``."""
    return _parse_cluster(data, _Source(file=None, lines={}, base_dir=Path(base_dir or ".")))


def read_cluster_file(path: Path) -> ClusterSpec:
    """Read and parse a ``.json`` file, or YAML for any other suffix."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"cluster file {str(path)!r}", expected="a readable text file",
                                found=str(exc)) from None
    lines: dict[FieldPath, int] = {}  # filled for YAML only: JSON errors carry no field lines
    src = _Source(file=str(path), lines=lines, base_dir=path.resolve().parent)
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidInputError(f"cluster file {path} line {exc.lineno}: invalid JSON", expected="valid JSON",
                                    found=exc.msg, fix="fix the syntax at that line") from None
        return _parse_cluster(data, src)
    try:
        _yaml_lines(yaml.compose(text, Loader=yaml.SafeLoader), (), lines, src)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise InvalidInputError(f"cluster file {path}{where}: invalid YAML", expected="valid YAML",
                                found=problem, fix="fix the syntax at that line") from None
    return _parse_cluster(data, src)


def _yaml_lines(node: yaml.Node | None, path: FieldPath, out: dict[FieldPath, int], src: _Source) -> None:
    """Record the 1-based line of every value; reject duplicate keys."""
    if node is None:
        return
    out[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = str(key_node.value)
            if key in seen:
                out[path + (key,)] = key_node.start_mark.line + 1
                raise src.error(path + (key,), "duplicate key", expected="each key once",
                                fix="keep one of the entries")
            seen.add(key)
            _yaml_lines(value_node, path + (key,), out, src)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _yaml_lines(item, path + (i,), out, src)


# --- typed fields ------------------------------------------------------------------
def _mapping(src: _Source, path: FieldPath, value: Any, allowed: tuple[str, ...]) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise src.error(path, "wrong type", expected=f"a mapping with keys {', '.join(allowed)}",
                        found=type(value).__name__)
    for key in value:
        if key not in allowed:
            raise src.error(path + (str(key),), "unknown key", expected=f"one of {', '.join(allowed)}",
                            found=repr(key))
    return value


def _string(src: _Source, path: FieldPath, m: Mapping[str, Any], key: str, what: str, fix: str) -> str:
    value = m.get(key)
    if value is None:
        raise src.error(path + (key,), f"missing {what}", expected=f"`{key}: <name>`", found="nothing", fix=fix)
    if not isinstance(value, str) or not value.strip():
        raise src.error(path + (key,), f"bad {what}", expected="a non-empty string", found=repr(value))
    return value


def _number(src: _Source, path: FieldPath, value: Any, *, positive: bool, what: str) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (value <= 0 if positive else value < 0):
        raise src.error(path, f"bad {what}", expected="a positive number" if positive else "a number >= 0",
                        found=repr(value))
    return float(value)


def _parse_link(src: _Source, path: FieldPath, value: Any, extra: tuple[str, ...] = ()) -> Link:
    m = _mapping(src, path, value, ("bandwidth_gbps", "latency_ms") + extra)
    if "bandwidth_gbps" not in m:
        raise src.error(path + ("bandwidth_gbps",), "missing bandwidth", expected="bandwidth_gbps in Gb/s",
                        found="nothing", fix="add `bandwidth_gbps: <Gb/s>`")
    bw = _number(src, path + ("bandwidth_gbps",), m["bandwidth_gbps"], positive=True, what="bandwidth (Gb/s)")
    lat = _number(src, path + ("latency_ms",), m.get("latency_ms", 0.0), positive=False, what="latency (ms)")
    return Link(bandwidth_gbps=bw, latency_ms=lat)


# --- devices -------------------------------------------------------------------------
def _resolve_device(src: _Source, path: FieldPath, entry: Mapping[str, Any]) -> DeviceSpec:
    """The spec of one ``devices`` entry: inline, catalog or profile JSON, then any efficiency override."""
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
        spec = _profile_spec(src, path + ("type",), type_name)
    else:
        close = suggest_device_names(type_name)
        raise src.error(path + ("type",), f"unknown device type {type_name!r}",
                        expected=f"one of {', '.join(CATALOG)} or a profile JSON path", found=repr(type_name),
                        fix=f"did you mean {' or '.join(close)}?" if close else
                        "profile the device with `stagewise profile` and give the JSON's path")
    if "efficiency" in entry:
        eff = entry["efficiency"]
        if isinstance(eff, bool) or not isinstance(eff, (int, float)) or not 0 < eff <= 1:
            raise src.error(path + ("efficiency",), "bad efficiency", expected="a fraction in (0, 1]",
                            found=repr(eff))
        spec = spec.with_efficiency(float(eff))
    if "metis_profile" in entry:
        spec = _metis_spec(src, path + ("metis_profile",), entry, spec)
    return spec


def _metis_spec(src: _Source, path: FieldPath, entry: Mapping[str, Any], spec: DeviceSpec) -> DeviceSpec:
    """``spec`` calibrated by Metis per-layer profiles: ``metis_profile: {path: FILE_OR_DIR, hidden_size: H,
    seq_len: S, dtype: float16}`` (the shape Metis profiled at, which its files do not record)."""
    for other in ("efficiency", "spec"):
        if other in entry:
            raise src.error(path, f"metis_profile with {other}", expected="one source of the device's efficiency",
                            found=f"both metis_profile and {other}", fix=f"drop {other} or metis_profile")
    m = _mapping(src, path, entry["metis_profile"], _METIS_KEYS)
    where = _string(src, path, m, "path", "Metis profile path", "give a DeviceType.*.json file or its directory")
    dtype = m.get("dtype", "float16")
    if dtype not in FIT_DTYPES:
        raise src.error(path + ("dtype",), "bad dtype", expected=" or ".join(FIT_DTYPES), found=repr(dtype))
    for key in ("hidden_size", "seq_len"):
        if key not in m:
            raise src.error(path + (key,), f"missing {key}", expected="the shape Metis profiled the layers at",
                            found="nothing", fix=f"add `{key}: <int>` (Metis's files do not record it)")
    try:
        shape = GPTLayerShape(hidden_size=m["hidden_size"], seq_len=m["seq_len"])
        return calibrate_from_metis(spec, read_metis_profiles(src.base_dir / where), shape, dtype)[0]
    except InvalidInputError as exc:
        raise src.rewrap(path, exc) from None


def _profile_spec(src: _Source, path: FieldPath, type_name: str) -> DeviceSpec:
    profile = src.base_dir / type_name
    if not profile.is_file():
        raise src.error(path, f"profile file {type_name!r} does not exist", expected=f"a profile JSON at {profile}",
                        found="no such file",
                        fix="run `stagewise profile -o FILE.json` on that machine; paths are relative "
                            "to the cluster file")
    try:
        return load_profile_spec(profile)
    except InvalidInputError as exc:
        raise src.rewrap(path, exc) from None


def _parse_devices(src: _Source, path: FieldPath, entries: Any, host: str, region: str, trust: str,
                   trusted: bool, verifier: bool) -> tuple[Device, ...]:
    if not isinstance(entries, list) or not entries:
        raise src.error(path, "no devices", expected="a list like [{type: A100-80GB, count: 2}]",
                        found=repr(entries))
    devices: list[Device] = []
    for j, entry in enumerate(entries):
        epath = path + (j,)
        spec = _resolve_device(src, epath, _mapping(src, epath, entry, _DEVICE_KEYS))
        count = entry.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise src.error(epath + ("count",), "bad count", expected="an integer >= 1", found=repr(count))
        if verifier and spec.kind != "cpu":
            raise src.error(epath + ("type",), "a verifier host is CPU-only", expected="a CPU device",
                            found=spec.name, fix="move the GPU to a worker host")
        for _ in range(count):
            devices.append(Device(id=f"{host}/{len(devices)}", host=host, region=region, trust=trust,
                                  trusted=trusted, spec=spec, cpu_only=spec.kind == "cpu" or verifier))
    return tuple(devices)


# --- hosts, links, cluster -------------------------------------------------------------
def _parse_host(src: _Source, path: FieldPath, value: Any) -> Host:
    m = _mapping(src, path, value, _HOST_KEYS)
    name = _string(src, path, m, "name", "host name", "give every host a unique name")
    if "/" in name:
        raise src.error(path + ("name",), "bad host name", expected="a name without '/'", found=repr(name),
                        fix="device ids are host/index: rename the host")
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
                        found=repr(trusted), fix="mark the host `trusted: true` or drop `role: verifier`")
    verifier = role == "verifier"
    entries = m.get("devices", [{"type": "CPU", "count": 1}] if verifier else None)
    devices = _parse_devices(src, path + ("devices",), entries, name, region, trust, trusted, verifier)
    intra = _parse_link(src, path + ("intra_host",), m["intra_host"]) if "intra_host" in m else None
    return Host(name=name, region=region, trust=trust, trusted=trusted, devices=devices, role=role,
                intra_host=intra)


def _parse_pairs(src: _Source, path: FieldPath, value: Any, known: Mapping[str, Any],
                 kind: str) -> list[tuple[tuple[str, str], Link]]:
    if not isinstance(value, list):
        raise src.error(path, "wrong type", expected="a list of {between: [a, b], bandwidth_gbps, latency_ms}",
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
                raise src.error(path + (i, "between"), f"undefined {kind} {b!r}", expected=f"one of {', '.join(known)}",
                                found=repr(b), fix=f"fix the name or define the {kind}")
        if frozenset(between) in seen:
            raise src.error(path + (i, "between"), f"{kind} pair {between} given twice", expected="each pair once",
                            found="a duplicate", fix="keep one")
        seen.add(frozenset(between))
        out.append(((between[0], between[1]), link))
    return out


def _parse_hosts(src: _Source, raw_hosts: Any) -> dict[str, Host]:
    if not isinstance(raw_hosts, list) or not raw_hosts:
        raise src.error(("hosts",), "empty cluster", expected="a non-empty list of hosts", found=repr(raw_hosts),
                        fix="list at least one host with devices")
    hosts: dict[str, Host] = {}
    for i, raw in enumerate(raw_hosts):
        host = _parse_host(src, ("hosts", i), raw)
        if host.name in hosts:
            raise src.error(("hosts", i, "name"), f"duplicate host name {host.name!r}",
                            expected="unique host names", found="a second host of that name",
                            fix="rename one of the hosts")
        hosts[host.name] = host
    return hosts


def _parse_cluster(data: Any, src: _Source) -> ClusterSpec:
    if data is None:
        raise src.error((), "empty cluster", expected="a mapping with hosts and links", found="nothing")
    m = _mapping(src, (), data, ("name", "hosts", "links"))
    name = m.get("name") or (Path(src.file).stem if src.file else "cluster")
    if not isinstance(name, str):
        raise src.error(("name",), "bad cluster name", expected="a string", found=repr(name))
    hosts = _parse_hosts(src, m.get("hosts"))
    links = _mapping(src, ("links",), m.get("links", {}), _LINKS_KEYS)
    intra = _parse_link(src, ("links", "intra_host"), links["intra_host"]) if "intra_host" in links \
        else DEFAULT_INTRA_HOST
    default = _parse_link(src, ("links", "default"), links["default"]) if "default" in links else DEFAULT_LINK
    regions = dict.fromkeys(h.region for h in hosts.values())
    region_links = _parse_pairs(src, ("links", "regions"), links.get("regions", []), regions, "region")
    host_links = _parse_pairs(src, ("links", "hosts"), links.get("hosts", []), hosts, "host")
    try:
        return ClusterSpec(name=name, hosts=tuple(hosts.values()), intra_host=intra, default=default,
                           regions=tuple(RegionLink(between=b, link=lk) for b, lk in region_links),
                           host_links=tuple(HostLink(between=b, link=lk) for b, lk in host_links))
    except InvalidInputError as exc:
        raise src.rewrap((), exc) from None


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
    return read_cluster_file(p)


def default_cluster() -> ClusterSpec:
    """The embedded default cluster (``cost_models/clusters/default.yaml``)."""
    return load_cluster(DEFAULT_CLUSTER_PATH)


def cluster_source(cluster: str | Path | None) -> str | None:
    """Where a cluster argument reads from, as a plan records it: a packaged name (``default`` for None), a
    file's absolute path, or None for anything else (an in-memory ``ClusterSpec``)."""
    if cluster is None:
        return DEFAULT_CLUSTER_PATH.stem
    if not isinstance(cluster, (str, Path)):
        return None
    p = Path(cluster)
    if not p.exists() and p.suffix == "" and len(p.parts) == 1 and (PACKAGED_CLUSTERS_DIR / f"{p.name}.yaml").is_file():
        return p.name
    return str(p.resolve())
