"""Control messages with one author: a trusted rank decides, and every rank hears it from that rank alone.

A collective lets every member alter what the others get: an all-reduce sums whatever each rank adds
(one untrusted rank could ban a trusted one, or cancel its own ban, by adding to the vote), and gloo's
and NCCL's all-gather and broadcast forward other ranks' data through intermediate ranks. So a verdict
(bans, unresolved flags, what trained), a fp16 overflow decision, a checkpoint's completion and a stop
travel point to point: every rank sends its evidence to the deciding rank (:func:`gather_to`), which
checks each value against what the sender may say (a value out of range is a :class:`ProtocolError`
naming the sender), decides, and sends the decision to each rank (:func:`send_from`). A rank posts
receives for control messages from the deciding rank only, so what another rank sends in its name is
never read.

The deciding rank is :data:`CONTROL_RANK` (rank 0, which runs the first stage on a trusted device) for
the run's own decisions, and the lowest verifier rank for verdicts; :func:`check_authorities` refuses a
verified plan where either is untrusted.
"""
from __future__ import annotations

import enum
import json
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from planner.errors import InvalidInputError, ProtocolError
from planner.runtime.wire import comm, messages

if TYPE_CHECKING:
    from planner.plan import Plan

CONTROL_RANK = 0  # decides for the run (fp16 overflow, the clipping norm, checkpoints, the resume step, the result)


class Topic(enum.IntEnum):
    """Which control message (the boundary field of its tag, under ``Kind.CONTROL``)."""

    VERDICTS = 0     # the lead verifier's bans, unresolved flags and trained count of a step
    TRAINED = 1      # a first-stage rank's count of microbatches that trained this step
    OVERFLOW = 2     # a rank's fp16 overflow vote, and the control rank's decision
    CHECKPOINT = 3   # the sha256 of a rank's checkpoint file; then the control rank's stop decision
    SUMMARY = 4      # a rank's final summary (JSON), to the control rank
    RESUME = 5       # the checkpoint step every rank resumes from
    MEMBERSHIP = 6   # rank 0's nonce, each rank's proof of the run secret, rank 0's finding
    CLIP = 7         # a rank's squared gradient norm, and the control rank's total (--clip-grad)
    CONTRIB = 8      # a replica's sketch of its gradient contribution, to the lead verifier (one index a stage)
    AUDIT = 9        # a replica's digest of its applied gradient (index 2k), the gradient whole (2k + 1), to its auditor
    AUDIT_INPUT = 10  # an auditor's key to stage k's upstream ranks (index 2k); their copies of audited inputs (2k + 1)
    SIGNED = 11      # stage k's signed audits: keys to the auditor (4k), relayed (4k + 1), its asks (4k + 2), inputs (4k + 3)


def trusted_ranks(plan: Plan) -> frozenset[int]:
    """The ranks on trusted devices (by the plan's cluster, which the load checks against the operator's)."""
    cluster = plan.effective_cluster()
    return frozenset(r.rank for r in plan.ranks if cluster.device(r.device).trusted)


def check_authorities(plan: Plan, *, verifying: bool) -> None:
    """A verified run's deciding ranks must be trusted: the control rank and every verifier rank."""
    if not verifying:
        return
    trusted = trusted_ranks(plan)
    deciders = {CONTROL_RANK, *(v.rank for v in plan.verifiers)}
    bad = sorted(deciders - trusted)
    if bad:
        raise InvalidInputError(f"plan ranks {bad}", expected="the control rank (0) and the verifier ranks on "
                                "trusted devices", found=", ".join(f"rank {r} on {plan.ranks[r].device}" for r in bad),
                                fix="re-plan with the trust policy on (trusted endpoints, trusted verifiers)")


def _tag_args(topic: Topic, index: int = 0) -> dict[str, Any]:
    return {"kind": comm.Kind.CONTROL, "boundary": int(topic), "mb": index}


def send_from(value: torch.Tensor | None, *, src: int, me: int, ranks: Sequence[int], topic: Topic,
              shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, doing: str,
              index: int = 0) -> torch.Tensor:
    """``src``'s ``value`` on every rank of ``ranks``: sent point to point by ``src``, received from
    ``src`` alone (``index``: which message of the topic)."""
    if me == src:
        assert value is not None and tuple(value.shape) == shape
        sends = [comm.send([value], peer=r, doing=doing, **_tag_args(topic, index)) for r in ranks if r != src]
        for pending in sends:
            pending.wait()
        return value
    return comm.recv([(shape, dtype)], peer=src, device=device, doing=doing, **_tag_args(topic, index)).wait()[0]


def gather_to(value: torch.Tensor, *, dst: int, me: int, ranks: Sequence[int], topic: Topic,
              device: torch.device, doing: str, index: int = 0) -> dict[int, torch.Tensor] | None:
    """Every rank's ``value`` (one shape and dtype on all) at ``dst``, by sender; None elsewhere."""
    if me != dst:
        comm.send([value], peer=dst, doing=doing, **_tag_args(topic, index)).wait()
        return None
    posted = {r: comm.recv([(tuple(value.shape), value.dtype)], peer=r, device=device, doing=doing,
                           **_tag_args(topic, index)) for r in ranks if r != dst}
    got = {r: p.wait()[0] for r, p in posted.items()}
    got[dst] = value
    return dict(sorted(got.items()))


def checked_ints(got: Mapping[int, torch.Tensor], *, what: str, allowed: Callable[[int, int], bool],
                 expected: str) -> dict[int, int]:
    """One integer per sender, each checked by ``allowed(sender, value)``; a sender whose value is not
    allowed broke the protocol and is named."""
    out = {}
    for sender, t in got.items():
        value = int(t.reshape(-1)[0].item())
        if not allowed(sender, value):
            raise ProtocolError(f"rank {sender} sent an impossible {what}", sender=sender, expected=expected,
                                found=str(value), fix=f"check rank {sender}'s host: it does not run this runtime")
        out[sender] = value
    return out


def json_to(obj: Any, *, dst: int, me: int, ranks: Sequence[int], what: str, schema: Mapping[str, Any],
            device: torch.device, doing: str) -> list[Any] | None:
    """Every rank's JSON ``obj`` at ``dst`` (checked against ``schema``, by rank order); None elsewhere."""
    data = json.dumps(obj, separators=(",", ":")).encode("utf-8")
    if me != dst:
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        body = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data else \
            torch.zeros(0, dtype=torch.uint8, device=device)
        comm.send([size], peer=dst, doing=doing, **_tag_args(Topic.SUMMARY, 0)).wait()
        comm.send([body], peer=dst, doing=doing, **_tag_args(Topic.SUMMARY, 1)).wait()
        return None
    out: list[Any] = []
    for sender in ranks:
        if sender == me:
            out.append(json.loads(data))
            continue
        size = comm.recv([((1,), torch.int64)], peer=sender, device=device, doing=doing,
                         **_tag_args(Topic.SUMMARY, 0)).wait()[0]
        n = int(size.item())
        if not 0 <= n <= messages.MAX_MESSAGE_BYTES:
            raise ProtocolError(f"rank {sender} sent a malformed {what}", sender=sender,
                                expected=f"at most {messages.MAX_MESSAGE_BYTES} bytes", found=f"{n} bytes announced")
        body = comm.recv([((n,), torch.uint8)], peer=sender, device=device, doing=doing,
                         **_tag_args(Topic.SUMMARY, 1)).wait()[0]
        out.append(messages.decode(bytes(body.cpu().numpy()), sender=sender, what=what, schema=schema))
    return out
