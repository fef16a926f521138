"""Audits from signed inputs (``planner.integrity.signing``): a stage fed by an untrusted stage, audited on the
inputs its replicas forward, each under the signature of the upstream rank that sent it.

Setup (``setup``, every rank, stage by stage): each rank of the stage before generates a key and sends its public
half to the auditor, which relays them all to the stage's replicas (a sender cannot show the replica one key and
the auditor another). During the step the upstream ranks sign each activation they send the stage
(``signature``, in the taint header after its one word), and each replica checks the signature as it takes the
input and keeps input and signature until the step's end (``take``): a failed check is its complaint, kept too,
and it drops that input (computes on zeros, its output marked dropped), so nothing unsigned trains.
At the step's end the auditor asks each replica for its audited microbatches (``hear``: a 0/1 word per microbatch
of the replica's, sent once the replica's outputs have all left, so the schedule stays secret) and the replica
forwards those inputs, one float message, with their signatures and complaints (``forward``). The auditor
checks each signature against the upstream rank's key: an input its signature does not cover is a lie of the
replica's (it checked the signature on receipt), an audit failed at once; a complaint voids that audit where the
replica dropped that input (one of the two lies, nothing tells which, and nothing of it trained), else it fails
it (``judge``); the rest are audited as inputs copied from a trusted stage are (outputs only). Inputs travel as
their raw bytes (``pack``), so the check is exact for every dtype. Nothing received is unpickled or executed:
keys, requests and signatures are int64 tensors and the inputs uint8 tensors, of sizes the plan fixes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from planner.integrity import audit, signing
from planner.runtime.rank import audit_inputs
from planner.runtime.wire import comm, control

META_WORDS = 1 + signing.SIG_WORDS   # per forwarded input: verified on receipt (1) or a complaint (0), its signature


@dataclass(slots=True)
class SignedState:
    """One rank's part in the signed audits: its key where it signs, the keys where it checks, a replica's inbox."""

    signer: signing.Signer | None = None
    signs: frozenset[int] = frozenset()      # boundaries whose sends to their consumer this rank signs
    takes: int | None = None                 # the boundary whose inputs this rank checks, as a replica
    keys: dict[int, torch.Tensor] = field(default_factory=dict)   # upstream rank -> its public key (words)
    inbox: dict[int, tuple[list[torch.Tensor], torch.Tensor, bool]] = field(default_factory=dict)


def _tag(st: Any, j: int) -> dict[str, Any]:
    return control._tag_args(control.Topic.SIGNED, 4 * st.stage + j)


def setup(stages: dict[int, Any], rank: int, device: torch.device) -> SignedState:
    """Keys for every stage audited from signed inputs (``AuditedStage.signed_by``), on every rank in stage order."""
    out = SignedState()
    for k, st in sorted(stages.items()):
        if not st.signed_by:
            continue
        if rank in st.signed_by:
            out.signer = out.signer or signing.Signer()
            out.signs = out.signs | {k - 1}
        if rank in st.replicas:
            out.takes = k - 1
        if rank in (*st.signed_by, st.auditor):
            value = out.signer.public_words() if out.signer is not None and rank in st.signed_by else \
                torch.zeros(signing.KEY_WORDS, dtype=torch.int64)
            got = control.gather_to(value.to(device), dst=st.auditor, me=rank, ranks=sorted({*st.signed_by, st.auditor}),
                                    topic=control.Topic.SIGNED, device=device, index=4 * st.stage,
                                    doing=f"sending stage {k - 1}'s public keys to stage {k}'s auditor")
            if got is not None:
                out.keys.update({r: got[r].cpu() for r in st.signed_by})
        if rank in (st.auditor, *st.replicas):
            table = torch.stack([out.keys[r] for r in st.signed_by]).to(device) if rank == st.auditor else None
            got = control.send_from(table, src=st.auditor, me=rank, ranks=sorted({st.auditor, *st.replicas}),
                                    topic=control.Topic.SIGNED, shape=(len(st.signed_by), signing.KEY_WORDS),
                                    dtype=torch.int64, device=device, index=4 * st.stage + 1,
                                    doing=f"relaying stage {k - 1}'s public keys to stage {k}'s replicas")
            out.keys.update({r: got[i].cpu() for i, r in enumerate(st.signed_by)})
    return out


def _state(ex: Any) -> SignedState | None:
    audits = getattr(ex, "audits", None)
    return None if audits is None else audits.signed


def signature(ex: Any, boundary: int, mb: int, payloads: list[torch.Tensor]) -> torch.Tensor | None:
    """On an upstream rank sending ``mb``'s activations to its consumer: their signature (None: unsigned)."""
    state = _state(ex)
    if state is None or state.signer is None or boundary not in state.signs:
        return None
    return state.signer.sign(payloads, step=ex.step, mb=mb, boundary=boundary)


def header_numel(ex: Any, d: str, boundary: int) -> int:
    """The taint header's length on a consumer's receive: one word, then a signature where it is signed."""
    state = _state(ex)
    return 1 + signing.SIG_WORDS if state is not None and d == "F" and state.takes == boundary else 1


def take(ex: Any, mb: int, boundary: int, payloads: list[torch.Tensor], header: torch.Tensor) -> bool:
    """On a replica taking ``mb``'s input: check its signature and keep both (in host memory) until the step's
    end. True where the input is signed and its signature fails: the replica then drops it (computes on zeros, its
    output marked dropped), so what its upstream did not sign trains nothing."""
    state = _state(ex)
    if state is None or state.takes != boundary or header.numel() < 1 + signing.SIG_WORDS:
        return False
    sig = header[1:].cpu()
    host = [t.detach().cpu() for t in payloads]
    key = state.keys.get(ex.plan.owner(boundary, mb))
    ok = key is not None and signing.verify(key, sig, host, step=ex.step, mb=mb, boundary=boundary)
    state.inbox[mb] = (host, sig, ok)
    return not ok


def pack(payloads: list[torch.Tensor]) -> torch.Tensor:
    """Payloads as their raw bytes (uint8): the auditor checks the signature over exactly the bytes sent (a
    conversion would change a NaN's bits, an int64 past 2^53, a float64, and frame an honest replica)."""
    return torch.cat([t.detach().contiguous().reshape(-1).cpu().view(torch.uint8) for t in payloads])


def unpack(flat: torch.Tensor, specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """``pack``'s payloads back, in the wire shapes and dtypes ``specs``."""
    out, offset = [], 0
    for shape, dtype in specs:
        n = math.prod(shape) * _itemsize(dtype)
        out.append(flat[offset:offset + n].clone().view(dtype).view(shape))   # cloned: aligned for the view
        offset += n
    return out


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def packed_bytes(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> int:
    """The bytes of one microbatch's ``pack``."""
    return sum(math.prod(shape) * _itemsize(dtype) for shape, dtype in specs)


def forward(ex: Any, st: Any, step: int) -> None:
    """A replica, at the step's end: hear which of its microbatches the auditor audits, forward their inputs."""
    state = _state(ex)
    assert state is not None
    mine = sorted(ex.plan.ranks[ex.rank].microbatches)
    inbox, state.inbox = state.inbox, {}
    asked = comm.recv([((len(mine),), torch.int64)], peer=st.auditor, device=ex.device, **_tag(st, 2),
                      doing=f"hearing which inputs stage {st.stage}'s auditor asks for (step {step})").wait()[0]
    mbs = [mb for mb, want in zip(mine, asked.cpu().tolist()) if want == 1]
    if not mbs:
        return
    specs = ex._wire_specs("F", st.stage - 1)
    values, meta = [], []
    for mb in mbs:
        payloads, sig, ok = inbox.get(mb, ([torch.zeros(s, dtype=dt) for s, dt in specs],
                                           torch.zeros(signing.SIG_WORDS, dtype=torch.int64), False))
        attacks = getattr(ex, "attacks", None)
        if attacks is not None and attacks.active:   # a forging replica (``--attack ...,dir=inputs``)
            payloads = attacks.forge_inputs(payloads, step=step, mb=mb)
        values.append(pack(payloads))
        meta.append(torch.cat([torch.tensor([int(ok)], dtype=torch.int64), sig.to(torch.int64)]))
    comm.send([torch.cat(values).to(ex.device), torch.stack(meta).to(ex.device)], peer=st.auditor, **_tag(st, 3),
              doing=f"forwarding stage {st.stage}'s audited inputs to its auditor rank {st.auditor} "
                    f"(step {step})").wait()


def hear(ex: Any, st: Any, step: int) -> None:
    """The auditor, at the step's end: ask each replica for its audited inputs, check their signatures, keep the
    ones they cover as the inputs to audit (zeros where the replica says it computed on zeros)."""
    audits = ex.audits
    auditing = st.stage in audits.auditing(ex.rank)   # else (suspended, drifting) it asks for nothing
    events, voided = [], 0
    for replica in st.replicas:
        # the senders ``_audited`` kept every output of: the same set, so each asked-for input has its output
        mbs = audit_inputs.copied_mbs(ex.plan, audits.schedules[st.stage], st, replica, step,
                                      audit_inputs.agreed_suspects(ex)) if auditing else []
        for mb, payloads, meta in _ask(ex, st, replica, mbs, step):
            judged = judge(audits.signed, ex.plan.owner(st.stage - 1, mb), meta, payloads, step=step, mb=mb,
                           boundary=st.stage - 1, dropped=(st.stage, mb) in audits.tainted)
            if judged == "forged":
                events.append(audit.audit_event(step=step, mb=mb, boundary=st.stage, direction="act", sender=replica,
                                                error=math.inf, tolerance=0.0))
            elif judged == "voided":
                voided += 1
            elif (st.stage, "y", mb) in audits.kept:
                zero = (st.stage, mb) in audits.tainted
                audits.kept[(st.stage, "x", mb)] = [torch.zeros_like(t) if zero else t for t in
                                                    _as_inputs(payloads, audits.copies[st.stage].runtime.inputs)]
    _record(ex, step, events, voided)


def _ask(ex: Any, st: Any, replica: int, mbs: list[int], step: int) -> list[tuple[int, list[torch.Tensor], Any]]:
    """Ask ``replica`` for ``mbs`` (a 0/1 word for each of its microbatches) and hear each one's payloads and
    (verified, signature) words."""
    mine = sorted(ex.plan.ranks[replica].microbatches)
    asked = torch.tensor([int(mb in mbs) for mb in mine], dtype=torch.int64, device=ex.device)
    comm.send([asked], peer=replica, **_tag(st, 2),
              doing=f"asking rank {replica} for stage {st.stage}'s audited inputs (step {step})").wait()
    if not mbs:
        return []
    specs = ex._wire_specs("F", st.stage - 1)
    per_mb = packed_bytes(specs)
    flat, meta = comm.recv([((len(mbs) * per_mb,), torch.uint8), ((len(mbs), META_WORDS), torch.int64)],
                           peer=replica, device=ex.device, **_tag(st, 3),
                           doing=f"hearing stage {st.stage}'s audited inputs from rank {replica} (step {step})").wait()
    flat, meta = flat.cpu(), meta.cpu()
    return [(mb, unpack(flat[i * per_mb:(i + 1) * per_mb], specs), meta[i]) for i, mb in enumerate(mbs)]


def _record(ex: Any, step: int, events: list[dict[str, Any]], voided: int) -> None:
    """A step's forgeries (failed audits, among the step's flags) and voided audits, in the verifier's summary."""
    verifier = ex.verify.verifier if ex.verify is not None else None
    if verifier is None:
        return
    verifier.record_signed(forged=len(events), voided=voided)
    for event in events:
        verifier.record_audit(event["sender"], step, passed=False)
    if events:
        verifier.add_flags(step, events)


def judge(state: SignedState, signer: int, meta: torch.Tensor, payloads: list[torch.Tensor], *, step: int,
          mb: int, boundary: int, dropped: bool) -> str:
    """"ok", "voided" or "forged": a forwarded input its signature does not cover; or a complaint (the replica
    says the signature failed on receipt, ``meta[0]`` 0) where the signature holds after all, or where the replica
    did not drop that input (its output, ``dropped``, was not marked so): an honest replica drops what it
    complains of (``take``), so a complaint is a void audit only where nothing of that input trained."""
    key = state.keys.get(signer)
    if key is None:
        return "voided"
    good = signing.verify(key, meta[1:], payloads, step=step, mb=mb, boundary=boundary)
    if int(meta[0]) != 1:
        return "voided" if dropped and not good else "forged"
    return "ok" if good else "forged"


def _as_inputs(payloads: list[torch.Tensor], specs: Any) -> list[torch.Tensor]:
    """The payloads as the audit copy takes its inputs (floats as float32, integers in the stage's dtype)."""
    return [t.float() if spec.dtype.is_floating_point else t.to(spec.dtype) for t, spec in zip(payloads, specs)]
