"""Bans by a sequential test per sender: a CUSUM of the evidence that it is blamed too often.

Each step every sender is either blamed (its flagged tensor was the most upstream one of
some microbatch) or not. Under the honest hypothesis a sender is blamed with probability
at most ``p0`` per step; the test is tuned to an attacker blamed with probability ``p1``.
The evidence ``S`` adds the log-likelihood ratio of each step, ``ln(p1/p0)`` when blamed
and ``ln((1-p1)/(1-p0))`` (negative) when not, and never drops below zero (Page's CUSUM);
the sender is banned when ``S`` reaches ``h = ln(ban_false_steps)``.

The guarantee: while an honest sender's steps are blamed independently with probability
``q <= p0``, ``exp(S)`` is a non-negative supermartingale (its expected factor per step,
``q p1/p0 + (1-q)(1-p1)/(1-p0)``, is at most 1), so the expected number of steps before a
false ban is at least ``exp(h) = ban_false_steps`` (Lorden's bound for CUSUM). How far
honest senders stay under ``p0`` is measured on clean runs (``benchmarks/verification.py``),
which also give the bound at the measured rate. An attacker blamed every step is banned
after ``ceil(h / ln(p1/p0))`` steps (5 at the defaults); one blamed in a share ``r`` of
them after about ``h / (r ln(p1/p0) + (1-r) ln((1-p1)/(1-p0)))``.

A replay (``evidence.DECISIVE``: a bit-exact copy of another data's tensor) is proof rather than a
tendency: honest senders are flagged for one at a rate far below ``p0`` (none in the clean runs of
``benchmarks/``), while a stale worker that replays a tenth of its microbatches is blamed in only a
third of its steps at four microbatches a step, which the CUSUM above takes 16-26 steps to ban
(``benchmarks/verification_sweep.py``, 2026-12-03). Replays feed a second CUSUM of their own, tuned to
an honest rate ``d0`` (``ban_replay_rate``) against ``REPLAY_ATTACK_RATE``; the false-ban budget is
split between the two (``REPLAY_SHARE`` of it to replays: levels ``ln(F / (1 - share))`` and
``ln(F / share)``), so that the chance of a false ban by either within ``n`` steps stays under ``n / F``.

A failed audit (``audit``: the stage recomputed on the very input the sender received, and its output
off by more than another device's numerics) is proof outright: ``step(proven=...)`` bans at once.

A sender's *first flagged step* is where the run of evidence that banned it began: the first step it
was blamed since its evidence was last zero (a CUSUM at zero has forgotten everything before). Until
the evidence returns to zero, the sender's flag is unresolved. A ban's recovery resumes from before that
step, and for a sender of an audited stage far enough before it that an attack the sampled audits missed at
first began after the resume point but with probability ``lookback.EPS`` (``planner.integrity.lookback``;
``planner.runtime.recovery.checkpoint`` keeps that checkpoint).
"""
from __future__ import annotations

import math

from planner.errors import InvalidInputError

REPLAY_ATTACK_RATE = 0.3   # the share of its steps a stale worker's replays are caught in, tuned for
REPLAY_SHARE = 0.1         # of the false-ban budget, the replay CUSUM's


class BanTest:
    """The CUSUM of every sender's blame (and, given ``replay_rate``, a second one of its replays);
    ``step(blamed, replayed=...)`` returns the senders it bans this step."""

    def __init__(self, *, honest_rate: float, attack_rate: float, false_steps: float,
                 replay_rate: float | None = None) -> None:
        self.up = math.log(attack_rate / honest_rate)
        self.down = math.log((1.0 - attack_rate) / (1.0 - honest_rate))
        if replay_rate is not None and not 0.0 < replay_rate < REPLAY_ATTACK_RATE:
            raise InvalidInputError("ban test replay rate", expected=f"a rate in (0, {REPLAY_ATTACK_RATE})",
                                    found=str(replay_rate))
        share = 0.0 if replay_rate is None else REPLAY_SHARE
        self.level = math.log(false_steps / (1.0 - share))
        self.replay = None if replay_rate is None else (
            math.log(REPLAY_ATTACK_RATE / replay_rate), math.log((1.0 - REPLAY_ATTACK_RATE) / (1.0 - replay_rate)),
            math.log(false_steps / share))   # (up, down, level) of the replay CUSUM
        self.evidence: dict[int, float] = {}
        self.replays: dict[int, float] = {}        # sender -> its replay CUSUM (above zero only)
        self.banned: set[int] = set()
        self.since: dict[int, int] = {}             # sender -> first step of its current run of evidence
        self.bans: dict[int, tuple[int, int]] = {}  # banned sender -> (first flagged step, ban step)
        self._clock = 0                             # the next step, when the caller does not say

    def step(self, blamed: set[int], *, replayed: set[int] = frozenset(), proven: set[int] = frozenset(),
             at: int | None = None) -> list[int]:
        """Update every sender with evidence (and the blamed ones; ``replayed``: those flagged for a replay,
        blamed too; ``proven``: those with a failed audit, banned now) for step ``at`` (default: the step
        after the previous call's); the newly banned, in rank order."""
        now = self._clock if at is None else int(at)
        self._clock = now + 1
        new = []
        replayed = set(replayed) if self.replay is not None else set()
        for sender in sorted(set(self.evidence) | set(self.replays) | blamed | replayed | set(proven)):
            value = _cusum(self.evidence, sender, self.up if sender in blamed else self.down)
            proof = 0.0
            if self.replay is not None:
                up, down, _ = self.replay
                proof = _cusum(self.replays, sender, up if sender in replayed else down)
            if value > 0.0 or proof > 0.0 or sender in proven:
                self.since.setdefault(sender, now)
            else:
                self.since.pop(sender, None)
            caught = sender in proven or value >= self.level or bool(self.replay and proof >= self.replay[2])
            if sender not in self.banned and caught:
                self.banned.add(sender)
                self.bans[sender] = (self.since[sender], now)
                new.append(sender)
        return new

    def unresolved(self) -> dict[int, int]:
        """Sender -> first flagged step, for every sender with evidence that has not returned to zero,
        and every banned one (its flag is resolved by planning it out, not by time)."""
        return {**self.since, **{s: first for s, (first, _) in self.bans.items()}}

    def to_json(self) -> dict:
        """The evidence and the bans, to carry across a resume (a restart must not wipe them)."""
        return {"evidence": {str(k): v for k, v in self.evidence.items()},
                "replays": {str(k): v for k, v in self.replays.items()}, "banned": sorted(self.banned),
                "since": {str(k): v for k, v in self.since.items()},
                "bans": {str(k): list(v) for k, v in self.bans.items()}, "clock": self._clock}

    def restore(self, data: dict) -> None:
        self.evidence = {int(k): float(v) for k, v in data.get("evidence", {}).items()}
        self.replays = {int(k): float(v) for k, v in data.get("replays", {}).items()}
        self.banned.clear()
        self.banned.update(int(r) for r in data.get("banned", []))
        self.since = {int(k): int(v) for k, v in data.get("since", {}).items()}
        self.bans = {int(k): (int(v[0]), int(v[1])) for k, v in data.get("bans", {}).items()}
        self._clock = int(data.get("clock", 0))

    def steps_to_ban(self, blamed_share: float) -> float:
        """About how many steps a sender blamed in ``blamed_share`` of its steps takes to be banned
        (inf when its evidence drifts down)."""
        drift = blamed_share * self.up + (1.0 - blamed_share) * self.down
        return math.ceil(self.level / drift) if drift > 0 else math.inf


def _cusum(table: dict[int, float], sender: int, change: float) -> float:
    """Page's CUSUM step of ``sender`` in ``table`` (kept above zero only); its new value."""
    value = max(0.0, table.get(sender, 0.0) + change)
    if value > 0.0:
        table[sender] = value
    else:
        table.pop(sender, None)
    return value
