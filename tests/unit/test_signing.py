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


def test_a_replica_drops_an_input_its_sender_did_not_sign_and_keeps_it_for_the_auditor() -> None:
    from types import SimpleNamespace

    from planner.runtime.rank import audit_signed

    signer = signing.Signer()
    state = audit_signed.SignedState(takes=0, keys={4: signer.public_words()})
    ex = SimpleNamespace(audits=SimpleNamespace(signed=state), step=7,
                         plan=SimpleNamespace(owner=lambda stage, mb: 4))
    payload = _payload()
    good = torch.cat([torch.zeros(1, dtype=torch.int64), signer.sign(payload, step=7, mb=2, boundary=0)])
    assert not audit_signed.take(ex, 2, 0, payload, good) and state.inbox[2][2]
    bad = torch.cat([torch.zeros(1, dtype=torch.int64), signer.sign(payload, step=6, mb=2, boundary=0)])
    assert audit_signed.take(ex, 3, 0, payload, bad) and not state.inbox[3][2]   # a complaint, forwarded as such
    # another boundary, or a plain one-word header, is not this replica's signed input
    assert not audit_signed.take(ex, 4, 1, payload, good) and 4 not in state.inbox
    assert not audit_signed.take(ex, 5, 0, payload, torch.zeros(1, dtype=torch.int64)) and 5 not in state.inbox
