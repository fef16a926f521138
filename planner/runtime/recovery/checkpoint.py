"""Checkpoints of a run: per rank, its parameters and optimizer state keyed by the model's own names.

Layout: ``DIR/step-00000012/rank3.safetensors`` (tensors: ``param/<name>``,
``optim/<name>/<key>``, ``rng/cpu``; metadata: the step, the rank, the plan's
model fingerprint) and ``DIR/step-00000012/MANIFEST.json``, written by rank 0
last, once every rank has written its file: a checkpoint without it is
incomplete and never read. Files are written atomically (``planner.outputs``)
in a format that runs no code when read (safetensors). Because tensors are keyed
by parameter name, a checkpoint resumes any stage layout of the same model.

The manifest is the checkpoint's authority: per rank file, its writer (rank, host) and sha256; per
parameter, its owner, the rank the plan gave it (a trusted one first where several hold it), whose
file alone it is read from; all signed with the run secret (HMAC-SHA256). So a rank that writes
another stage's parameters into its own file changes nothing, and a file replaced after the
manifest is refused and blamed on its writer, not on the rank that reads it. An unsigned or corrupt
manifest, or a file that does not match it, makes the checkpoint unusable: :func:`latest` falls back
to the newest good one and says why it skipped the others. The step is
the data position too (each step's batches are a function of the step). A checkpoint that the
survivors of a failure left (:mod:`planner.runtime.recovery.survivors`) lists in its manifest the ranks whose
files make it (``ranks``); one without that key has a file from each of its ``num_ranks`` ranks.
Which complete checkpoints stay (:func:`prunable`) is the control rank's decision by
``planner.integrity.lookback``: the ``KEEP`` newest; while a verifier's flag on some sender is unresolved,
the newest at or before that sender's resume bound (before its first flagged step, and for a sender of an
audited stage far enough before it that an attack sampled audits missed began after it); and for the
audited senders not flagged yet, a ladder of older ones that keeps such a checkpoint for a flag still to
come. When a ban stops a run, the checkpoints newer than its resume bound are set aside (:func:`set_aside`:
renamed, kept for a look, never resumed from), so the newest complete checkpoint left is the clean one.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import re
import shutil
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jsonschema
import torch
from safetensors import safe_open
from safetensors.torch import save as save_tensors

from planner import secret
from planner.errors import CheckpointError, InvalidInputError
from planner.integrity.lookback import Lookback
from planner.outputs import atomic_file, check_writable
from planner.runtime.wire.control import trusted_ranks

if TYPE_CHECKING:
    from planner.plan import Plan

MANIFEST = "MANIFEST.json"
KEEP = 2  # complete checkpoints kept: the newest, and one before it should it prove bad
_STEP_DIR = re.compile(r"^step-(\d{8})$")


@dataclass(frozen=True, slots=True, kw_only=True)
class Restored:
    """What a resumed rank got back: the step the checkpoint was taken after, and from where."""

    step: int
    folder: Path
    state: dict  # what this rank saved beside its tensors (``save_rank(state=...)``), e.g. its verifier's bans


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """Who writes a checkpoint: each rank's host, which ranks are trusted, and per parameter the ranks
    the plan gives it (its owner is the first of them whose file the checkpoint has)."""

    num_ranks: int
    fingerprint: str
    hosts: Mapping[int, str]
    holders: Mapping[str, tuple[int, ...]]  # parameter -> ranks holding it, the preferred owner first
    trusted: frozenset[int] = frozenset()

    @classmethod
    def of(cls, plan: Plan) -> Layout:
        trusted = trusted_ranks(plan)
        stage_of_block = {b.index: st.index for st in plan.stages for b in st.blocks}
        stages_of: dict[str, set[int]] = {}
        for st in plan.stages:
            for block in st.blocks:
                for name in block.param_names:
                    stages_of.setdefault(name, set()).add(st.index)
        for tied in plan.tied_params:
            stages_of.setdefault(tied.name, set()).update(stage_of_block[b] for b in tied.blocks)
        holders = {name: tuple(sorted((r.rank for r in plan.ranks if r.stage in stages),
                                      key=lambda r: (r not in trusted, r)))
                   for name, stages in stages_of.items()}
        return cls(num_ranks=plan.num_ranks, fingerprint=plan.model.fingerprint,
                   hosts={r.rank: r.host for r in plan.ranks}, holders=holders, trusted=trusted)

    def owners(self, ranks: Collection[int], held: Mapping[int, Collection[str]]) -> dict[str, int]:
        """Per parameter, the rank whose file a restore reads it from, of ``ranks`` (those whose files
        make the checkpoint); a name the plan gives no rank (``held``: what each file holds) goes to a
        trusted holder first."""
        out = {name: next(r for r in ranks_ if r in ranks) for name, ranks_ in self.holders.items()
               if any(r in ranks for r in ranks_)}
        for rank in sorted(held, key=lambda r: (r not in self.trusted, r)):
            for name in held[rank]:
                out.setdefault(name, rank)
        return out


def step_folder(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def save_rank(root: str | Path, *, step: int, rank: int, fingerprint: str,
              params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer | None,
              state: dict | None = None) -> str:
    """Write this rank's file of the checkpoint after ``step`` (its optimizer update included); returns
    the file's sha256 (hex), which the control rank puts in the manifest."""
    path = step_folder(root, step) / f"rank{rank}.safetensors"
    return write_rank_file(path, step=step, rank=rank, fingerprint=fingerprint, params=params, optimizer=optimizer,
                           state=state, rng=torch.get_rng_state())


def write_rank_file(path: str | Path, *, step: int, rank: int, fingerprint: str,
                    params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer | None,
                    state: dict | None, rng: torch.Tensor) -> str:
    """One rank file (atomically): ``params``, their optimizer state by name, the CPU RNG state ``rng``;
    the step, rank, model fingerprint and ``state`` (JSON) as metadata. Returns its sha256 (hex)."""
    tensors = {f"param/{n}": p.detach().cpu().contiguous() for n, p in params.items()}
    if optimizer is not None:
        name_of = {id(p): n for n, p in params.items()}
        for p, per_param in optimizer.state.items():
            for key, value in per_param.items():
                if torch.is_tensor(value):
                    tensors[f"optim/{name_of[id(p)]}/{key}"] = value.detach().cpu().contiguous()
    tensors["rng/cpu"] = rng
    meta = {"step": str(step), "rank": str(rank), "fingerprint": fingerprint, "state": json.dumps(state or {})}
    data = save_tensors(tensors, metadata=meta)
    with atomic_file(path, binary=True) as fh:
        fh.write(data)
    return hashlib.sha256(data).hexdigest()


def file_digest(path: str | Path) -> str:
    """The sha256 (hex) of a file's bytes."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def complete(root: str | Path, *, step: int, layout: Layout, key: bytes, digests: Mapping[int, str] | None = None,
             unresolved: Mapping[int, int] | None = None, lookback: Lookback | None = None,
             ranks: Sequence[int] | None = None) -> None:
    """The control rank (or the launcher), once every rank has written: mark the checkpoint complete with
    a signed manifest, then prune older ones (``unresolved``: sender -> first flagged step of each unresolved
    flag; ``lookback``: the run's audit lookback; see :func:`prunable`). ``digests``: each rank's sha256 of
    its own file, as it sent it (None: read here). ``ranks``: the ranks whose files make the checkpoint when
    not all wrote one (the survivors of a failure, :mod:`planner.runtime.recovery.survivors`)."""
    folder = step_folder(root, step)
    listed = sorted(ranks) if ranks is not None else list(range(layout.num_ranks))
    missing = [r for r in listed if not (folder / f"rank{r}.safetensors").is_file()]
    if missing:
        raise InvalidInputError(f"checkpoint {folder}", expected=f"a file from each of ranks {listed}",
                                found=f"none from ranks {missing}", fix="check that every rank shares the folder")
    files = {}
    for r in listed:
        path = folder / f"rank{r}.safetensors"
        files[path.name] = {"rank": r, "host": layout.hosts.get(r, "?"),
                            "sha256": digests[r] if digests is not None else file_digest(path)}
    uncovered = {r: _param_names(folder / f"rank{r}.safetensors") - set(layout.holders) for r in listed}
    manifest: dict[str, Any] = {"step": step, "num_ranks": layout.num_ranks, "fingerprint": layout.fingerprint,
                                "ranks": listed, "files": files,
                                "owners": layout.owners(set(listed), {r: n for r, n in uncovered.items() if n})}
    manifest["signature"] = secret.sign(key, manifest)
    with atomic_file(folder / MANIFEST) as fh:
        json.dump(manifest, fh)
    for old in prunable(complete_steps(root), now=step, unresolved=unresolved or {}, lookback=lookback):
        shutil.rmtree(step_folder(root, old), ignore_errors=True)


def _param_names(path: Path) -> set[str]:
    with safe_open(str(path), framework="pt") as f:
        return {k.partition("/")[2] for k in f.keys() if k.startswith("param/")}


def prunable(steps: Sequence[int], *, now: int, unresolved: Mapping[int, int] | None = None,
             lookback: Lookback | None = None) -> list[int]:
    """Of the complete checkpoints ``steps``, those to delete once step ``now`` is done: all but the ``KEEP``
    newest and those ``lookback`` keeps (``Lookback.keep``; without audits: while a flag first raised at step
    ``f`` is unresolved, the newest one before ``f``, as the one taken after step ``c`` holds no update of step
    ``c + 1`` or later)."""
    keep = (lookback or Lookback()).keep(steps, now=now, unresolved=unresolved or {}, newest=KEEP)
    return [s for s in sorted(steps) if s not in keep]


def set_aside(root: str | Path, *, from_step: int) -> list[Path]:
    """Rename the complete checkpoints of ``from_step`` and later to ``step-N.tainted`` (a banned sender
    may have had a hand in them: ``from_step`` is one past the bans' resume bound,
    ``retention.set_aside_from``); nothing loads them any more. Returns their new paths."""
    moved = []
    for step in complete_steps(root):
        if step >= from_step:
            folder = step_folder(root, step)
            target, n = folder.with_name(folder.name + ".tainted"), 1
            while target.exists():
                target, n = folder.with_name(f"{folder.name}.tainted{n}"), n + 1
            folder.rename(target)
            moved.append(target)
    return moved


def complete_steps(root: str | Path) -> list[int]:
    """The steps of the complete checkpoints under ``root``, oldest first."""
    base = Path(root)
    if not base.is_dir():
        return []
    steps = []
    for child in base.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and (child / MANIFEST).is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


@dataclass(frozen=True, slots=True, kw_only=True)
class Resumable:
    """The checkpoint a run resumes from, and the newer ones it could not use (one line each)."""

    step: int
    refused: tuple[str, ...] = ()


def latest(root: str | Path, *, fingerprint: str, key: bytes) -> Resumable:
    """The newest complete checkpoint whose manifest is signed and whose files match it; the newer ones
    that are not, each with why (a bad file names its writer). An error when none can be used, or when
    the newest usable one is another model's."""
    steps = complete_steps(root)
    if not steps:
        raise InvalidInputError(f"--resume from {root}", expected="a complete checkpoint (a step-* folder with "
                                f"{MANIFEST})", found="none", fix="run without --resume, or point --checkpoint-dir "
                                "at the folder of the earlier run")
    refused = []
    for step in reversed(steps):
        try:
            manifest = read_manifest(root, step=step, key=key)
            for name in manifest["files"]:
                check_file(root, step=step, manifest=manifest, name=name)
        except CheckpointError as exc:
            refused.append(f"step {step}: {exc}")
            continue
        if manifest["fingerprint"] != fingerprint:
            raise InvalidInputError(f"checkpoint {step_folder(root, step)}", expected="one of this plan's model",
                                    found=f"model fingerprint {str(manifest['fingerprint'])[:16]}...",
                                    fix="resume with a plan of the same model, or use another --checkpoint-dir")
        return Resumable(step=step, refused=tuple(refused))
    raise InvalidInputError(f"--resume from {root}", expected="a checkpoint with a signed manifest and files "
                            "that match it", found="; ".join(refused)[:600],
                            fix="run without --resume, or with the run secret the checkpoints were written with")


_MANIFEST_SCHEMA = {
    "type": "object", "required": ["step", "num_ranks", "fingerprint", "ranks", "files", "owners", "signature"],
    "properties": {
        "step": {"type": "integer"}, "num_ranks": {"type": "integer", "minimum": 1},
        "fingerprint": {"type": "string"}, "signature": {"type": "string"},
        "ranks": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "files": {"type": "object", "additionalProperties": {
            "type": "object", "required": ["rank", "host", "sha256"],
            "properties": {"rank": {"type": "integer"}, "host": {"type": "string"}, "sha256": {"type": "string"}}}},
        "owners": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}},
    },
}


def read_manifest(root: str | Path, *, step: int, key: bytes) -> dict[str, Any]:
    """The manifest of the checkpoint after ``step``, checked: JSON of the expected shape, signed with
    the run secret ``key``, naming ``step``."""
    path = step_folder(root, step) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"manifest {path}", expected="readable JSON", found=str(exc)[:120]) from None
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(_MANIFEST_SCHEMA).iter_errors(manifest))
    if error is not None:
        raise CheckpointError(f"manifest {path}", expected="a signed manifest of this version",
                              found=(error.message or "another shape")[:120])
    body = {k: v for k, v in manifest.items() if k != "signature"}
    if not hmac.compare_digest(str(manifest["signature"]), secret.sign(key, body)) or manifest["step"] != step:
        raise CheckpointError(f"manifest {path}", expected="signed with this run's secret",
                              found="another signature (edited, or another secret's)")
    return manifest


def check_file(root: str | Path, *, step: int, manifest: Mapping[str, Any], name: str) -> Path:
    """The rank file ``name`` of the checkpoint after ``step``, if its bytes are what the manifest says
    (else an error that names the rank and host that wrote it)."""
    entry = manifest["files"].get(name)
    path = step_folder(root, step) / name
    if entry is None:
        raise CheckpointError(f"checkpoint {step_folder(root, step)}", expected=f"{name} in its manifest",
                              found="no such entry")
    try:
        ok = path.is_file() and hmac.compare_digest(file_digest(path), str(entry["sha256"]))
    except OSError:
        ok = False
    if not ok:
        raise CheckpointError(f"rank {entry['rank']}'s file {path} (written on host {entry['host']})",
                              writer=int(entry["rank"]), expected="the bytes whose sha256 the manifest holds",
                              found="other bytes (changed after the checkpoint was taken)" if path.is_file()
                              else "no file", fix=f"check host {entry['host']}; the run resumes from an older "
                              "checkpoint")
    return path


def rank_files(root: str | Path, *, step: int) -> list[Path]:
    """The rank files the manifest of the checkpoint after ``step`` lists (unchecked: for a look)."""
    manifest = json.loads((step_folder(root, step) / MANIFEST).read_text(encoding="utf-8"))
    return [step_folder(root, step) / name for name in sorted(manifest["files"])]


def _by_owner(root: str | Path, *, step: int, manifest: Mapping[str, Any], names: Collection[str]
              ) -> dict[Path, set[str]]:
    """Which of ``names`` to read from which rank file, each from its owner's alone (each file checked once)."""
    by_file: dict[str, set[str]] = {}
    for name in names:
        owner = manifest["owners"].get(name)
        if owner is not None:
            by_file.setdefault(f"rank{owner}.safetensors", set()).add(name)
    return {check_file(root, step=step, manifest=manifest, name=f): mine for f, mine in by_file.items()}


def read_params(root: str | Path, *, step: int, names: Collection[str], key: bytes) -> dict[str, torch.Tensor]:
    """The parameters ``names`` of the checkpoint after ``step``, each from its owner's file; names no
    rank owns are left out."""
    found: dict[str, torch.Tensor] = {}
    manifest = read_manifest(root, step=step, key=key)
    for path, mine in _by_owner(root, step=step, manifest=manifest, names=names).items():
        with safe_open(str(path), framework="pt") as f:
            found.update({n: f.get_tensor(f"param/{n}") for n in mine if f"param/{n}" in f.keys()})
    return found


def restore_rank(root: str | Path, *, step: int, params: dict[str, torch.Tensor],
                 optimizer: torch.optim.Optimizer | None, rank: int, key: bytes) -> Restored:
    """Load the named parameters (and their optimizer state) this rank holds from the checkpoint after
    ``step``, each from its owner's file; this rank's RNG state and extra state if it wrote a file."""
    folder = step_folder(root, step)
    found: dict[str, torch.Tensor] = {}
    manifest = read_manifest(root, step=step, key=key)
    owned = _by_owner(root, step=step, manifest=manifest, names=params)
    for path, mine in owned.items():
        with safe_open(str(path), framework="pt") as f:
            for k in f.keys():
                kind, _, rest = k.partition("/")
                name = rest if kind == "param" else rest.rpartition("/")[0] if kind == "optim" else None
                if name in mine:
                    found[k] = f.get_tensor(k)
    state: dict = {}
    own = f"rank{rank}.safetensors"
    if own in manifest["files"]:
        path = step_folder(root, step) / own
        checked = path if path in owned else check_file(root, step=step, manifest=manifest, name=own)
        with safe_open(str(checked), framework="pt") as f:
            state = json.loads((f.metadata() or {}).get("state", "{}"))
            found["rng/cpu"] = f.get_tensor("rng/cpu")
    missing = [n for n in params if f"param/{n}" not in found]
    if missing:
        raise InvalidInputError(f"checkpoint {folder}", expected="every parameter this rank holds",
                                found=f"no {missing[0]!r} (and {len(missing) - 1} more)" if len(missing) > 1
                                else f"no {missing[0]!r}", fix="resume with a plan of the same model")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(found[f"param/{n}"])
    if optimizer is not None:
        for n, p in params.items():
            per_param = {k.rsplit("/", 1)[1]: t.to(p.device) for k, t in found.items() if k.startswith(f"optim/{n}/")}
            if per_param:
                optimizer.state[p] = per_param
    if "rng/cpu" in found:
        torch.set_rng_state(found["rng/cpu"])
    return Restored(step=step, folder=folder, state=state)


def check_folder(root: str | Path, *, resume: bool) -> Path:
    """The checkpoint folder, checked writable before any rank starts; a fresh run does not mix its
    checkpoints with another run's (pruning and resuming would take theirs for its own)."""
    probe = check_writable(Path(root) / MANIFEST, what="--checkpoint-dir")
    if not resume and complete_steps(root):
        raise InvalidInputError(f"--checkpoint-dir {root}", expected="an empty folder for a fresh run",
                                found=f"checkpoints of an earlier run (steps {complete_steps(root)})",
                                fix="add --resume to continue that run, or choose another folder")
    return probe.parent
