"""What an auditor makes of an audited stage's reported updates (``runtime.rank.audits``): each replica's digest
of the gradient it applied (``digest``; a sole replica's report, ``stepped_only``), judged against the gradient
one replica sent whole (``judge_applied``). Pure: no process, no peer."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

__all__ = ["DIGEST_WORDS", "AppliedJudgement", "digest", "judge_applied", "stepped_only"]

DIGEST_WORDS = 4   # a blake2b-256 digest as int64 words, after one word saying whether the optimizer stepped


def digest(flat: torch.Tensor | None) -> torch.Tensor:
    """[stepped, blake2b-256 of the applied gradient's bytes as DIGEST_WORDS int64 words]."""
    if flat is None:
        return torch.zeros(1 + DIGEST_WORDS, dtype=torch.int64)
    values = flat.detach().float().contiguous().cpu().numpy()
    # hashed in place: a copy of the bytes (``tobytes``) would cost half as much again
    raw = hashlib.blake2b(memoryview(values).cast("B"), digest_size=8 * DIGEST_WORDS).digest()
    words = [int.from_bytes(raw[8 * i:8 * i + 8], "big", signed=True) for i in range(DIGEST_WORDS)]
    return torch.tensor([1, *words], dtype=torch.int64)


def stepped_only(flat: torch.Tensor | None) -> torch.Tensor:
    """A sole replica's report (``digest``'s shape): whether it stepped, no digest (``judge_applied``)."""
    return torch.tensor([int(flat is not None)] + [0] * DIGEST_WORDS, dtype=torch.int64)


@dataclass(frozen=True, slots=True)
class AppliedJudgement:
    """What the auditor makes of a step's reported updates (``judge_applied``): whether the copy steps (with the
    source's gradient where ``stepped``), or its audits stop (``suspend``); ``liars``: replicas proven lying."""

    stepped: bool
    suspend: bool
    liars: tuple[int, ...] = ()


def judge_applied(reported: dict[int, tuple[int, ...]], flat: torch.Tensor, *, source: int,
                  trusted: frozenset[int], hashed: torch.Tensor | None = None) -> AppliedJudgement:
    """The replicas' reported digests (``digest``) against the gradient ``flat`` that ``source`` sent whole. A
    trusted source's report is the truth where it exchanged with the one other replica directly (two replicas):
    both apply one all-reduced sum, so a replica reporting another lies about its own state (a failed audit), and
    the copy steps with the source's tensor. With three replicas or more the all-reduce relays partial sums
    through the replicas, so a relaying attacker could hand an honest one another sum and frame it: any
    disagreement then stops the stage's audits and names nobody, as it does without a trusted source. A source
    whose gradient differs from its own digest (both sent by it alone, point to point) lies: an untrusted one
    is named, and the audits stop. A sole replica's update is its own word (``stepped_only``): a digest of the
    tensor it sends proves nothing its audits do not (where it applied another, the copy drifts and it fails them).
    ``hashed``: ``digest(flat)``, already computed."""
    claimed = reported[source]
    stepped = claimed[0] == 1
    if len(reported) == 1:
        return AppliedJudgement(stepped=stepped, suspend=False)
    mine = digest(None) if not stepped else hashed if hashed is not None else digest(flat)
    if tuple(mine.tolist()) != claimed:
        # the source's tensor is not what it reports, both sent by it alone: an untrusted source lies
        return AppliedJudgement(stepped=False, suspend=True, liars=() if source in trusted else (source,))
    liars = tuple(sorted(r for r, d in reported.items() if d != claimed))
    if source in trusted and len(reported) == 2:
        return AppliedJudgement(stepped=stepped, suspend=False, liars=liars)
    return AppliedJudgement(stepped=stepped, suspend=bool(liars))
