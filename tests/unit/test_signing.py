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


def test_forwarded_inputs_travel_as_their_bytes_so_an_honest_replicas_signature_always_holds() -> None:
    from planner.runtime.rank import audit_signed

    odd_nan = torch.tensor([0x7FC1, -1, 0x3F80], dtype=torch.int16).view(torch.bfloat16)   # NaNs of other bits
    big = torch.tensor([2 ** 53 + 1, -(2 ** 62) - 3], dtype=torch.int64)                      # past a float64's
    fine = torch.tensor([1.0 + 2 ** -40, -3.5], dtype=torch.float64)                           # past a float32's
    payload = [odd_nan.reshape(3, 1), big, fine, torch.arange(5, dtype=torch.float16)]
    specs = [(tuple(t.shape), t.dtype) for t in payload]
    flat = audit_signed.pack(payload)
    assert flat.dtype == torch.uint8 and flat.numel() == audit_signed.packed_bytes(specs)
    back = audit_signed.unpack(flat, specs)
    for a, b in zip(payload, back):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    signer = signing.Signer()
    sig = signer.sign(payload, step=1, mb=0, boundary=2)
    assert signing.verify(signer.public_words(), sig, back, step=1, mb=0, boundary=2)


def test_a_complaint_voids_an_audit_only_where_the_replica_dropped_that_input() -> None:
    from planner.runtime.rank import audit_signed

    signer = signing.Signer()
    state = audit_signed.SignedState(keys={4: signer.public_words()})
    payload = _payload()
    sig = signer.sign(payload, step=7, mb=2, boundary=0)
    bad = signer.sign(payload, step=6, mb=2, boundary=0)

    def judged(verified: int, signature: torch.Tensor, *, dropped: bool, tensors=payload) -> str:
        meta = torch.cat([torch.tensor([verified]), signature])
        return audit_signed.judge(state, 4, meta, tensors, step=7, mb=2, boundary=0, dropped=dropped)

    assert judged(1, sig, dropped=False) == "ok"
    assert judged(1, bad, dropped=False) == "forged"                         # another input than it was sent
    assert judged(1, sig, dropped=False, tensors=[payload[0] * 2, payload[1]]) == "forged"
    assert judged(0, bad, dropped=True) == "voided"                          # a complaint, the input dropped
    assert judged(0, bad, dropped=False) == "forged"                         # a complaint, yet the input trained
    assert judged(0, sig, dropped=True) == "forged"                          # a complaint of a good signature
