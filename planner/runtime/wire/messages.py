"""Control messages between ranks as JSON bytes in tensors: nothing a peer sends is unpickled.

A rank's message is UTF-8 JSON, gathered as ``uint8`` tensors after their lengths
(so a length past :data:`MAX_MESSAGE_BYTES` fails on every rank alike, before
anything that large is allocated), then parsed and checked against a JSON schema.
A malformed message is a :class:`planner.errors.ProtocolError` naming its sender (treated as faulty).
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import jsonschema
import torch
import torch.distributed as dist

from planner.errors import ProtocolError
from planner.runtime.wire import comm

MAX_MESSAGE_BYTES = 16 << 20  # a run summary with every verifier event of a long run stays far below


def encode(obj: Any) -> bytes:
    """``obj`` as compact JSON (NaN and infinities kept: a diverged loss is a fact to report)."""
    return json.dumps(obj, separators=(",", ":")).encode("utf-8")


def decode(data: bytes, *, sender: int, what: str, schema: Mapping[str, Any]) -> Any:
    """Parse and check one rank's message; raise naming ``sender`` when it is not what ``schema`` says."""
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise _malformed(sender, what, expected="UTF-8 JSON", found=str(exc)) from None
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(value))
    if error is not None:
        where = "/".join(map(str, error.absolute_path)) or "the message"
        raise _malformed(sender, what, expected=f"{where}: {error.validator} {error.validator_value!r}"[:200],
                         found=repr(error.instance)[:200])
    return value


def _malformed(sender: int, what: str, *, expected: str, found: str) -> ProtocolError:
    return ProtocolError(f"rank {sender} sent a malformed {what}", sender=sender, expected=expected, found=found,
                         fix=f"check rank {sender}'s host: it does not run this runtime")


def all_gather_json(obj: Any, *, group: dist.ProcessGroup | None, ranks: Sequence[int], what: str,
                    schema: Mapping[str, Any], doing: str) -> list[Any]:
    """Every rank's ``obj`` of ``group`` (whose global ranks are ``ranks``), checked against ``schema``."""
    data = encode(obj)
    device = _device(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in ranks]
    _collective(lambda: dist.all_gather(sizes, size, group=group), ranks, doing)
    lengths = [int(s.item()) for s in sizes]
    for sender, n in zip(ranks, lengths):
        if not 0 <= n <= MAX_MESSAGE_BYTES:
            raise _malformed(sender, what, expected=f"at most {MAX_MESSAGE_BYTES} bytes", found=f"{n} bytes announced")
    longest = max(lengths)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    if data:
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    bufs = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in ranks]
    _collective(lambda: dist.all_gather(bufs, mine, group=group), ranks, doing)
    return [decode(bytes(buf[:n].cpu().numpy()), sender=sender, what=what, schema=schema)
            for sender, n, buf in zip(ranks, lengths, bufs)]


def _device(group: dist.ProcessGroup | None) -> torch.device:
    """NCCL gathers CUDA tensors (on the rank's current device); gloo CPU ones."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _collective(run, ranks: Sequence[int], doing: str) -> None:
    try:
        run()
    except comm.BACKEND_ERRORS as exc:
        raise comm.failure(exc, peer=None, doing=f"{doing} (ranks {list(ranks)})") from exc
