"""Which microbatches a step dropped and why, as the lead verifier decides it.

A microbatch is dropped when a verifier flags one of its tensors (the verdict goes to the consumer,
and the taint follows the microbatch down the pipeline) or when an untrusted sender marks it dropped
itself (its taint header). The lead verifier holds every verifier's flags of the step (the flags
exchange) and the trusted first-stage ranks' count of what trained, so it can name each drop: the
most upstream flag of the microbatch, else its sender's own taint. Nothing here comes from an
untrusted rank's word about itself.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from planner.integrity.blame import STEP_MB, _upstream_key, flatten_events

__all__ = ["DROPS_SCHEMA", "TAINTED_BY_SENDER", "reason_counts", "step_drops"]

TAINTED_BY_SENDER = "marked dropped by its sender (taint header), no verifier flag"

DROPS_SCHEMA = {
    "type": "array",
    "items": {
        "type": "object", "additionalProperties": False,
        "required": ["step", "microbatch", "boundary", "direction", "sender", "reason"],
        "properties": {
            "step": {"type": "integer", "minimum": 0},
            "microbatch": {"type": ["integer", "null"], "minimum": 0},
            "boundary": {"type": ["integer", "null"], "minimum": 0},
            "direction": {"enum": ["act", "grad", None]},
            "sender": {"type": ["integer", "null"], "minimum": 0},
            "reason": {"type": "string"},
        },
    },
}


def step_drops(step: int, flags: Iterable[Any], *, dropped: int) -> list[dict[str, Any]]:
    """The drops of ``step``: one entry per microbatch a verifier flagged (its most upstream flag:
    what dropped it; the tensors after it only carried the taint), then one per drop no flag explains
    (``dropped``, the trusted count of microbatches that did not train, minus the flagged ones)."""
    first: dict[int, Mapping[str, Any]] = {}
    for event in flatten_events(flags):
        if int(event["step"]) != step or event.get("scope") != "microbatch" or int(event["mb"]) == STEP_MB:
            continue
        mb = int(event["mb"])
        if mb not in first or _upstream_key(event) < _upstream_key(first[mb]):
            first[mb] = event
    out = [{"step": step, "microbatch": mb, "boundary": int(e["boundary"]), "direction": str(e["direction"]),
            "sender": int(e["sender"]), "reason": "flagged: " + ", ".join(e.get("reasons") or ["unknown"])}
           for mb, e in sorted(first.items())]
    out += [{"step": step, "microbatch": None, "boundary": None, "direction": None, "sender": None,
             "reason": TAINTED_BY_SENDER} for _ in range(max(0, dropped - len(out)))]
    return out


def reason_counts(drops: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Drops per reason, the most frequent first (a flag's reason is the set of tests it failed)."""
    counts: dict[str, int] = {}
    for d in drops:
        counts[d["reason"]] = counts.get(d["reason"], 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
