"""The run secret: a shared key that signs plans and lets ranks prove they were invited.

Where it comes from, first found: ``--secret-file``, the ``STAGEWISE_SECRET`` environment
variable, or this user's local secret (``$XDG_CONFIG_HOME/stagewise/secret``, else
``~/.config/stagewise/secret``), created on first use and readable by its owner only, so
that ``stagewise plan`` and ``stagewise run`` on one machine need no flag. A multi-host run
copies one secret file to every invited host (``--secret-file``) or sets the variable there.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path
from typing import Any, Mapping

from planner.errors import InvalidInputError

ENV_VAR = "STAGEWISE_SECRET"
MIN_BYTES = 16


def local_secret_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "stagewise" / "secret"


def run_secret(secret_file: str | os.PathLike | None = None) -> bytes:
    """The secret of this run (see the module docstring)."""
    if secret_file is not None:
        return _read(Path(secret_file), what="--secret-file")
    if os.environ.get(ENV_VAR):
        return _checked(os.environ[ENV_VAR].encode(), what=ENV_VAR)
    path = local_secret_path()
    if not path.exists():
        _create(path)
    if path.stat().st_mode & 0o077:
        raise InvalidInputError(f"the local secret {path}", expected="a file only its owner can read",
                                found=oct(path.stat().st_mode & 0o777), fix=f"chmod 600 {path}")
    return _read(path, what="the local secret")


def _create(path: Path) -> None:
    """Write a new secret owner-only, whole or not at all (two first uses at once agree on one)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # owner-only from the first byte
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets.token_hex(32) + "\n")
    try:
        os.link(tmp, path)  # fails if another process made it first: then theirs is the secret
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)


def _read(path: Path, *, what: str) -> bytes:
    try:
        return _checked(path.read_bytes().strip(), what=f"{what} {path}")
    except OSError as exc:
        raise InvalidInputError(f"{what} {path} cannot be read", expected="a readable secret file",
                                found=str(exc), fix="check the path and its permissions") from None


def _checked(value: bytes, *, what: str) -> bytes:
    if len(value) < MIN_BYTES:
        raise InvalidInputError(what, expected=f"a secret of at least {MIN_BYTES} bytes",
                                found=f"{len(value)} bytes", fix="e.g. python -c 'import secrets; "
                                "print(secrets.token_hex(32))' > secret")
    return value


def canonical(content: Mapping[str, Any]) -> bytes:
    """The bytes a signature covers: sorted keys, no spaces (the same on every host)."""
    return json.dumps(content, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def sign(secret: bytes, content: Mapping[str, Any]) -> str:
    return hmac.new(secret, canonical(content), hashlib.sha256).hexdigest()


def digest(content: Mapping[str, Any]) -> str:
    """A plan's hash, which every rank must agree on."""
    return hashlib.sha256(canonical(content)).hexdigest()


def proof(secret: bytes, nonce: bytes, rank: int, plan_digest: str) -> bytes:
    """What rank ``rank`` sends to prove it holds the secret and the same plan, for this run's nonce."""
    return hmac.new(secret, nonce + rank.to_bytes(4, "big") + plan_digest.encode(), hashlib.sha256).digest()
