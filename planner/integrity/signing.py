"""Signed transfers: what lets an auditor believe an untrusted stage's input when an untrusted stage sent it.

An auditor recomputes a replica's microbatch from the input the replica received. Where that input came from
another untrusted stage, neither can be taken at its word: the sender could hand the auditor another copy than
the replica (and frame it), the replica could claim another input than it was sent. So the sender signs every
activation it sends the audited stage (Ed25519, over SHA-256 of the payload's bytes and where it belongs: step,
microbatch, boundary) with a key of its own; the replica checks the signature as it takes the input and keeps
both; asked for an input, it forwards it with the signature, which only the sender could have made and which
binds that exact tensor. A forwarded input that its signature does not cover was not what the sender sent: the
replica lies. The public keys reach the replicas through the (trusted) auditor, so a sender cannot show the
replica one key and the auditor another.

Keys and signatures travel as int64 words (``words``/``unwords``): nothing received is unpickled or executed.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

SIG_BYTES = 64   # an Ed25519 signature
KEY_BYTES = 32   # an Ed25519 public key
SIG_WORDS = SIG_BYTES // 8
KEY_WORDS = KEY_BYTES // 8


def payload_digest(tensors: Sequence[torch.Tensor], *, step: int, mb: int, boundary: int) -> bytes:
    """SHA-256 of where the payload belongs and of each tensor's dtype, shape and bytes."""
    h = hashlib.sha256(f"stagewise-signed:{step}:{mb}:{boundary}:{len(tensors)}".encode())
    for t in tensors:
        flat = t.detach().contiguous().reshape(-1).cpu()
        h.update(f"{flat.dtype}:{tuple(t.shape)}".encode())
        h.update(memoryview(flat.view(torch.uint8).numpy()))   # hashed in place, no copy of the bytes
    return h.digest()


def words(raw: bytes) -> torch.Tensor:
    """Bytes (a multiple of 8) as int64 words, to travel as a tensor."""
    return torch.tensor([int.from_bytes(raw[i:i + 8], "big", signed=True) for i in range(0, len(raw), 8)],
                        dtype=torch.int64)


def unwords(t: torch.Tensor) -> bytes:
    """The bytes of ``words``."""
    return b"".join(int(w).to_bytes(8, "big", signed=True) for w in t.reshape(-1).cpu().tolist())


class Signer:
    """A sender's key, fresh each run: it signs what it sends, its public key goes to the auditor."""

    def __init__(self) -> None:
        self._key = Ed25519PrivateKey.generate()

    def public_words(self) -> torch.Tensor:
        return words(self._key.public_key().public_bytes_raw())

    def sign(self, tensors: Sequence[torch.Tensor], *, step: int, mb: int, boundary: int) -> torch.Tensor:
        """The signature of a payload, as ``SIG_WORDS`` int64 words."""
        return words(self._key.sign(payload_digest(tensors, step=step, mb=mb, boundary=boundary)))


def verify(public: torch.Tensor, signature: torch.Tensor, tensors: Sequence[torch.Tensor], *, step: int, mb: int,
           boundary: int) -> bool:
    """Whether ``signature`` (words) is the holder of ``public``'s (words) over this payload."""
    try:
        key = Ed25519PublicKey.from_public_bytes(unwords(public))
        key.verify(unwords(signature), payload_digest(tensors, step=step, mb=mb, boundary=boundary))
    except (InvalidSignature, ValueError):
        return False
    return True
