"""Blame: which sender a step's flags point at, and the flags verifiers exchange.

Per microbatch only the most upstream flag's sender is blamed (a corruption upstream makes
everything downstream look odd, activations forward and gradients backward); a step-level flag
stands for its whole step, shared by evidence among twins (replicas of one stage); an alert never
outranks its own sender's flags; a replay, a replica's gradient contribution or a failed audit is never
outranked.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from planner.integrity import audit, evidence
from planner.verifier_config import DIRECTIONS

__all__ = ["BLAME_MICROBATCHES", "FLAG_EVENTS_SCHEMA", "STEP_MB", "blame", "blame_weights", "culprit",
           "flatten_events", "input_key", "is_alert", "needed", "proven", "replayed"]

STEP_MB = -1   # the "microbatch" of a step-level flag


def input_key(boundary: int, direction: str, *, forward: bool = True) -> tuple[int, str]:
    """The boundary whose tensor is the input of the stage that sends on ``boundary``
    (``forward=False``: the boundary whose input ``boundary`` is)."""
    step = -1 if (direction == "act") == forward else 1
    return boundary + step, direction


def flatten_events(events: Iterable[Any]) -> Iterable[Mapping[str, Any]]:
    for item in events:
        if isinstance(item, Mapping):
            yield item
        elif item is not None:
            yield from flatten_events(item)


def _upstream_key(event: Mapping[str, Any]) -> tuple[int, int]:
    # Causal order of a microbatch: activations cross boundaries 0, 1, ... then
    # gradients cross them back from the last boundary down to 0. A flag laid on its
    # stage's input (``upstream``) stands where that input crossed.
    b, d = int(event["boundary"]), event["direction"]
    if "upstream" in event:
        b, d = input_key(b, d)
    return (0, b) if d == "act" else (1, -b)


FLAG_EVENTS_SCHEMA = {
    "type": "array",
    "items": {
        "type": "object", "additionalProperties": False,
        "required": ["type", "step", "mb", "boundary", "direction", "sender", "scope", "scores", "fences", "reasons"],
        "properties": {
            "type": {"const": "flag"}, "step": {"type": "integer", "minimum": 0},
            "mb": {"type": "integer", "minimum": STEP_MB}, "boundary": {"type": "integer", "minimum": 0},
            "direction": {"enum": list(DIRECTIONS)}, "sender": {"type": "integer", "minimum": 0},
            "scope": {"enum": ["microbatch", "step"]},
            "scores": {"type": "object", "additionalProperties": {"type": "number"}},
            "fences": {"type": "object", "additionalProperties": {"type": ["number", "null"]}},
            "reasons": {"type": "array", "items": {"type": "string"}},
            "upstream": {"type": "integer", "minimum": 0},
            "stage": {"type": "integer", "minimum": 0},   # a gradient contribution's flag (``contributions``)
            "since": {"type": "integer", "minimum": 0},   # ... where its evidence began before its step
        },
    },
}


def blame(flags: Iterable[Mapping[str, Any]], **context: Any) -> set[int]:
    """Senders to blame: per (step, microbatch), only the most upstream flag's sender (see
    :func:`blame_weights`, which takes the same ``context``)."""
    return set(blame_weights(flags, **context))


def blame_weights(flags: Iterable[Mapping[str, Any]], *, stage_of: Mapping[int, int] | None = None,
                  microbatches: Mapping[int, int] | None = None) -> dict[int, float]:
    """Per sender to blame, how many (step, microbatch) pairs its flags are the most upstream of
    (``math.inf`` where that is a step-level flag, a replay or a gradient contribution: its whole step).

    A step-level flag (a sender's step as a whole) stands for every microbatch of its step, and
    is itself outranked by any flag upstream in its step: a stage that damps or skews its output
    just under the per-sample fences makes the honest stages after it look odd, and their flags
    must not outrank the upstream one that caused them. Step-level flags at one place in the causal
    order (twins: replicas of one stage, ``stage_of``) all stand; each is *shared by evidence* among
    the twins: where a twin has microbatch flags of its own in the step, a twin's step-level flag
    weighs as its own share of the twins' flagged-microbatch rates (``microbatches``: each sender's
    microbatches a step) times its microbatches, not as its whole step (issue 37, mixed attack: the
    honest twin took the step flags while the attacker's own flags stayed under the count).

    An alert (a step's flag by shape tests alone where no verifier sees the stage's input,
    ``evidence.UNLINKED_SHIFT``) outranks other senders' flags downstream but blames nobody, and never
    outranks its own sender's flags (issue 37: an alert on the attacker's activations hid its own
    gradient flags). A flag laid on its stage's input (``upstream``, see :func:`upstream_culprit`)
    blames that input's sender, where that input crossed. A replay (``evidence.DECISIVE``) is never
    outranked: nothing upstream makes a sender send back an exact copy of its own earlier tensor, and
    a stale worker's effect on the honest stages around it (through the gradients their training took
    from its stale tensors) flags them upstream of it in later steps (split placement, seed 1,
    2026-12-03: the stale rank was never blamed; its honest neighbour upstream was, and banned). A
    gradient contribution's flag (a ``stage`` key, ``contributions``) and a failed audit (``audit``: the
    stage recomputed on the very input the sender received) are its sender's own evidence, outside the
    causal order.
    """
    by_step: dict[int, list[Mapping[str, Any]]] = {}
    for event in flags:
        by_step.setdefault(int(event["step"]), []).append(event)
    weights: dict[int, float] = {}
    for events in by_step.values():
        for who, weight in _step_weights([e for e in events if not _own(e)], stage_of or {},
                                         microbatches or {}).items():
            weights[who] = weights.get(who, 0.0) + weight
        for e in events:
            if _own(e) or evidence.DECISIVE.intersection(e.get("reasons", ())):
                weights[int(e["sender"])] = math.inf
    return weights


def _own(event: Mapping[str, Any]) -> bool:
    """A flag of the sender's own doing whatever its input: a gradient contribution's or a failed audit."""
    return "stage" in event or audit.is_audit(event)


def proven(flags: Iterable[Mapping[str, Any]]) -> set[int]:
    """The senders a failed audit proves wrong among ``flags`` (banned at once: see ``bans``)."""
    return audit.failed_audits(flags)


def _step_weights(events: list[Mapping[str, Any]], stage_of: Mapping[int, int],
                  microbatches: Mapping[int, int]) -> dict[int, float]:
    """:func:`blame_weights` of one step's boundary flags."""
    whole = [e for e in events if int(e["mb"]) == STEP_MB]
    # A step-level flag competes with the step's other step-level flags and with the microbatch flags
    # of senders flagged at the blaming rate: one odd microbatch upstream explains its own microbatch
    # downstream, not a whole step's average (linked placement, seed 3, gradients scaled by 3: an honest
    # stage's lone flag upstream took the attacker's whole step).
    many = {who for who, n in _flagged_microbatches(events).items() if n >= needed(who, microbatches)}
    weighty = [e for e in events if int(e["mb"]) == STEP_MB or culprit(e) in many]
    by_key: dict[tuple[int, int], list[Mapping[str, Any]]] = {}
    for event in events:
        by_key.setdefault((int(event["step"]), int(event["mb"])), []).append(event)
    winners = {key: _most_upstream(weighty, ties=True) if key[1] == STEP_MB else
               _most_upstream([*mine, *whole], ties=False) for key, mine in by_key.items()}
    # Each winning flag counts once, by its own scope: a microbatch's flag that outranks a step-level
    # one downstream is one microbatch of evidence, not a step's.
    counted: dict[int, Mapping[str, Any]] = {}
    for found in winners.values():
        for event in found:
            counted.setdefault(id(event), event)
    own: dict[int, float] = {}
    for event in counted.values():
        if int(event["mb"]) != STEP_MB:
            own[culprit(event)] = own.get(culprit(event), 0.0) + 1.0
    weights = dict(own)
    for event in counted.values():
        if int(event["mb"]) == STEP_MB and not is_alert(event):
            who = culprit(event)
            weights[who] = max(weights.get(who, 0.0), _step_flag_weight(who, own, stage_of, microbatches))
    return weights


def _most_upstream(rivals: Sequence[Mapping[str, Any]], *, ties: bool) -> list[Mapping[str, Any]]:
    """The rivals that win: the most upstream non-alerts (all of them at one place with ``ties``: twins'
    step flags; else the first), less those of other senders than an alert upstream of them names."""
    plain = [e for e in rivals if not is_alert(e)]
    alerts = [e for e in rivals if is_alert(e)]
    if not plain:
        return [min(alerts, key=_upstream_key)] if alerts else []
    top = min(_upstream_key(e) for e in plain)
    best = [e for e in plain if _upstream_key(e) == top] if ties else [min(plain, key=_upstream_key)]
    above = {culprit(a) for a in alerts if _upstream_key(a) < top}
    if above:   # an alert upstream explains other senders' flags downstream, never its own sender's
        kept = [e for e in best if culprit(e) in above]
        return kept or [min(alerts, key=_upstream_key)]
    return best


def _step_flag_weight(who: int, own: Mapping[int, float], stage_of: Mapping[int, int],
                      microbatches: Mapping[int, int]) -> float:
    """A step-level flag's weight on ``who``: its whole step, unless a twin has microbatch flags of its
    own this step; then ``who``'s share of the twins' flagged rates, times its microbatches."""
    stage = stage_of.get(who)
    twins = [s for s, st in stage_of.items() if stage is not None and st == stage and s != who]
    rates = {s: own.get(s, 0.0) / _microbatches(s, microbatches) for s in (who, *twins)}
    others = sum(rates[s] for s in twins)
    if others <= 0.0:
        return math.inf
    return rates[who] / (rates[who] + others) * _microbatches(who, microbatches)


def culprit(event: Mapping[str, Any]) -> int:
    """The sender a flag blames: its own, or its input's where it is laid there (``upstream``)."""
    return int(event.get("upstream", event["sender"]))


def needed(sender: int, microbatches: Mapping[int, int] | None = None) -> int:
    """Flagged microbatches (this step's plus the last step's unblamed ones) that blame ``sender``:
    ``BLAME_MICROBATCHES``, or every one of its microbatches where it sends fewer a step (a rate, not a
    count: a replica with one microbatch a step, every one flagged, is blamed every step)."""
    return max(1, min(BLAME_MICROBATCHES, _microbatches(sender, microbatches or {})))


def _microbatches(sender: int, microbatches: Mapping[int, int]) -> int:
    return max(1, int(microbatches.get(sender, BLAME_MICROBATCHES)))


def replayed(flags: Iterable[Mapping[str, Any]]) -> set[int]:
    """The senders of a replay among ``flags`` (proof alone: see ``bans``)."""
    return {int(e["sender"]) for e in flags if evidence.DECISIVE.intersection(e.get("reasons", ()))}


def is_alert(event: Mapping[str, Any]) -> bool:
    """A step's flag by shape tests alone, without the stage's input (``evidence.alert_only``)."""
    return int(event["mb"]) == STEP_MB and evidence.alert_only(event.get("scores", {}), event.get("reasons", ()))


def _flagged_microbatches(events: Sequence[Mapping[str, Any]]) -> dict[int, int]:
    """Per sender (or input's sender a flag is laid on), how many of its microbatches are flagged."""
    per: dict[int, set[int]] = {}
    for e in events:
        if int(e["mb"]) != STEP_MB:
            per.setdefault(culprit(e), set()).add(int(e["mb"]))
    return {who: len(mbs) for who, mbs in per.items()}


# Blame that counts as evidence against a sender (``Verifier.end_step``): its step as a whole
# (a step-level flag, a replay), or flagged microbatches adding up to this many over its last two
# steps, or all of them where it sends fewer (``needed``). A lone flagged microbatch is dropped but is no
# evidence: honest training makes an odd one now and then, never two of one sender in a step in the clean
# runs, while the attacks flag 5-16 of 16 (benchmarks/README.md, tuning notes); one corrupted microbatch a
# step is blamed from its second.
BLAME_MICROBATCHES = 2
