"""Blame: which sender a step's flags point at, and the flags verifiers exchange.

Per microbatch only the most upstream flag's sender is blamed (a corruption upstream makes
everything downstream look odd, activations forward and gradients backward); a step-level flag
stands for its whole step; a replay is never outranked.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from planner.integrity import evidence
from planner.verifier_config import DIRECTIONS

__all__ = ["BLAME_MICROBATCHES", "FLAG_EVENTS_SCHEMA", "STEP_MB", "blame", "blame_weights",
           "flatten_events", "input_key", "is_alert", "replayed"]

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
        },
    },
}


def blame(flags: Iterable[Mapping[str, Any]]) -> set[int]:
    """Senders to blame: per (step, microbatch), only the most upstream flag's sender (see
    :func:`blame_weights`)."""
    return set(blame_weights(flags))


def blame_weights(flags: Iterable[Mapping[str, Any]]) -> dict[int, float]:
    """Per sender to blame, how many (step, microbatch) pairs its flags are the most upstream of
    (``math.inf`` where that is a step-level flag or a replay: its whole step).

    A step-level flag (a sender's step as a whole) stands for every microbatch of its step, and
    is itself outranked by any flag upstream in its step: a stage that damps or skews its output
    just under the per-sample fences makes the honest stages after it look odd, and their flags
    must not outrank the upstream one that caused them. An alert (a step's flag by shape tests
    alone where no verifier sees the stage's input, ``evidence.UNLINKED_SHIFT``) outranks as any
    step-level flag but blames nobody. A flag laid on its stage's input
    (``upstream``, see :func:`upstream_culprit`) blames that input's sender, where that input crossed.
    A replay (``evidence.DECISIVE``) is never outranked: nothing upstream makes a sender send back an
    exact copy of its own earlier tensor, and a stale worker's effect on the honest stages around it
    (through the gradients their training took from its stale tensors) flags them upstream of it in
    later steps (split placement, seed 1, 2026-12-03: the stale rank was never blamed; its honest
    neighbour upstream was, and banned).
    """
    by_step: dict[int, list[Mapping[str, Any]]] = {}
    for event in flags:
        by_step.setdefault(int(event["step"]), []).append(event)
    first: dict[tuple[int, int], Mapping[str, Any]] = {}
    for events in by_step.values():
        whole = [e for e in events if int(e["mb"]) == STEP_MB]
        # A step-level flag competes with the step's other step-level flags and with the microbatch flags
        # of senders flagged on BLAME_MICROBATCHES microbatches or more: one odd microbatch upstream
        # explains its own microbatch downstream, not a whole step's average (linked placement, seed 3,
        # gradients scaled by 3: an honest stage's lone flag upstream took the attacker's whole step).
        many = _senders_with(events, BLAME_MICROBATCHES)
        weighty = [e for e in events if int(e["mb"]) == STEP_MB or int(e.get("upstream", e["sender"])) in many]
        for event in events:
            # a microbatch's flag competes with the step-level ones
            rivals = weighty if int(event["mb"]) == STEP_MB else (event, *whole)
            key = (int(event["step"]), int(event["mb"]))
            for candidate in rivals:
                if key not in first or _upstream_key(candidate) < _upstream_key(first[key]):
                    first[key] = candidate
    # Each winning flag counts once, by its own scope: a microbatch's flag that outranks a step-level
    # one downstream is one microbatch of evidence, not a step's (linked placement, seed 3, gradients
    # scaled by 3: an honest stage's lone flag upstream took a whole step of the attacker's blame).
    weights: dict[int, float] = {}
    counted: set[int] = set()
    for event in first.values():
        if id(event) in counted:
            continue
        counted.add(id(event))
        if is_alert(event):
            continue   # an alert explains what it outranks downstream, but is no evidence itself
        who = int(event.get("upstream", event["sender"]))
        weights[who] = math.inf if int(event["mb"]) == STEP_MB else weights.get(who, 0.0) + 1.0
    for events in by_step.values():
        for e in events:
            if evidence.DECISIVE.intersection(e.get("reasons", ())):
                weights[int(e["sender"])] = math.inf
    return weights


def replayed(flags: Iterable[Mapping[str, Any]]) -> set[int]:
    """The senders of a replay among ``flags`` (proof alone: see ``bans``)."""
    return {int(e["sender"]) for e in flags if evidence.DECISIVE.intersection(e.get("reasons", ()))}


def is_alert(event: Mapping[str, Any]) -> bool:
    """A step's flag by shape tests alone, without the stage's input (``evidence.alert_only``)."""
    return int(event["mb"]) == STEP_MB and evidence.alert_only(event.get("scores", {}), event.get("reasons", ()))


def _senders_with(events: Sequence[Mapping[str, Any]], count: int) -> set[int]:
    """The senders (or the inputs' senders flags are laid on) flagged on ``count`` microbatches or more."""
    per: dict[int, set[int]] = {}
    for e in events:
        if int(e["mb"]) != STEP_MB:
            per.setdefault(int(e.get("upstream", e["sender"])), set()).add(int(e["mb"]))
    return {who for who, mbs in per.items() if len(mbs) >= count}


# Blame that counts as evidence against a sender (``Verifier.end_step``): its step as a whole
# (a step-level flag, a replay), or flagged microbatches adding up to this many over its last two
# steps. A lone flagged microbatch is dropped but is no evidence: honest training makes an odd one
# now and then, never two of one sender in a step in the clean runs, while the attacks flag 5-16 of
# 16 (benchmarks/README.md, tuning notes); one corrupted microbatch a step is blamed from its second.
BLAME_MICROBATCHES = 2
