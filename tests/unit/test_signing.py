"""Signed transfers (``planner.integrity.signing``): a signature covers its payload and place, nothing else."""
from __future__ import annotations

import torch

from planner.integrity import signing


def _payload(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, 4, generator=g), torch.randn(5, generator=g).to(torch.bfloat16)]


def test_a_signature_verifies_its_payload_and_place() -> None:
    signer = signing.Signer()
    payload = _payload()
    sig = signer.sign(payload, step=3, mb=1, boundary=0)
    assert sig.shape == (signing.SIG_WORDS,) and sig.dtype == torch.int64
    assert signing.verify(signer.public_words(), sig, payload, step=3, mb=1, boundary=0)
    # bfloat16 travels as float32 to the auditor and back, exactly
    back = [t.float().to(t.dtype) for t in payload]
    assert signing.verify(signer.public_words(), sig, back, step=3, mb=1, boundary=0)


def test_a_signature_covers_nothing_else() -> None:
    signer, other = signing.Signer(), signing.Signer()
    payload = _payload()
    sig = signer.sign(payload, step=3, mb=1, boundary=0)
    moved = [payload[0].clone(), payload[1]]
    moved[0][0, 0, 0] += 1e-6
    public = signer.public_words()
    assert not signing.verify(public, sig, moved, step=3, mb=1, boundary=0)          # another tensor
    assert not signing.verify(public, sig, payload, step=4, mb=1, boundary=0)        # another step
    assert not signing.verify(public, sig, payload, step=3, mb=2, boundary=0)        # another microbatch
    assert not signing.verify(public, sig, payload, step=3, mb=1, boundary=1)        # another boundary
    assert not signing.verify(other.public_words(), sig, payload, step=3, mb=1, boundary=0)   # another key
    assert not signing.verify(public, torch.zeros(signing.SIG_WORDS, dtype=torch.int64), payload,
                              step=3, mb=1, boundary=0)
    assert not signing.verify(public, sig, [payload[0].double(), payload[1]], step=3, mb=1, boundary=0)  # dtype


def test_words_round_trip() -> None:
    raw = bytes(range(64))
    assert signing.unwords(signing.words(raw)) == raw
