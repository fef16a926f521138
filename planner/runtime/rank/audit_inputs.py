"""Audits from copied inputs (``planner.runtime.rank.audits``): where an untrusted stage's auditor does not verify
its input boundary, the trusted ranks of the stage before copy it the audited microbatches' inputs.

The auditor draws a key per stage and sends it, point to point, to those ranks alone (``share_key``): they then
know which microbatches the auditor's schedule audits (``scheduled``), and the replica does not. As each such
microbatch's output leaves for its consumer, an upstream rank keeps what the consumer receives
(``keep_input_copy``); at the step's end it sends them in one float message (``send_inputs``), which the auditor
receives into buffers of the stage's input shapes (``hear_inputs``, ``unflatten``).

A sender under suspicion is audited on every microbatch from copies too: the step's verdict, which every rank
hears alike, names the senders it left unresolved and those the step's flags or alerts named or whose contribution
is suspect (``agreed_suspects``), so the upstream ranks copy what the auditor audits.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any

import torch

from planner.integrity import audit
from planner.runtime.wire import control

KEY_BYTES = 16   # an auditor's per-stage schedule key (``audit.AuditSchedule`` wants at least 16 bytes)


def stage_key(secret: bytes, stage: int) -> bytes:
    """The auditor's key for one stage: what it shares with that stage's upstream ranks tells them nothing of
    the other stages it audits."""
    return hashlib.blake2b(secret + stage.to_bytes(4, "big"), digest_size=KEY_BYTES).digest()


def share_key(st: Any, rank: int, key: bytes | None, device: torch.device) -> bytes:
    """The stage's key on its auditor and, sent point to point by the auditor alone, on the upstream ranks that
    copy it inputs and the downstream ones that copy it gradients (``grads_from``; it never reaches a replica);
    ``key`` on the auditor, None elsewhere."""
    sharing = {*st.copied_from, *getattr(st, "grads_from", ())}
    if not st.copied_from or (rank != st.auditor and rank not in sharing):
        return key or b""
    words = None if key is None else torch.tensor(
        [int.from_bytes(key[i:i + 8], "big", signed=True) for i in range(0, KEY_BYTES, 8)], dtype=torch.int64)
    got = control.send_from(None if words is None else words.to(device), src=st.auditor, me=rank,
                            ranks=sorted({st.auditor, *sharing}), topic=control.Topic.AUDIT_INPUT,
                            shape=(KEY_BYTES // 8,), dtype=torch.int64, device=device, index=2 * st.stage,
                            doing=f"sharing stage {st.stage}'s audit key with its upstream ranks")
    return b"".join(int(w).to_bytes(8, "big", signed=True) for w in got.cpu().tolist())


def scheduled(plan: Any, schedule: audit.AuditSchedule, stage: int, mb: int, step: int, *,
               suspected: bool = False) -> bool:
    """Whether ``schedule`` audits ``mb`` of ``stage`` this step (its replica's slot among its microbatches)."""
    owner = plan.owner(stage, mb)
    mine = list(plan.ranks[owner].microbatches)
    return schedule.audited(owner, step, mine.index(mb), len(mine), suspected=suspected)


def agreed_suspects(ex: Any) -> frozenset[int]:
    """The senders every rank audits on every microbatch this step: those the verdict of the step before left
    unresolved (``ex.unresolved``) or named suspects (``ex.suspects``: its flags or alerts named them, or their
    contribution is suspect), sent to every rank alike. Read once a step and kept: the sender's copies and the
    auditor's receives must name the same microbatches (else one waits for a message the other never sends), and
    the verdict changes at the step's end (``_end_verification``), after them, never between."""
    audits = ex.audits
    if audits.agreed_step != ex.step:
        audits.agreed = frozenset(getattr(ex, "unresolved", None) or ()) | frozenset(getattr(ex, "suspects", ()))
        audits.agreed_step = ex.step
    return audits.agreed


def keep_input_copy(ex: Any, mb: int) -> None:
    """On a trusted rank of the stage before one audited from copies, as ``mb``'s output leaves for its
    consumer: keep what the consumer receives where the auditor's schedule audits it (sent at the step's end)."""
    audits = getattr(ex, "audits", None)
    if audits is None or ex.stage is None:
        return
    k = ex.info.stage + 1
    schedule = audits.sharing.get(k)
    if schedule is not None and scheduled(ex.plan, schedule, k, mb, ex.step,
                                          suspected=ex.plan.owner(k, mb) in agreed_suspects(ex)):
        # a reference, not a copy: the send of an audited microbatch must take no longer than another's
        audits.outbox[(k, mb)] = [t.detach() for t in ex._delivered("F", mb)]


def unscaled(tensors: Sequence[torch.Tensor], scale: float | None) -> list[torch.Tensor]:
    """Kept gradients as a verifier scores them (fp16's loss ``scale``, the one in force when kept, out), at the
    step's end: a copy and a division before the gradient left would make an audited microbatch's send slower."""
    return [t.float() if scale is None else t.float() / scale for t in tensors]


def copied_mbs(plan: Any, schedule: audit.AuditSchedule, st: Any, sender: int, step: int,
               suspects: frozenset[int] = frozenset()) -> list[int]:
    """The audited microbatches whose inputs upstream rank ``sender`` copies to the auditor this step (every one
    whose replica is among ``suspects``, ``agreed_suspects``)."""
    return [mb for mb in sorted(plan.ranks[sender].microbatches)
            if scheduled(plan, schedule, st.stage, mb, step, suspected=plan.owner(st.stage, mb) in suspects)]


def copy_dtype(integer: bool) -> torch.dtype:
    return torch.float64 if integer else torch.float32   # float64 holds any index exactly, float32 any wire float


def send_inputs(ex: Any, st: Any, step: int) -> None:
    """An upstream rank's copies of this step's audited inputs, one flat message to the auditor; where gradients
    are audited from copies (``grads_from``), each microbatch's input followed by the input gradient its replica
    sent back and whether that came tainted (``message_parts``)."""
    audits = ex.audits
    mbs = copied_mbs(ex.plan, audits.sharing[st.stage], st, ex.rank, step, agreed_suspects(ex))
    if not mbs or ex.rank == st.auditor:
        return
    tensors = [t for mb in mbs for t in message_parts(ex, st, mb)]
    dtype = copy_dtype(any(not t.is_floating_point() for t in tensors))
    flat = torch.cat([t.reshape(-1).to(device=ex.device, dtype=dtype) for t in tensors])
    control.gather_to(flat, dst=st.auditor, me=ex.rank, ranks=[ex.rank, st.auditor], topic=control.Topic.AUDIT_INPUT,
                      device=ex.device, index=2 * st.stage + 1,
                      doing=f"copying stage {st.stage}'s audited inputs to its auditor rank {st.auditor} (step {step})")


def hear_inputs(ex: Any, st: Any, step: int) -> None:
    """The auditor: each upstream rank's copies, into the step's kept inputs (zeros where the replica says it
    computed on zeros). Received into buffers of the stage's input shapes; nothing else is read."""
    audits = ex.audits
    copy = audits.copies[st.stage]
    inputs = copy.runtime.inputs
    specs = [*inputs, *_gradient_specs(copy, st)]
    per_mb = sum(math.prod(spec.shape) for spec in specs)
    dtype = copy_dtype(any(not spec.dtype.is_floating_point for spec in inputs))
    for sender in st.copied_from:
        mbs = copied_mbs(ex.plan, audits.schedules[st.stage], st, sender, step, agreed_suspects(ex))
        if not mbs:
            continue
        if sender == ex.rank:
            got = {mb: message_parts(ex, st, mb) for mb in mbs}
        else:
            flat = control.gather_to(torch.zeros(len(mbs) * per_mb, dtype=dtype, device=ex.device), dst=ex.rank,
                                     me=ex.rank, ranks=[sender, ex.rank], topic=control.Topic.AUDIT_INPUT,
                                     device=ex.device, index=2 * st.stage + 1,
                                     doing=f"hearing stage {st.stage}'s audited inputs from rank {sender} "
                                           f"(step {step})")[sender]
            got = dict(zip(mbs, unflatten(flat, specs, len(mbs))))
        for mb, parts in got.items():
            if (st.stage, "y", mb) not in audits.kept:
                continue
            tensors, grads = parts[:len(inputs)], parts[len(inputs):]
            zero = (st.stage, mb) in audits.tainted
            audits.kept[(st.stage, "x", mb)] = [torch.zeros_like(t) if zero else t for t in tensors]
            if grads:   # compared whatever the replica's header says; a header with no cause fails (``audit_grads``)
                audits.kept[(st.stage, "gin", mb)] = [t.float() for t in grads[:-1]]
                if bool(grads[-1].reshape(-1)[0] != 0):
                    audits.gin_tainted.add((st.stage, mb))


def message_parts(ex: Any, st: Any, mb: int) -> list[torch.Tensor]:
    """``mb``'s part of an upstream rank's copies: its input and, where gradients come copied too, the input
    gradient its replica sent back (unscaled here, at the step's end) and a flag, 1 where it came tainted; where
    none came, zeros of its shapes, flagged (made here, not as the input left: no audited send is slower)."""
    audits = ex.audits
    tensors = list(audits.outbox[(st.stage, mb)])
    if not getattr(st, "grads_from", ()):
        return tensors
    device = tensors[0].device if tensors else None
    came = audits.gin_outbox.get((st.stage, mb))
    if came is None:
        carrying = [t for t, spec in zip(tensors, ex.stage.outputs) if spec.carries_grad]
        grads, tainted = [torch.zeros(t.shape, device=t.device) for t in carrying], True
    else:
        grads, tainted = unscaled(came[0], came[2]), came[1]
    return [*tensors, *grads, torch.full((1,), float(tainted), device=device)]


class _Flag:
    """The one-value spec of an upstream copy's taint flag (``message_parts``)."""

    shape = (1,)
    dtype = torch.float32


def _gradient_specs(copy: Any, st: Any) -> list[Any]:
    """The input gradients' specs in an upstream copy and its flag (none where gradients are not copied)."""
    if not getattr(st, "grads_from", ()):
        return []
    return [*(spec for spec in copy.runtime.inputs if spec.carries_grad), _Flag()]


def unflatten(flat: torch.Tensor, specs: Sequence[Any], count: int) -> list[list[torch.Tensor]]:
    """``count`` microbatches' inputs from one flat message, each of the stage's input shapes and dtypes."""
    out, offset = [], 0
    for _ in range(count):
        one = []
        for spec in specs:
            n = math.prod(spec.shape)
            t = flat[offset:offset + n].view(spec.shape)
            one.append(t.float() if spec.dtype.is_floating_point else t.to(spec.dtype))
            offset += n
        out.append(one)
    return out
