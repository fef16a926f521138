"""A Hugging Face model folder's weights (``hf:DIR``), read offline into a built model.

``save_pretrained`` (and ``stagewise run --save-weights`` for an ``hf:`` plan) writes
``model.safetensors``, or shards that ``model.safetensors.index.json`` lists. Only
safetensors are read: a folder whose weights are pickles (``pytorch_model.bin``) is
refused by name, never unpickled. Each tensor is read on its own (``safe_open``), so a
rank reads only its stage's parameters.

Names are the model's own. A tied weight is found under any of its names (the library
saves a tied head once, under the embedding's name); keys saved from the bare base model
(without the head's ``base_model_prefix``) are found too, as ``from_pretrained`` finds
them. Keys the model lacks are ignored, as ``from_pretrained`` ignores them; a buffer the
folder lacks keeps its built value (rotary tables are not saved). A parameter the folder
lacks, or one of another shape, is an error naming the first such parameter.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from planner.errors import InvalidInputError, first_line

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Weights in formats this never reads (pickles, other frameworks): named in the error, not ignored.
_UNREAD_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5", "flax_model.msgpack")
_OPT_OUT = "pass --init random to start from the config's random weights"


@dataclass(frozen=True, slots=True, kw_only=True)
class SavedTensor:
    """One tensor of a folder, as its file's header describes it (nothing of its data read)."""

    path: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: F32, BF16, I64, ...

    @property
    def is_float(self) -> bool:
        return self.dtype.startswith(("F", "BF"))


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightFiles:
    """A model folder's safetensors weights: every key, in which file, at which shape."""

    folder: Path
    tensors: Mapping[str, SavedTensor]


def find_weights(folder: str | Path) -> WeightFiles | None:
    """The safetensors weights of a model folder; None when it holds none (a config alone)."""
    folder = Path(folder)
    if (folder / INDEX_FILE).is_file():
        files = _index_files(folder)
    elif (folder / WEIGHTS_FILE).is_file():
        files = (folder / WEIGHTS_FILE,)
    else:
        unread = [name for name in _UNREAD_FILES if (folder / name).is_file()]
        if unread:
            raise InvalidInputError(f"the weights in {str(folder)!r}", expected=f"{WEIGHTS_FILE} or {INDEX_FILE} "
                                    "(safetensors: a pickle is never loaded)", found=f"only {unread[0]}",
                                    fix="convert them with save_pretrained(folder, safe_serialization=True), or "
                                    + _OPT_OUT)
        return None
    tensors: dict[str, SavedTensor] = {}
    for path in files:
        tensors.update(_header(path))
    return WeightFiles(folder=folder, tensors=tensors)


def _index_files(folder: Path) -> tuple[Path, ...]:
    """The shard files an index names: plain file names inside the folder, each present."""
    path = folder / INDEX_FILE
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise InvalidInputError(f"weight index {str(path)!r}", expected="a JSON object",
                                found=first_line(exc)) from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise InvalidInputError(f"weight index {str(path)!r}", expected="a 'weight_map' object of tensor name -> "
                                "file name", found="none" if weight_map is None else type(weight_map).__name__)
    files: list[Path] = []
    for name in dict.fromkeys(weight_map.values()):
        shard = folder / name
        if Path(name).name != name or name.startswith(".") or not shard.is_file():
            raise InvalidInputError(f"shard {name!r} in {str(path)!r}", expected="a file name in the same folder",
                                    found="a path" if Path(name).name != name or name.startswith(".")
                                    else "no such file", fix="save the model again with save_pretrained")
        files.append(shard)
    return tuple(files)


def _header(path: Path) -> dict[str, SavedTensor]:
    """Every tensor's shape and dtype from a safetensors header."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            out = {}
            for key in f.keys():
                view = f.get_slice(key)
                out[key] = SavedTensor(path=path, shape=tuple(int(d) for d in view.get_shape()),
                                       dtype=str(view.get_dtype()))
            return out
    except (SafetensorError, OSError, ValueError) as exc:
        raise InvalidInputError(f"weights file {str(path)!r}", expected="a safetensors file",
                                found=first_line(exc), fix="save the model again with save_pretrained") from None


# ---------------------------------------------------------------------------- matching the model

def check_weights(model: nn.Module, weights: WeightFiles, *, what: str) -> None:
    """Every parameter of ``model`` (built on meta is enough) in ``weights`` at its shape; else an error
    naming the first one that is not, in the model's registration order."""
    _match(model, weights, [n for n, _ in model.named_parameters()], what=what)


def load_weights(model: nn.Module, weights: WeightFiles, names: Sequence[str], *, what: str) -> int:
    """Copy the saved tensors of ``names`` (parameters and buffers of ``model``) into ``model``, each file
    opened once and only these tensors read; returns how many were loaded."""
    found = _match(model, weights, names, what=what)
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for name, key in found.items():
        by_file.setdefault(weights.tensors[key].path, []).append((name, key))
    with torch.no_grad():
        for path, items in by_file.items():
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name, key in items:
                    _tensor(model, name).copy_(f.get_tensor(key))
    return len(found)


def _match(model: nn.Module, weights: WeightFiles, names: Sequence[str], *, what: str) -> dict[str, str]:
    """The saved key of each name; a parameter without one, or of another shape or kind, raises."""
    aliases = _aliases(model)
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    persistent = set(model.state_dict(keep_vars=True))
    prefix = str(getattr(model, "base_model_prefix", "") or "")
    found: dict[str, str] = {}
    for name in names:
        key = _key(aliases.get(name, (name,)), prefix, weights)
        if key is None:
            if name in params:
                raise InvalidInputError(f"{what}: the weights in {str(weights.folder)!r} do not match its config",
                                        expected=f"parameter {name!r} of shape {_shape(model, name)}",
                                        found="no such tensor", fix="use the config.json saved with these weights, "
                                        "or " + _OPT_OUT)
            continue  # a buffer not saved (non-persistent, or absent): it keeps its built value
        if name not in params and name not in persistent:
            continue
        saved, shape = weights.tensors[key], _shape(model, name)
        if saved.shape != shape or saved.is_float != _tensor(model, name).is_floating_point():
            raise InvalidInputError(f"{what}: the weights in {str(weights.folder)!r} do not match its config",
                                    expected=f"{name!r} of shape {shape}",
                                    found=f"{key!r} of shape {saved.shape} ({saved.dtype})",
                                    fix="use the config.json saved with these weights, or " + _OPT_OUT)
        found[name] = key
    return found


def _key(names: tuple[str, ...], prefix: str, weights: WeightFiles) -> str | None:
    """The first of a tensor's names (or their base-model forms) the folder holds."""
    stripped = tuple(n[len(prefix) + 1:] for n in names if prefix and n.startswith(prefix + "."))
    return next((n for n in (*names, *stripped) if n in weights.tensors), None)


def _aliases(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Each parameter or buffer name -> every name of the same tensor (tied weights share one)."""
    groups: dict[int, list[str]] = {}
    for name, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        groups.setdefault(id(t), []).append(name)
    return {n: tuple(names) for names in groups.values() for n in names}


def _tensor(model: nn.Module, name: str) -> torch.Tensor:
    owner, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(owner) if owner else model, attr)


def _shape(model: nn.Module, name: str) -> tuple[int, ...]:
    return tuple(int(d) for d in _tensor(model, name).shape)

