"""A plan's history: what made it and every change of hosts since (failures, bans, re-admissions, joins)."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

from planner.errors import InvalidInputError

HISTORY_EVENTS = ("planned", "failure", "ban", "manual", "readmit", "join")
_WHEN_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def utc_stamp(moment: datetime | None = None) -> str:
    """``moment`` (default: now) as the history's UTC time stamp, e.g. ``2026-12-03T09:34:24Z``."""
    return (moment or datetime.now(timezone.utc)).astimezone(timezone.utc).strftime(_WHEN_FORMAT)


@dataclass(frozen=True, slots=True, kw_only=True)
class HistoryEntry:
    """One step of a plan's history: what happened, to which hosts, why, when, and what the plan was before.

    ``event``: ``planned`` (the original plan), ``failure`` (re-planned after a lost host), ``ban`` (after a
    ban), ``manual`` (hosts excluded by the operator), ``readmit`` (hosts put back) or ``join`` (hosts that
    joined a running run at a checkpoint: excluded ones back, or new ones added to the cluster).
    ``excluded_hosts`` are every host the step left out (those of ``excluded_domains`` included);
    ``readmitted_hosts`` those it put back (for ``join``: those that joined). ``previous_ranks`` /
    ``previous_step_ms``: the replaced plan's rank count and simulated step (None for ``planned``).
    """

    event: str
    when_utc: str
    reason: str
    excluded_hosts: tuple[str, ...] = ()
    excluded_domains: tuple[str, ...] = ()
    readmitted_hosts: tuple[str, ...] = ()
    previous_ranks: int | None = None
    previous_step_ms: float | None = None

    def __post_init__(self) -> None:
        if self.event not in HISTORY_EVENTS:
            raise InvalidInputError("plan history event", expected=" or ".join(HISTORY_EVENTS), found=repr(self.event))
        try:
            datetime.strptime(self.when_utc, _WHEN_FORMAT)
        except (TypeError, ValueError):
            raise InvalidInputError("plan history time", expected="UTC as YYYY-MM-DDTHH:MM:SSZ",
                                    found=repr(self.when_utc)) from None
        original = self.event == "planned"
        changed = bool(self.excluded_hosts or self.readmitted_hosts)
        if original == changed or original != (self.previous_ranks is None) or \
                (self.previous_ranks is None) != (self.previous_step_ms is None):
            raise InvalidInputError(f"plan history entry {self.event!r} of {self.when_utc}",
                                    expected="the original plan with no hosts and no previous plan, or a change "
                                             "of hosts with the previous plan's ranks and step",
                                    found=f"hosts excluded {list(self.excluded_hosts)}, re-admitted "
                                          f"{list(self.readmitted_hosts)}, previous ranks {self.previous_ranks}")
        back_only = bool(self.readmitted_hosts) and not self.excluded_hosts
        if self.event == "join" and not back_only:
            raise InvalidInputError(f"plan history entry 'join' of {self.when_utc}",
                                    expected="hosts that joined and none excluded",
                                    found=f"excluded {list(self.excluded_hosts)}, joined {list(self.readmitted_hosts)}")
        if self.event != "join" and (self.event == "readmit") != back_only:
            raise InvalidInputError(f"plan history entry {self.event!r} of {self.when_utc}",
                                    expected="readmit exactly when hosts are re-admitted and none excluded",
                                    found=f"excluded {list(self.excluded_hosts)}, "
                                          f"re-admitted {list(self.readmitted_hosts)}")
        if set(self.excluded_hosts) & set(self.readmitted_hosts):
            raise InvalidInputError("plan history entry", expected="a host excluded or re-admitted, not both",
                                    found=repr(sorted(set(self.excluded_hosts) & set(self.readmitted_hosts))))

    def summary(self) -> str:
        """One line: ``2026-12-03T09:34:24Z ban: excluded vol3 (domain vol3): flagged 9 times (was 8 ranks, ...)``."""
        what = []
        if self.excluded_hosts:
            domains = f" (domain {', '.join(self.excluded_domains)})" if self.excluded_domains else ""
            what.append(f"excluded {', '.join(self.excluded_hosts)}{domains}")
        if self.readmitted_hosts:
            what.append(f"{'joined' if self.event == 'join' else 're-admitted'} {', '.join(self.readmitted_hosts)}")
        was = "" if self.previous_step_ms is None else \
            f" (was {self.previous_ranks} ranks, simulated step {self.previous_step_ms:.3f} ms)"
        return f"{self.when_utc} {self.event}: {'; '.join(what + [self.reason])}{was}"
