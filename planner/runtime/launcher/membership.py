"""Before a run trains, every rank proves it was invited and holds the same signed plan.

The plan file's signature (HMAC-SHA256 with the run secret over its canonical content,
``planner.secret``) is checked on every rank before anything of the plan runs, on the bytes the
plan is parsed from (the file is read once: :func:`load_signed_plan`). Then, on the
fresh process group, rank 0 draws a nonce and every rank answers with
``HMAC(secret, nonce | rank | plan hash)``, point to point; rank 0 checks every answer and proves
itself to every rank, so a rank that does not hold the secret (an outsider who reached the
rendezvous) or holds another plan stops the run, named, before any tensor of the model is exchanged.
"""
from __future__ import annotations

import hmac
import json
import os
import secrets

import torch
import torch.distributed as dist

from planner import secret as run_secret
from planner.errors import InvalidInputError, RankFailureError
from planner.plan import Plan
from planner.plan_load import OperatorTrust, plan_from_text, plan_source, read_plan_text
from planner.runtime.wire import control

NONCE_BYTES = 32


def load_signed_plan(path: str | os.PathLike, key: bytes, *,
                     operator: OperatorTrust | None = None) -> tuple[Plan, str]:
    """The plan in ``path`` and its hash, from one read of the file: the signature is checked on the very
    bytes the plan is parsed from, so a file swapped between two reads cannot slip a plan past the check.
    ``operator``: a run's (:func:`operator_trust`), whose cluster and policy the plan's trust is checked against."""
    text = read_plan_text(path)
    plan = plan_from_text(text, source=plan_source(path), operator=operator)  # reads better than a bad MAC
    return plan, _checked_digest(text, key, source=plan_source(path))


def operator_trust(opts) -> OperatorTrust:
    """The operator's word on trust for a run with options ``opts`` (``--cluster``, ``--no-verify``)."""
    return OperatorTrust(cluster=opts.cluster, verify=opts.verify)


def check_signature(path: str | os.PathLike, key: bytes) -> str:
    """The plan's hash, once its file's signature is checked against ``key`` (for callers that use no
    more of the file; one that parses the plan too uses :func:`load_signed_plan`)."""
    return _checked_digest(read_plan_text(path), key, source=plan_source(path))


def _checked_digest(text: str, key: bytes, *, source: str) -> str:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidInputError(f"{source} is not valid JSON (truncated or corrupted?)",
                                found=f"{exc.msg} at line {exc.lineno} column {exc.colno}",
                                fix="re-create it with `stagewise plan`") from None
    if not isinstance(data, dict):
        raise InvalidInputError(source, expected="a JSON object", found=type(data).__name__,
                                fix="re-create it with `stagewise plan`")
    signature = data.pop("signature", None)
    if signature is None:
        raise InvalidInputError(f"{source} is not signed", expected="a plan signed with the run secret",
                                fix="re-create it with `stagewise plan` (or Plan.save) on a host holding the secret")
    if not hmac.compare_digest(str(signature).encode("utf-8"), run_secret.sign(key, data).encode("utf-8")):
        raise InvalidInputError(f"{source} does not match its signature", expected="the plan as signed",
                                found="a file edited after signing, or signed with another secret",
                                fix="use the plan file as `stagewise plan` wrote it, with the same secret")
    return run_secret.digest(data)


def prove_membership(key: bytes, plan_digest: str, *, rank: int, world_size: int) -> None:
    """Every rank proves it holds ``key`` and the plan whose hash is ``plan_digest``; raises naming the
    ranks that do not (on every rank alike). Point to point with rank 0, which checks every answer and
    proves itself to each rank: a collective would let a rank alter the others' answers on their way."""
    ranks = list(range(world_size))
    device = _device()
    doing = f"proving membership (ranks {ranks})"
    nonce = None
    if rank == 0:
        nonce = torch.frombuffer(bytearray(secrets.token_bytes(NONCE_BYTES)), dtype=torch.uint8).to(device)
    nonce = control.send_from(nonce, src=0, me=rank, ranks=ranks, topic=control.Topic.MEMBERSHIP,
                              shape=(NONCE_BYTES,), dtype=torch.uint8, device=device, doing=doing)
    raw = bytes(nonce.cpu().numpy())
    mine = torch.frombuffer(bytearray(run_secret.proof(key, raw, rank, plan_digest)), dtype=torch.uint8).to(device)
    answers = control.gather_to(mine, dst=0, me=rank, ranks=ranks, topic=control.Topic.MEMBERSHIP, device=device,
                                doing=doing, index=1)
    finding = None
    if answers is not None:
        finding = torch.tensor([int(not hmac.compare_digest(bytes(got.cpu().numpy()),
                                                             run_secret.proof(key, raw, r, plan_digest)))
                                for r, got in answers.items()], dtype=torch.int64, device=device)
    finding = control.send_from(finding, src=0, me=rank, ranks=ranks, topic=control.Topic.MEMBERSHIP,
                                shape=(world_size,), dtype=torch.int64, device=device, doing=doing, index=2)
    bad = [r for r, wrong in zip(ranks, finding.tolist()) if wrong]
    if rank != 0:
        zero = control.send_from(None, src=0, me=rank, ranks=ranks, topic=control.Topic.MEMBERSHIP,
                                 shape=tuple(mine.shape), dtype=torch.uint8, device=device, doing=doing, index=3)
        if not hmac.compare_digest(bytes(zero.cpu().numpy()), run_secret.proof(key, raw, 0, plan_digest)):
            bad = sorted({0, *bad})
    else:
        control.send_from(mine, src=0, me=rank, ranks=ranks, topic=control.Topic.MEMBERSHIP,
                          shape=tuple(mine.shape), dtype=torch.uint8, device=device, doing=doing, index=3)
    if bad:
        raise RankFailureError(f"ranks {bad} did not prove they hold the run secret and this plan",
                               expected="every rank started with the same secret and plan file",
                               found=f"{len(bad)} of {world_size} answers wrong",
                               fix="start those ranks with the run's --secret-file and the same plan, or "
                                   "check who else reached the rendezvous")


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
