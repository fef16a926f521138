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
(the scale may change as the step ends). An input gradient whose taint header said the replica computed it on
zeros (its input or gradient was dropped) is not compared (the upstream rank drops it: nothing of it trains),
and the replica's contribution is then not judged that step (what it summed is not known exactly).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from planner.runtime.rank import audit_inputs
from planner.runtime.wire import control


def _unscaled(ex: Any, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` as a verifier scores a gradient: fp16's loss scale out (a copy), else references."""
    scaler = getattr(ex, "scaler", None)
    if scaler is None:
        return [t.detach() for t in tensors]
    return [t.detach().float() / scaler.scale for t in tensors]


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


def keep_sent_grad(ex: Any, mb: int) -> None:
    """On a trusted rank of the stage after one audited from copies, as ``mb``'s gradient leaves for the replica:
    keep what the replica receives where the auditor's schedule audits it (sent at the step's end)."""
    if getattr(ex, "stage", None) is None:
        return
    k = ex.info.stage - 1
    schedule = _shared(ex, k)
    if schedule is not None and ex.rank in ex.audits.stages[k].grads_from and _scheduled(ex, k, mb, schedule):
        ex.audits.grad_outbox[(k, mb)] = _unscaled(ex, ex._delivered("B", mb))


def keep_received_grad(ex: Any, mb: int, tensors: Sequence[torch.Tensor]) -> None:
    """On a trusted rank of the stage before one audited from copies with gradients, as ``mb``'s input gradient
    comes in from the replica (decoded, before any drop): kept with its taint header where audited."""
    if getattr(ex, "stage", None) is None:
        return
    k = ex.info.stage + 1
    schedule = _shared(ex, k)
    if schedule is not None and ex.rank in ex.audits.stages[k].copied_from and _scheduled(ex, k, mb, schedule):
        tainted = bool(getattr(ex, "taint_in", {}).get(("B", mb), False))
        ex.audits.gin_outbox[(k, mb)] = (_unscaled(ex, tensors), tainted)


def grad_specs(copy: Any) -> list[Any]:
    """The gradients a replica is sent: one per output carrying a gradient, in order."""
    return [spec for spec in copy.runtime.outputs if spec.carries_grad]


def input_grad_specs(copy: Any) -> list[Any]:
    """The gradients a replica sends upstream: one per input carrying a gradient, in order."""
    return [spec for spec in copy.runtime.inputs if spec.carries_grad]


def send_grads(ex: Any, st: Any, step: int) -> None:
    """A downstream rank's kept gradients of this step's audited microbatches, one flat float32 message to the
    auditor (nothing where it sent none of them)."""
    audits = ex.audits
    mbs = audit_inputs.copied_mbs(ex.plan, audits.sharing[st.stage], st, ex.rank, step,
                                  audit_inputs.agreed_suspects(ex))
    if not mbs or ex.rank == st.auditor:
        return
    tensors = [t for mb in mbs for t in audits.grad_outbox[(st.stage, mb)]]
    flat = torch.cat([t.reshape(-1).float() for t in tensors]) if tensors else torch.zeros(0, device=ex.device)
    control.gather_to(flat, dst=st.auditor, me=ex.rank, ranks=[ex.rank, st.auditor], topic=control.Topic.AUDIT_INPUT,
                      device=ex.device, index=2 * st.stage + 1,
                      doing=f"copying the gradients sent to stage {st.stage} to its auditor rank {st.auditor} "
                            f"(step {step})")


def hear_grads(ex: Any, st: Any, step: int) -> None:
    """The auditor: each downstream rank's copies of the gradients it sent, into the step's kept ones (where the
    replica's output is kept). Received into buffers of the stage's output shapes; nothing else is read."""
    audits = ex.audits
    specs = grad_specs(audits.copies[st.stage])
    per_mb = sum(math.prod(spec.shape) for spec in specs)
    for sender in st.grads_from:
        mbs = audit_inputs.copied_mbs(ex.plan, audits.schedules[st.stage], st, sender, step,
                                      audit_inputs.agreed_suspects(ex))
        if not mbs:
            continue
        if sender == ex.rank:
            got = {mb: audits.grad_outbox[(st.stage, mb)] for mb in mbs}
        else:
            flat = control.gather_to(torch.zeros(len(mbs) * per_mb, device=ex.device), dst=ex.rank, me=ex.rank,
                                     ranks=[sender, ex.rank], topic=control.Topic.AUDIT_INPUT, device=ex.device,
                                     index=2 * st.stage + 1,
                                     doing=f"hearing the gradients sent to stage {st.stage} from rank {sender} "
                                           f"(step {step})")[sender]
            got = dict(zip(mbs, split(flat, specs, len(mbs))))
        for mb, tensors in got.items():
            if (st.stage, "y", mb) in audits.kept:
                audits.kept[(st.stage, "g", mb)] = [t.float() for t in tensors]


def split(flat: torch.Tensor, specs: Sequence[Any], count: int) -> list[list[torch.Tensor]]:
    """``count`` microbatches' float tensors of the ``specs``' shapes, in order, from one flat message."""
    out, offset = [], 0
    for _ in range(count):
        one = []
        for spec in specs:
            n = math.prod(spec.shape)
            one.append(flat[offset:offset + n].view(spec.shape).float())
            offset += n
        out.append(one)
    return out
