"""Training data that needs no download: byte-level text and synthetic batches.

``ByteTextDataset`` reads the Python standard library's own ``.py`` sources (present
wherever Python is) as one byte stream; the vocabulary is the 256 byte values.
Every batch is a pure function of ``(step, seed)``, so all ranks of a pipeline
draw the same batch without communicating. Same Python version => same data.

``synthetic_batch`` makes inputs plus targets that follow a fixed, learnable rule
(a random "teacher"), so a loss curve on synthetic data can actually go down.

``TokenWindows`` draws the same kind of batches from the user's own files: a text
file's bytes (``load_text_bytes``) or a flat array of token ids (``load_token_file``:
``.npy``, or nanoGPT's raw uint16 ``.bin``), memory-mapped and validated on load.
"""
from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from models import stable_seed
from models.registry import ModelBundle
from planner.errors import InvalidInputError

Split = Literal["train", "val"]
VAL_EVERY = 10          # every 10th file (sorted order) is validation: both splits span the library
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_TEACHER_SEED = 1234    # the teacher is fixed forever, independent of the batch seed


def stdlib_sources(max_bytes: int | None = None) -> tuple[Path, ...]:
    """The standard library's ``.py`` files in a stable order: a sorted top-down walk
    (top-level modules first), installed packages and caches excluded. Stops once
    the files listed hold ``max_bytes``, so the common case never lists the whole tree."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise InvalidInputError("Python standard library folder", expected="an existing directory",
                                found=str(root), fix="run with a full Python installation")
    files: list[Path] = []
    total = 0
    for folder, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)  # walk order = sorted order
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = Path(folder, name)
                files.append(path)
                total += path.stat().st_size
                if max_bytes is not None and total >= max_bytes:
                    return tuple(files)
    return tuple(files)


@functools.lru_cache(maxsize=4)
def _corpus(max_bytes: int) -> tuple[bytes, bytes]:
    """(train, val) bytes; every ``VAL_EVERY``-th file is validation. Cached per process."""
    parts: tuple[list[bytes], list[bytes]] = ([], [])
    total = 0
    for i, path in enumerate(stdlib_sources(max_bytes)):
        text = path.read_bytes()[: max_bytes - total]
        total += len(text)
        parts[i % VAL_EVERY == VAL_EVERY - 1].append(text)
        if total >= max_bytes:
            break
    return b"".join(parts[0]), b"".join(parts[1])


class ByteTextDataset:
    """Bytes of the stdlib sources (up to ``max_bytes`` in total), split by file into train/val."""

    vocab_size = 256

    def __init__(self, seq_len: int, split: Split = "train", max_bytes: int = 4_000_000) -> None:
        if seq_len < 1:
            raise InvalidInputError("seq_len", expected=">= 1", found=str(seq_len))
        if split not in ("train", "val"):
            raise InvalidInputError("split", expected="'train' or 'val'", found=repr(split))
        self.seq_len, self.split = seq_len, split
        self.data = self._read(split, max_bytes)
        if self.data.numel() < seq_len + 2:
            raise InvalidInputError(f"{split} text ({self.data.numel()} bytes)",
                                    expected=f"more than seq_len + 1 = {seq_len + 1} bytes",
                                    fix="raise max_bytes or lower seq_len")

    @staticmethod
    def _read(split: Split, max_bytes: int) -> torch.Tensor:
        if max_bytes < 1:
            raise InvalidInputError("max_bytes", expected=">= 1", found=str(max_bytes))
        text = _corpus(max_bytes)[split == "val"]
        # A read-only view of the cached bytes would warn; one copy per dataset is cheap.
        return torch.frombuffer(bytearray(text), dtype=torch.uint8) if text else torch.empty(0, dtype=torch.uint8)

    @property
    def num_bytes(self) -> int:
        return int(self.data.numel())

    def fingerprint(self) -> str:
        """SHA-256 of the bytes: ranks (or machines) can check they train on the same text."""
        return hashlib.sha256(self.data.numpy().tobytes()).hexdigest()

    def batch(self, step: int, batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``(idx, targets)``, both ``LongTensor[batch, seq_len]``; ``targets`` is ``idx`` shifted by one."""
        if batch < 1 or step < 0:
            raise InvalidInputError("batch/step", expected="batch >= 1 and step >= 0", found=f"{batch}/{step}")
        gen = torch.Generator().manual_seed(stable_seed(seed, step, self.split))
        starts = torch.randint(0, self.num_bytes - self.seq_len - 1, (batch, 1), generator=gen)
        window = self.data[starts + torch.arange(self.seq_len + 1)].long()
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def synthetic_batch(bundle: ModelBundle, step: int, batch: int, seed: int = 0
                    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """``(inputs, targets)`` shaped like ``bundle.example_inputs`` (batch dim replaced), on CPU.

    Language models: token sequences following ``x[t+1] = (a * x[t] + c) mod V`` from
    random starts, targets the next token. Classifiers: float inputs with a random
    per-sample offset per channel (features for MLPs), labelled by a fixed random
    linear teacher on those offsets; integer inputs are labelled by their first token.
    """
    if batch < 1 or step < 0:
        raise InvalidInputError("batch/step", expected="batch >= 1 and step >= 0", found=f"{batch}/{step}")
    gen = torch.Generator().manual_seed(stable_seed(seed, step, "synthetic"))
    shapes = [(batch, *t.shape[1:]) for t in bundle.example_inputs]
    if bundle.family == "lm":
        return _lm_batch(bundle, shapes, gen)
    return _classifier_batch(bundle, shapes, gen)


def _lm_batch(bundle: ModelBundle, shapes: list[tuple[int, ...]], gen: torch.Generator
              ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    vocab = bundle.vocab_or_classes
    first = shapes[0]
    if len(first) != 2 or bundle.example_inputs[0].dtype.is_floating_point:
        raise InvalidInputError(f"synthetic data for {bundle.name!r}", expected="an LM taking LongTensor[B, T]",
                                found=f"{bundle.example_inputs[0].dtype} {tuple(first)}")
    b, t = first
    # An odd multiplier keeps the rule a permutation of the vocabulary when V is even.
    mult, inc = 5, 3
    x = torch.empty(b, t + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, vocab, (b,), generator=gen)
    for i in range(t):
        x[:, i + 1] = (mult * x[:, i] + inc) % vocab
    extra = tuple(_random_like(bundle.example_inputs[k], shapes[k], gen, vocab) for k in range(1, len(shapes)))
    return (x[:, :-1].contiguous(), *extra), x[:, 1:].contiguous()


def _classifier_batch(bundle: ModelBundle, shapes: list[tuple[int, ...]], gen: torch.Generator
                      ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    first, classes = bundle.example_inputs[0], bundle.vocab_or_classes
    extra = tuple(_random_like(bundle.example_inputs[k], shapes[k], gen, classes) for k in range(1, len(shapes)))
    if not first.dtype.is_floating_point:
        tokens = torch.randint(0, classes, shapes[0], generator=gen, dtype=first.dtype)
        return (tokens, *extra), tokens.reshape(shapes[0][0], -1)[:, 0].long() % classes
    b, channels = shapes[0][0], shapes[0][1]
    offsets = torch.randn(b, channels, generator=gen)
    noise = torch.randn(shapes[0], generator=gen)
    # Offsets broadcast over spatial dims (CNN); for [B, d] inputs the offsets *are* the signal.
    x = noise * 0.5 + offsets.reshape(b, channels, *([1] * (len(shapes[0]) - 2)))
    teacher = torch.randn(channels, classes, generator=torch.Generator().manual_seed(_TEACHER_SEED))
    labels = (offsets @ teacher).argmax(dim=1)
    return (x.to(first.dtype), *extra), labels


def _random_like(example: torch.Tensor, shape: tuple[int, ...], gen: torch.Generator, high: int) -> torch.Tensor:
    if example.dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(example.dtype)
    return torch.randint(0, max(high, 1), shape, generator=gen, dtype=example.dtype)


def make_batch(bundle: ModelBundle, batch: int, seed: int = 0, *, step: int = 0
               ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Synthetic ``(inputs, targets)`` with a learnable rule; see :func:`synthetic_batch`."""
    return synthetic_batch(bundle, step, batch, seed)


# --------------------------------------------------------------------------- the user's own files
TOKEN_FILE_SUFFIXES = (".npy", ".bin")


def _describe_file(path: Path, what: str) -> int:
    """The size of ``path`` in bytes, or one clear error if it is missing, not a file or empty."""
    if not path.exists():
        raise InvalidInputError(f"{what} {str(path)!r} does not exist", fix="check the path")
    if not path.is_file():
        raise InvalidInputError(f"{what} {str(path)!r}", expected="a file", found="a folder or special file")
    size = path.stat().st_size
    if size == 0:
        raise InvalidInputError(f"{what} {str(path)!r} is empty", expected="at least one sequence of tokens")
    return size


def load_text_bytes(path: str | os.PathLike) -> np.ndarray:
    """A text file as its bytes (the token ids of a byte-level model), memory-mapped: never read whole."""
    target = Path(path)
    _describe_file(target, "--data text file")
    return np.memmap(target, dtype=np.uint8, mode="r")


def load_token_file(path: str | os.PathLike) -> np.ndarray:
    """A flat array of token ids: ``.npy`` (any integer dtype, 1-D; ``numpy.load`` without pickle) or
    nanoGPT's ``.bin`` (raw little-endian uint16). Memory-mapped, so a corpus larger than memory works."""
    target = Path(path)
    size = _describe_file(target, "--data tokens file")
    if target.suffix == ".bin":
        if size % 2:
            raise InvalidInputError(f"--data tokens file {str(target)!r} ({size} bytes)",
                                    expected="raw uint16 token ids: an even number of bytes",
                                    found="an odd byte count", fix="check that the file is a nanoGPT-style .bin")
        return np.memmap(target, dtype="<u2", mode="r")
    if target.suffix != ".npy":
        raise InvalidInputError(f"--data tokens file {str(target)!r}", expected="a .npy or .bin file",
                                found=f"suffix {target.suffix!r}" if target.suffix else "no suffix")
    try:
        tokens = np.load(target, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:  # not .npy, truncated, or object dtype (needs pickle)
        raise InvalidInputError(f"--data tokens file {str(target)!r}", expected="a .npy array saved by numpy.save",
                                found=str(exc).splitlines()[0][:160]) from None
    if not isinstance(tokens, np.ndarray) or tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        found = f"{tokens.dtype} array of shape {tokens.shape}" if isinstance(tokens, np.ndarray) else "an archive"
        raise InvalidInputError(f"--data tokens file {str(target)!r}", expected="a flat (1-D) integer array",
                                found=found, fix="save it with numpy.save(path, ids.reshape(-1).astype(np.int64))")
    return tokens


@functools.lru_cache(maxsize=8)
def _id_range(path: str, size: int, mtime_ns: int) -> tuple[int, int]:
    """(smallest, largest) token id in ``path``; cached per file version (checked by launcher and ranks)."""
    tokens = load_token_file(path)
    lo, hi = 0, 0
    step = 1 << 24  # bounded chunks: a big corpus is scanned without a full-size temporary
    for start in range(0, tokens.shape[0], step):
        chunk = tokens[start:start + step]
        lo, hi = min(lo, int(chunk.min())), max(hi, int(chunk.max()))
    return lo, hi


def check_token_ids(path: str | os.PathLike, vocab: int) -> None:
    """Every id of the token file in ``[0, vocab)``, else one clear error naming the largest."""
    stat = Path(path).stat()
    lo, hi = _id_range(os.fspath(path), stat.st_size, stat.st_mtime_ns)
    if lo < 0 or hi >= vocab:
        raise InvalidInputError(f"--data tokens file {os.fspath(path)!r}", expected=f"token ids in [0, {vocab}) "
                                "(the model's vocabulary)", found=f"ids from {lo} to {hi}",
                                fix="tokenise with the model's tokenizer, or use a model with a larger vocabulary")


class TokenWindows:
    """Random windows of ``seq_len + 1`` tokens from one flat token array; targets are the inputs shifted
    by one. Like :class:`ByteTextDataset`, each batch is a pure function of ``(step, seed)``."""

    def __init__(self, tokens: np.ndarray, seq_len: int, *, name: str) -> None:
        if seq_len < 1:
            raise InvalidInputError("seq_len", expected=">= 1", found=str(seq_len))
        if tokens.shape[0] < seq_len + 1:
            raise InvalidInputError(f"--data {name} ({tokens.shape[0]} tokens)",
                                    expected=f"at least one sequence + 1 = {seq_len + 1} tokens",
                                    fix="use a longer file or a plan with a shorter --seq")
        self.tokens, self.seq_len, self.name = tokens, seq_len, name

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def batch(self, step: int, batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``(idx, targets)``, both ``LongTensor[batch, seq_len]``; only the windows drawn are read."""
        if batch < 1 or step < 0:
            raise InvalidInputError("batch/step", expected="batch >= 1 and step >= 0", found=f"{batch}/{step}")
        gen = torch.Generator().manual_seed(stable_seed(seed, step, "token-file"))
        starts = torch.randint(0, self.num_tokens - self.seq_len, (batch, 1), generator=gen).numpy()
        window = torch.from_numpy(np.asarray(self.tokens[starts + np.arange(self.seq_len + 1)], dtype=np.int64))
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()
