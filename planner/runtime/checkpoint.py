"""Checkpoints of a run: per rank, its parameters and optimizer state keyed by the model's own names.

Layout: ``DIR/step-00000012/rank3.safetensors`` (tensors: ``param/<name>``,
``optim/<name>/<key>``, ``rng/cpu``; metadata: the step, the rank, the plan's
model fingerprint) and ``DIR/step-00000012/MANIFEST.json``, written by rank 0
last, once every rank has written its file: a checkpoint without it is
incomplete and never read. Files are written atomically (``planner.outputs``)
in a format that runs no code when read (safetensors). Because tensors are keyed
by parameter name, a checkpoint resumes any stage layout of the same model: a
rank reads the names it needs from whichever rank's file holds them. The step is
the data position too (each step's batches are a function of the step). A checkpoint that the
survivors of a failure left (:mod:`planner.runtime.survivors`) lists in its manifest the ranks whose
files make it (``ranks``); one without that key has a file from each of its ``num_ranks`` ranks.
Only the ``KEEP`` newest complete checkpoints stay, and while a verifier's flag on some sender is
unresolved, also the last clean one: the newest taken before that sender's first flagged step
(:func:`prunable`), which is where a run resumes if the sender gets banned. When a ban stops a run,
the checkpoints taken from the first flagged step on are set aside (:func:`set_aside`: renamed, kept
for a look, never resumed from), so the newest complete checkpoint left is the clean one.
"""
from __future__ import annotations

import json
import re
import shutil
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as save_tensors

from planner.errors import InvalidInputError
from planner.outputs import atomic_file, check_writable

MANIFEST = "MANIFEST.json"
KEEP = 2  # complete checkpoints kept: the newest, and one before it should it prove bad
_STEP_DIR = re.compile(r"^step-(\d{8})$")


@dataclass(frozen=True, slots=True, kw_only=True)
class Restored:
    """What a resumed rank got back: the step the checkpoint was taken after, and from where."""

    step: int
    folder: Path
    state: dict  # what this rank saved beside its tensors (``save_rank(state=...)``), e.g. its verifier's bans


def step_folder(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def save_rank(root: str | Path, *, step: int, rank: int, fingerprint: str,
              params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer | None,
              state: dict | None = None) -> Path:
    """Write this rank's file of the checkpoint after ``step`` (its optimizer update included)."""
    path = step_folder(root, step) / f"rank{rank}.safetensors"
    write_rank_file(path, step=step, rank=rank, fingerprint=fingerprint, params=params, optimizer=optimizer,
                    state=state, rng=torch.get_rng_state())
    return path


def write_rank_file(path: str | Path, *, step: int, rank: int, fingerprint: str,
                    params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer | None,
                    state: dict | None, rng: torch.Tensor) -> None:
    """One rank file (atomically): ``params``, their optimizer state by name, the CPU RNG state ``rng``;
    the step, rank, model fingerprint and ``state`` (JSON) as metadata."""
    tensors = {f"param/{n}": p.detach().cpu().contiguous() for n, p in params.items()}
    if optimizer is not None:
        name_of = {id(p): n for n, p in params.items()}
        for p, per_param in optimizer.state.items():
            for key, value in per_param.items():
                if torch.is_tensor(value):
                    tensors[f"optim/{name_of[id(p)]}/{key}"] = value.detach().cpu().contiguous()
    tensors["rng/cpu"] = rng
    meta = {"step": str(step), "rank": str(rank), "fingerprint": fingerprint, "state": json.dumps(state or {})}
    with atomic_file(path, binary=True) as fh:
        fh.write(save_tensors(tensors, metadata=meta))


def complete(root: str | Path, *, step: int, num_ranks: int, fingerprint: str,
             keep_before: int | None = None, ranks: Sequence[int] | None = None) -> None:
    """Rank 0, once every rank has written: mark the checkpoint complete, then prune older ones
    (``keep_before``: the earliest first flagged step of an unresolved flag, see :func:`prunable`).
    ``ranks``: the ranks whose files make the checkpoint when not all ``num_ranks`` wrote one (the
    survivors of a failure, :mod:`planner.runtime.survivors`); the manifest lists them."""
    folder = step_folder(root, step)
    listed = sorted(ranks) if ranks is not None else list(range(num_ranks))
    missing = [r for r in listed if not (folder / f"rank{r}.safetensors").is_file()]
    if missing:
        raise InvalidInputError(f"checkpoint {folder}", expected=f"a file from each of ranks {listed}",
                                found=f"none from ranks {missing}", fix="check that every rank shares the folder")
    manifest: dict = {"step": step, "num_ranks": num_ranks, "fingerprint": fingerprint}
    if ranks is not None:
        manifest["ranks"] = listed
    with atomic_file(folder / MANIFEST) as fh:
        json.dump(manifest, fh)
    for old in prunable(complete_steps(root), keep_before=keep_before):
        shutil.rmtree(step_folder(root, old), ignore_errors=True)


def prunable(steps: Sequence[int], *, keep_before: int | None = None) -> list[int]:
    """Of the complete checkpoints ``steps``, those to delete: all but the ``KEEP`` newest and, while a
    flag first raised at step ``keep_before`` is unresolved, the newest one before that step (the last
    clean checkpoint: the one taken after step ``c`` holds no update of step ``c + 1`` or later)."""
    ordered = sorted(steps)
    keep = set(ordered[-KEEP:])
    if keep_before is not None:
        clean = [s for s in ordered if s < keep_before]
        keep.update(clean[-1:])
    return [s for s in ordered if s not in keep]


def set_aside(root: str | Path, *, from_step: int) -> list[Path]:
    """Rename the complete checkpoints of ``from_step`` and later to ``step-N.tainted`` (a banned sender
    had a hand in them); nothing loads them any more. Returns their new paths."""
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


def latest(root: str | Path, *, fingerprint: str) -> int:
    """The newest complete checkpoint's step; an error naming what is wrong when there is none to use."""
    steps = complete_steps(root)
    if not steps:
        raise InvalidInputError(f"--resume from {root}", expected="a complete checkpoint (a step-* folder with "
                                f"{MANIFEST})", found="none", fix="run without --resume, or point --checkpoint-dir "
                                "at the folder of the earlier run")
    manifest = json.loads((step_folder(root, steps[-1]) / MANIFEST).read_text())
    if manifest.get("fingerprint") != fingerprint:
        raise InvalidInputError(f"checkpoint {step_folder(root, steps[-1])}", expected="one of this plan's model",
                                found=f"model fingerprint {str(manifest.get('fingerprint'))[:16]}...",
                                fix="resume with a plan of the same model, or use another --checkpoint-dir")
    return steps[-1]


def rank_files(root: str | Path, *, step: int) -> list[Path]:
    """The rank files of the complete checkpoint after ``step``, as its manifest lists them (the run's
    own files only, never a stray one in the folder)."""
    folder = step_folder(root, step)
    manifest = json.loads((folder / MANIFEST).read_text())
    listed = manifest["ranks"] if "ranks" in manifest else range(int(manifest["num_ranks"]))  # older: every rank
    return [folder / f"rank{int(r)}.safetensors" for r in listed]


def read_params(root: str | Path, *, step: int, names: Collection[str]) -> dict[str, torch.Tensor]:
    """The parameters ``names`` of the checkpoint after ``step``, each from the first rank file that holds
    it (replicas and the stages of a tied weight hold equal copies); names no rank wrote are left out."""
    found: dict[str, torch.Tensor] = {}
    for path in rank_files(root, step=step):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                kind, _, name = key.partition("/")
                if kind == "param" and name in names and name not in found:
                    found[name] = f.get_tensor(key)
    return found


def restore_rank(root: str | Path, *, step: int, params: dict[str, torch.Tensor],
                 optimizer: torch.optim.Optimizer | None, rank: int) -> Restored:
    """Load the named parameters (and their optimizer state) this rank holds from the checkpoint after
    ``step``, whichever rank wrote them; this rank's RNG state if it wrote one."""
    folder = step_folder(root, step)
    own = f"rank{rank}.safetensors"

    def wanted(key: str, file: str) -> bool:
        kind, _, rest = key.partition("/")
        if kind == "param":
            return rest in params
        if kind == "optim":
            return rest.rpartition("/")[0] in params
        return key == "rng/cpu" and file == own

    found: dict[str, torch.Tensor] = {}
    state: dict = {}
    for path in rank_files(root, step=step):
        with safe_open(str(path), framework="pt") as f:
            if path.name == own:
                state = json.loads((f.metadata() or {}).get("state", "{}"))
            for key in f.keys():
                if key not in found and wanted(key, path.name):
                    found[key] = f.get_tensor(key)
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
            per_param = {key.rsplit("/", 1)[1]: t.to(p.device) for key, t in found.items()
                         if key.startswith(f"optim/{n}/")}
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
