"""Gradients audited from copies (``planner.runtime.rank.audits``, issue 37): where a stage is audited from copied
inputs (``audit_inputs``) and the stage after it is trusted too, its ranks (``AuditedStage.grads_from``), which
send the replicas their gradients, keep the gradients they send the audited microbatches (``keep_sent_grad``) and
send them to the auditor at the step's end in one float message each (``send_grads``, ``hear_grads``); the
trusted upstream ranks, which copy the inputs, keep the input gradient each audited replica sent them back as
they received it (``keep_received_grad``) and add it to their copies (``audit_inputs.send_inputs``). The auditor
then recomputes forward and backward from the copies and compares output and input gradient, as where it holds
them itself (``audit_recompute``), and, the lead verifier, the contribution of a replica whose every microbatch
was audited (``audit_contrib``).

The key: the auditor shares its stage key point to point with the downstream ranks as with the upstream ones
(``audit_inputs.share_key``), so they know the schedule, and the replica never does. Every copy is as the
consumer computes on it (decoded); fp16 gradients are kept without the loss scale, as a verifier scores them
(the scale may change as the step ends; kept as references with the scale in force, unscaled at the step's end).
Each gradient copy carries whether it went tainted (the replica drops it: recomputed on zeros). An input gradient
is compared whatever the replica's taint header says, as where the auditor holds it: the header is the replica's
word, and skipping on it would let one mark a gradient a step and never have its contribution judged. A header
set with no cause the auditor sees (``resolve``) is a failed audit.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from planner.runtime.rank import audit_inputs, audit_recompute
from planner.runtime.wire import control


def scale_of(ex: Any) -> float | None:
    """The loss scale in force as a gradient is kept (None: no fp16 scaling); it may change as the step ends."""
    scaler = getattr(ex, "scaler", None)
    return None if scaler is None else float(scaler.scale)


def _shared(ex: Any, k: int) -> Any:
    """``stage k``'s shared schedule where this rank copies its auditor gradients (None: it does not)."""
    audits = getattr(ex, "audits", None)
    st = None if audits is None else audits.stages.get(k)
    if st is None or not st.grads_from:
        return None
    return audits.sharing.get(k)


def _scheduled(ex: Any, k: int, mb: int, schedule: Any) -> bool:
    suspected = ex.plan.owner(k, mb) in audit_inputs.agreed_suspects(ex)
    return audit_inputs.scheduled(ex.plan, schedule, k, mb, ex.step, suspected=suspected)


def keep_sent_grad(ex: Any, mb: int, *, tainted: bool = False) -> None:
    """On a trusted rank of the stage after one audited from copies, as ``mb``'s gradient leaves for the replica:
    keep what the replica receives where the auditor's schedule audits it (sent at the step's end), a reference,
    with whether it goes tainted (its taint header: the replica drops it) and the loss scale."""
    if getattr(ex, "stage", None) is None:
        return
    k = ex.info.stage - 1
    schedule = _shared(ex, k)
    if schedule is not None and ex.rank in ex.audits.stages[k].grads_from and _scheduled(ex, k, mb, schedule):
        ex.audits.grad_outbox[(k, mb)] = ([t.detach() for t in ex._delivered("B", mb)], tainted, scale_of(ex))


def keep_received_grad(ex: Any, mb: int, tensors: Sequence[torch.Tensor]) -> None:
    """On a trusted rank of the stage before one audited from copies with gradients, as ``mb``'s input gradient
    comes in from the replica (decoded, before any drop): kept with its taint header where audited."""
    if getattr(ex, "stage", None) is None:
        return
    k = ex.info.stage + 1
    schedule = _shared(ex, k)
    if schedule is not None and ex.rank in ex.audits.stages[k].copied_from and _scheduled(ex, k, mb, schedule):
        tainted = bool(getattr(ex, "taint_in", {}).get(("B", mb), False))
        ex.audits.gin_outbox[(k, mb)] = ([t.detach() for t in tensors], tainted, scale_of(ex))


class _Flag:
    """The one-value spec of a copy's taint flag."""

    shape = (1,)
    dtype = torch.float32


_FLAG = _Flag()
FORGED = audit_recompute.FORGED


def grad_specs(copy: Any) -> list[Any]:
    """The gradients a replica is sent: one per output carrying a gradient, in order."""
    return [spec for spec in copy.runtime.outputs if spec.carries_grad]


def input_grad_specs(copy: Any) -> list[Any]:
    """The gradients a replica sends upstream: one per input carrying a gradient, in order."""
    return [spec for spec in copy.runtime.inputs if spec.carries_grad]


def grad_parts(audits: Any, st: Any, mb: int) -> list[torch.Tensor]:
    """``mb``'s part of a downstream rank's copy: the gradient it sent the replica (unscaled) and a flag, 1 where it
    went tainted (the replica drops it: the auditor recomputes on zeros, ``resolve``)."""
    tensors, tainted, scale = audits.grad_outbox[(st.stage, mb)]
    device = tensors[0].device if tensors else None
    return [*audit_inputs.unscaled(tensors, scale), torch.full((1,), float(tainted), device=device)]


def send_grads(ex: Any, st: Any, step: int) -> None:
    """A downstream rank's kept gradients of this step's audited microbatches, each with its taint flag, one flat
    float32 message to the auditor (nothing where it sent none of them)."""
    audits = ex.audits
    mbs = audit_inputs.copied_mbs(ex.plan, audits.sharing[st.stage], st, ex.rank, step,
                                  audit_inputs.agreed_suspects(ex))
    if not mbs or ex.rank == st.auditor:
        return
    tensors = [t for mb in mbs for t in grad_parts(audits, st, mb)]
    flat = torch.cat([t.reshape(-1).to(device=ex.device, dtype=torch.float32) for t in tensors])
    control.gather_to(flat, dst=st.auditor, me=ex.rank, ranks=[ex.rank, st.auditor], topic=control.Topic.AUDIT_INPUT,
                      device=ex.device, index=2 * st.stage + 1,
                      doing=f"copying the gradients sent to stage {st.stage} to its auditor rank {st.auditor} "
                            f"(step {step})")


def hear_grads(ex: Any, st: Any, step: int) -> None:
    """The auditor: each downstream rank's copies of the gradients it sent, into the step's kept ones (where the
    replica's output is kept), zeros where it went tainted (``resolve``). Received into buffers of the stage's
    output shapes and a flag each; nothing else is read."""
    audits = ex.audits
    specs = [*grad_specs(audits.copies[st.stage]), _FLAG]
    per_mb = sum(math.prod(spec.shape) for spec in specs)
    for sender in st.grads_from:
        mbs = audit_inputs.copied_mbs(ex.plan, audits.schedules[st.stage], st, sender, step,
                                      audit_inputs.agreed_suspects(ex))
        if not mbs:
            continue
        if sender == ex.rank:
            got = {mb: grad_parts(audits, st, mb) for mb in mbs}
        else:
            flat = control.gather_to(torch.zeros(len(mbs) * per_mb, device=ex.device), dst=ex.rank, me=ex.rank,
                                     ranks=[sender, ex.rank], topic=control.Topic.AUDIT_INPUT, device=ex.device,
                                     index=2 * st.stage + 1,
                                     doing=f"hearing the gradients sent to stage {st.stage} from rank {sender} "
                                           f"(step {step})")[sender]
            got = dict(zip(mbs, audit_inputs.unflatten(flat, specs, len(mbs))))   # all float
        for mb, parts in got.items():
            if (st.stage, "y", mb) not in audits.kept:
                continue
            tensors, tainted = parts[:-1], bool(parts[-1].reshape(-1)[0] != 0)
            audits.kept[(st.stage, "g", mb)] = [torch.zeros_like(t) if tainted else t.float() for t in tensors]
            if tainted:
                audits.g_tainted.add((st.stage, mb))
    resolve(audits, st)


def resolve(audits: Any, st: Any) -> None:
    """The auditor, with both copies in: judge each input gradient the replica marked tainted (``gin_tainted``),
    compared whatever its header says (as where the auditor holds it, ``audit_verdicts.observe``). An honest replica marks
    it exactly where its input or gradient was dropped, and then sends zeros: its input dropped marks its output
    tainted, which the trusted stage after drops, so the gradient it sent went tainted (``g_tainted``: recomputed
    on zeros); its gradient dropped by the stage after, the same; by a verifier's verdict this auditor may not
    see, zeros with no other sign (recomputed on a zero gradient, as the replica did). A marked one that is not
    zeros with neither sign is a drop the replica made up: a failed audit of it (``FORGED``), never of an
    honest replica."""
    for k, mb in sorted(audits.gin_tainted):
        if k == st.stage:
            judge_marked(audits.kept, k, mb, caused=(k, mb) in audits.g_tainted)


def judge_marked(kept: dict[tuple[int, str, int], Any], k: int, mb: int, *, caused: bool,
                 held: bool = False) -> None:
    """Stage ``k``'s microbatch ``mb``, whose input gradient its replica marked tainted: nothing where the auditor
    saw a cause (``caused``: its input or the gradient it was sent dropped, or its output marked so), else a made-up
    drop where it is not zeros (``FORGED``: a failed audit), a drop by a verdict the auditor may not see where it is
    (recomputed on a zero gradient, as the replica did). From copies (``resolve``) or held (``audit_verdicts.observe``,
    ``held``: the auditor is the verifier whose verdicts reach the replica, so it sees every cause, and marked
    zeros with none are made up too)."""
    gin = kept.get((k, "gin", mb))
    if caused or gin is None or (k, "g", mb) not in kept:
        return
    if held or any(bool(t.any()) for t in gin):
        kept[(k, FORGED, mb)] = []
    else:
        kept[(k, "g", mb)] = [torch.zeros_like(t) for t in kept[(k, "g", mb)]]


def overflow_skipped(ex: Any) -> bool:
    """Whether the fp16 overflow vote skipped this step (after it, at the step's end; once a step): an honest
    replica's input gradient may then hold infinities its copy's recompute does not (an overflow inside the
    stage's backward), so no input gradient of the step is compared (``drop_input_grads``) and nothing it
    trained is judged (the step applied nothing). The scaler's skip count against the one seen last; on the
    first step, a scale just reset (``good_steps`` 0 after a vote: an overflow, or a growth, where leaving the
    comparisons out costs one step's)."""
    scaler = getattr(ex, "scaler", None)
    if scaler is None:
        return False
    audits, now = ex.audits, int(scaler.skipped)
    seen, audits.skipped_seen = audits.skipped_seen, now
    return now > seen if seen is not None else (now > 0 and int(scaler.good_steps) == 0)


def drop_input_grads(kept: dict[tuple[int, str, int], Any], stage: int) -> None:
    """``stage``'s kept input gradients (and made-up drops) out of this step's audits: outputs only."""
    for key in [key for key in kept if key[0] == stage and key[1] in ("gin", FORGED)]:
        del kept[key]

