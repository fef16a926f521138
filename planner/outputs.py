"""Output files: checked writable before long work starts, written atomically, never half-written.

``check_writable`` runs before a solve, a profile or a run, so a bad ``-o`` costs nothing.
``atomic_file`` writes a hidden sibling, fsyncs it and renames it over the target (same
folder: same filesystem), so a crash leaves the old file or the new one, never a mix; a
read-only target is refused rather than silently replaced.
"""
from __future__ import annotations

import os
import stat
import sys
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from planner.errors import InvalidInputError

_WRITE_BITS = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH  # none set: read-only, even for root


def check_writable(path: str | os.PathLike, *, what: str) -> Path:
    """``path`` if a file can be written there (missing folders are created later), else one clear error."""
    target = Path(path)
    if target.is_dir():
        raise InvalidInputError(f"{what} {os.fspath(path)!r} is a folder", expected="a file path",
                                fix="name a file inside it")
    if target.exists() and (not os.access(target, os.W_OK) or not target.stat().st_mode & _WRITE_BITS):
        raise InvalidInputError(f"{what} {os.fspath(path)!r} is read-only", expected="a writable file",
                                fix="choose another path, or make the file writable if it may be replaced")
    folder = target.parent
    while not folder.exists():  # the nearest existing folder must let us create the rest
        folder = folder.parent
    if not folder.is_dir() or not _can_create_in(folder):
        raise InvalidInputError(f"{what} {os.fspath(path)!r} cannot be written", expected="a writable folder",
                                found=f"{folder} is not writable", fix="choose another path")
    return target


def _can_create_in(folder: Path) -> bool:
    """Whether a file can be created in ``folder``, by creating one: ``os.access`` tells root yes for /proc
    and for read-only mounts."""
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".stagewise-probe-")
    except OSError:
        return False
    os.close(fd)
    os.unlink(name)
    return True


def temp_path_for(target: Path) -> Path:
    """A unique hidden sibling of ``target`` (same folder: the rename is atomic)."""
    return target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


@contextmanager
def atomic_file(path: str | os.PathLike, *, binary: bool = False) -> Iterator[IO]:
    """A file handle whose content replaces ``path`` only when the block ends without an error."""
    target = check_writable(path, what="output file")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path_for(target)
    try:
        with open(tmp, "xb" if binary else "x", **({} if binary else {"encoding": "utf-8"})) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def write_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` atomically; returns the path."""
    with atomic_file(path) as fh:
        fh.write(text)
    return Path(path)


PIPED_COLUMNS = 200  # rich's width when stdout is no terminal (its fallback, 80, cuts tables mid-row)
_QUIET_LIBRARIES = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
                    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}


def plain_output(stdout: IO[str] | None = None, environ: dict[str, str] | None = None) -> bool:
    """When ``stdout`` is no terminal (a pipe, a file, a CI log): wide tables and no third-party progress bars
    or advice, through the environment the libraries read (children inherit it); a user's own setting wins.
    Returns whether it applied."""
    stream = sys.stdout if stdout is None else stdout
    env = os.environ if environ is None else environ
    try:
        if stream.isatty():
            return False
    except (AttributeError, ValueError):  # a closed or replaced stream: no terminal either
        pass
    env.setdefault("COLUMNS", str(PIPED_COLUMNS))
    for key, value in _QUIET_LIBRARIES.items():
        env.setdefault(key, value)
    return True
