"""Join requests: a host asks into a running run, and is planned in at its next checkpoint.

A request is a small JSON file in the run's join folder (``<checkpoint-dir>/joins`` unless ``stagewise
run --join-dir`` says otherwise), written by ``stagewise join``. It names one host: either a host of
the plan's cluster that the plan excludes (lost, banned, or left out when planning: a re-admission),
or a host new to the cluster, described in the cluster file's shape (``name``, ``region``, ``trust``,
``trusted``, ``devices``, ...; it takes the cluster's links for its region, else the default link).
It is data only: read as JSON, checked against a schema and by ``cost_models``' cluster parser,
never executed. It is signed with the run secret (HMAC, as plans are) and names the model it is for,
so only someone holding the secret invites a host: a file dropped in the folder by anyone else, or
written for another run's model, is rejected.

The launcher (``planner.runtime.launcher.elastic``) watches the folder with :class:`JoinWatcher`: a request
that fails a check is reported and renamed ``<name>.rejected`` (the run goes on); a valid one waits
for the next complete checkpoint, where the run re-plans with the host and resumes. A request acted
on is renamed ``<name>.joined``.
"""
from __future__ import annotations

import hmac
import json
import re
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from cost_models.cluster_file import parse_cluster
from planner import secret
from planner.errors import InvalidInputError
from planner.outputs import write_atomic
from planner.plan_history import utc_stamp

FOLDER = "joins"  # under the checkpoint folder, unless --join-dir names another
KIND = "stagewise join request"
VERSION = 1
MAX_BYTES = 64 << 10  # a host's description is a few hundred bytes; anything much larger is not one
DONE = re.compile(r"\.(joined|rejected)\d*$")  # requests already acted on or set aside
_WRITTEN = "join request written by `stagewise join`"

REQUEST_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["kind", "version", "host", "new_host", "why", "model_fingerprint", "written_utc", "signature"],
    "properties": {
        "kind": {"const": KIND}, "version": {"const": VERSION},
        "host": {"type": "string", "minLength": 1, "maxLength": 200},
        "new_host": {"type": ["object", "null"]}, "why": {"type": "string", "maxLength": 2000},
        "model_fingerprint": {"type": "string", "maxLength": 200},
        "written_utc": {"type": "string", "maxLength": 40}, "signature": {"type": "string", "maxLength": 200},
    },
}


@dataclass(frozen=True, slots=True, kw_only=True)
class JoinRequest:
    """One host asking into a run: ``new_host`` (its description, the cluster file's shape) for a host new
    to the cluster, None for a re-admission of an excluded host of the plan's cluster."""

    host: str
    new_host: Mapping[str, Any] | None
    why: str
    model_fingerprint: str
    written_utc: str

    @property
    def readmission(self) -> bool:
        return self.new_host is None

    def describe(self) -> str:
        """``h3 joined (re-admitted): repaired`` / ``v9 joined (new host, 1 x RTX3090, trust v9): ...``."""
        if self.new_host is None:
            how = "re-admitted"
        else:
            devices = ", ".join(f"{d.get('count', 1)} x {d.get('type')}" for d in self.new_host.get("devices", ()))
            how = f"new host, {devices or 'no devices'}, trust {self.new_host.get('trust')}"
        return f"{self.host} joined ({how}): {self.why}"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": KIND, "version": VERSION, "host": self.host,
                "new_host": dict(self.new_host) if self.new_host is not None else None, "why": self.why,
                "model_fingerprint": self.model_fingerprint, "written_utc": self.written_utc}


# --------------------------------------------------------------------------- what a request may ask
def make_request(plan, *, host: str | None = None, description: str | Path | None = None,
                 why: str = "by the operator") -> JoinRequest:
    """The request for ``host`` (a re-admission) or for the new host described in the file ``description``,
    checked against ``plan`` (the run's current plan)."""
    if (host is None) == (description is None):
        raise InvalidInputError("join", expected="a host to re-admit or a new host's description",
                                found="both" if host else "neither", fix="pass --host NAME or --describe FILE")
    new_host = None if description is None else read_description(description, plan)
    request = JoinRequest(host=host if new_host is None else str(new_host["name"]), new_host=new_host, why=why,
                          model_fingerprint=plan.model.fingerprint, written_utc=utc_stamp())
    check_request(plan, request)
    return request


def read_description(path: str | Path, plan) -> dict[str, Any]:
    """A new host's description from a YAML or JSON file (a host entry of a cluster file, or a cluster
    file with one host under ``hosts``), checked and normalised against ``plan``'s cluster."""
    source = f"--describe {path}"
    text = _read_text(Path(path), what=source)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise InvalidInputError(f"{source}{f' line {mark.line + 1}' if mark else ''}: invalid YAML",
                                expected="a host in the cluster file's shape", found=getattr(exc, "problem", None)
                                or str(exc), fix="fix the syntax at that line") from None
    if isinstance(data, Mapping) and set(data) == {"hosts"}:
        hosts = data["hosts"]
        if not isinstance(hosts, list) or len(hosts) != 1:
            raise InvalidInputError(f"{source}: hosts", expected="exactly one host", fix="one request per host")
        data = hosts[0]
    if not isinstance(data, Mapping) or not isinstance(data.get("name"), str):
        raise InvalidInputError(source, expected="a host with a name, region, trust, trusted and devices, as in a "
                                "cluster file", found=type(data).__name__ if not isinstance(data, Mapping)
                                else "no name", fix="e.g. {name: v9, region: eu, trust: v9, devices: "
                                "[{type: RTX3090}]}")
    return normalised_host(plan, data, source=source, base_dir=Path(path).resolve().parent)


def normalised_host(plan, data: Mapping[str, Any], *, source: str, base_dir: Path | None = None) -> dict[str, Any]:
    """``data`` parsed as one more host of ``plan``'s cluster (``cost_models``' parser), in the shape the
    plan stores (a profiled device inlined, so the request needs no other file)."""
    if data.get("name") in {h.get("name") for h in plan.cluster["hosts"]}:
        return dict(data)  # check_request names the clash better than the parser's "duplicate"
    hosts = list(plan.cluster["hosts"])
    try:
        cluster = parse_cluster({**plan.cluster, "hosts": [*hosts, dict(data)]}, base_dir=base_dir)
    except InvalidInputError as exc:
        where, name = f"cluster: hosts[{len(hosts)}]", f"host {data.get('name')!r}"  # the parser's path: name it
        what = exc.what.replace(f"{where}.", f"{name}: ", 1).replace(where, name, 1)
        raise InvalidInputError(f"{source}: {what}", expected=exc.expected, found=exc.found, fix=exc.fix) from None
    return cluster.host(str(data["name"])).to_dict()


def check_request(plan, request: JoinRequest) -> None:
    """Refuse a request ``plan`` cannot take: another model's, an unknown host not described, a host the
    plan can use already, a description clashing with a host of the cluster, or a bad description."""
    what = f"join host {request.host!r}"
    if request.model_fingerprint != plan.model.fingerprint:
        raise InvalidInputError(f"{what}: the request is for another model", expected=f"this run's model "
                                f"(fingerprint {plan.model.fingerprint[:12]}...)",
                                found=f"{request.model_fingerprint[:12]}...",
                                fix="write it with `stagewise join` against this run's plan")
    names = [h.get("name") for h in plan.cluster["hosts"]]
    excluded = set(plan.excluded_hosts)
    if request.new_host is None and request.host not in names:
        raise InvalidInputError(what, expected=f"a host of the plan's cluster ({', '.join(map(str, names))}) or a "
                                "new host's description", found="not in the cluster, not described",
                                fix="describe it: stagewise join PLAN --describe HOST.yaml")
    if request.host in names and request.host not in excluded:
        raise InvalidInputError(what, expected="a host the plan leaves out (" + (", ".join(sorted(excluded))
                                or "none") + ") or a new one", found="in the plan already",
                                fix="nothing to do: the plan can use it already")
    if request.new_host is not None:
        if request.new_host.get("name") != request.host:
            raise InvalidInputError(f"{what}: description", expected=f"name {request.host!r}",
                                    found=repr(request.new_host.get("name")))
        if request.host in names:
            raise InvalidInputError(what, expected="a host new to the plan's cluster (or an excluded one named, "
                                    "not described)", found="an excluded host of the cluster, described anew",
                                    fix=f"re-admit it by name: stagewise join PLAN --host {request.host}")
        normalised_host(plan, request.new_host, source=f"join request for {request.host}")


# --------------------------------------------------------------------------- request files
def write_request(folder: str | Path, request: JoinRequest, key: bytes) -> Path:
    """Sign ``request`` and write it into ``folder`` atomically (the watcher never sees half a file);
    refused while another request for the same host is waiting there."""
    base = Path(folder)
    for path in pending(base):
        try:
            other = read_request(path, key)
        except InvalidInputError:
            continue  # the launcher rejects it; it asks for nothing
        if other.host == request.host:
            raise InvalidInputError(f"join host {request.host!r}", expected="one waiting request per host",
                                    found=f"{path} waiting already",
                                    fix="wait for the run's next checkpoint, or delete that file")
    stem = "join-" + re.sub(r"[^A-Za-z0-9_.-]", "_", request.host)
    path, n = base / f"{stem}.json", 1
    while path.exists():
        path, n = base / f"{stem}-{n}.json", n + 1
    content = request.to_dict()
    return write_atomic(path, json.dumps({**content, "signature": secret.sign(key, content)}, indent=1) + "\n")


def pending(folder: str | Path) -> list[Path]:
    """The request files waiting in ``folder``, oldest first (hidden files are ones being written)."""
    base = Path(folder)
    if not base.is_dir():
        return []
    found = [p for p in base.iterdir() if not p.name.startswith(".") and DONE.search(p.name) is None]
    files = []
    for p in found:
        try:
            if p.is_file():
                files.append((p.stat().st_mtime, p.name, p))
        except OSError:
            continue  # gone since the listing
    return [p for _, _, p in sorted(files)]


def read_request(path: str | Path, key: bytes) -> JoinRequest:
    """The request in ``path``: JSON of the request schema, signed with ``key``; nothing else is read."""
    source = f"join request {path}"
    text = _read_text(Path(path), what=source)
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise InvalidInputError(f"{source}: not JSON", expected=_WRITTEN, found=str(exc)[:200]) from None
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(REQUEST_SCHEMA).iter_errors(data))
    if error is not None:
        where = "/".join(map(str, error.absolute_path)) or "the request"
        raise InvalidInputError(f"{source}: {where}", expected=f"{error.validator} {error.validator_value!r}"[:200],
                                found=repr(error.instance)[:200], fix=f"write it with `stagewise join` ({_WRITTEN})")
    signature = str(data.pop("signature"))
    if not hmac.compare_digest(signature.encode(), secret.sign(key, data).encode()):
        raise InvalidInputError(f"{source} does not match its signature", expected="a request signed with this "
                                "run's secret", fix="write it with `stagewise join` where the run secret is")
    return JoinRequest(host=data["host"], new_host=data["new_host"], why=data["why"],
                       model_fingerprint=data["model_fingerprint"], written_utc=data["written_utc"])


def _read_text(path: Path, *, what: str) -> str:
    try:
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise InvalidInputError(what, expected=f"at most {MAX_BYTES} bytes", found=f"{size} bytes")
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"{what} cannot be read", expected="a readable UTF-8 text file",
                                found=str(exc)[:200]) from None


# --------------------------------------------------------------------------- the launcher's side
@dataclass(frozen=True, slots=True, kw_only=True)
class Join:
    """A valid request waiting in the folder: its file, what it asks, and when it was written (mtime)."""

    path: Path
    request: JoinRequest
    written_s: float


@dataclass(slots=True)
class JoinWatcher:
    """A run's join folder as the launcher sees it, checked against the run's current ``plan``.

    :meth:`waiting` (polled by the launcher, at most every ``period_s``) says whether a valid request
    waits; bad ones are set aside as they are found (:meth:`reject`), and ``rejected`` lists them."""

    folder: Path
    plan: Any
    key: bytes
    period_s: float = 0.1  # a listing of an empty folder; a valid request is read again only until the stop
    rejected: list[dict[str, str]] = field(default_factory=list)
    _last: float = float("-inf")
    _found: bool = False

    def waiting(self) -> bool:
        now = time.monotonic()
        if now - self._last >= self.period_s:
            self._last = now
            self._found = bool(self.take())
        return self._found

    def take(self) -> list[Join]:
        """Every valid request waiting now, one per host, oldest first; the others rejected."""
        joins: list[Join] = []
        for path in pending(self.folder):
            try:
                written = path.stat().st_mtime
                request = read_request(path, self.key)
                check_request(self.plan, request)
                clash = next((j for j in joins if j.request.host == request.host), None)
                if clash is not None:
                    raise InvalidInputError(f"join host {request.host!r}", expected="one request per host",
                                            found=f"{clash.path.name} asks for it too")
            except FileNotFoundError:
                continue  # withdrawn while we looked
            except InvalidInputError as exc:
                if path.exists():
                    self.reject(path, str(exc))
                continue
            joins.append(Join(path=path, request=request, written_s=written))
        return joins

    def reject(self, path: Path, error: str) -> None:
        """Set ``path`` aside (``.rejected``) and say why; the run goes on."""
        moved = _rename(path, "rejected")
        self.rejected.append({"file": str(moved or path), "error": error})
        print(f"stagewise run: join request {path} rejected: {error}", file=sys.stderr, flush=True)

    def accept(self, joins: list[Join]) -> None:
        for j in joins:
            _rename(j.path, "joined")


def _rename(path: Path, suffix: str) -> Path | None:
    """``path`` renamed ``<name>.<suffix>`` (numbered if taken); None when it is gone already."""
    target, n = path.with_name(f"{path.name}.{suffix}"), 1
    while target.exists():
        target, n = path.with_name(f"{path.name}.{suffix}{n}"), n + 1
    try:
        path.rename(target)
    except FileNotFoundError:
        return None
    return target
