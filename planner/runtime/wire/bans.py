"""What every rank learns at the end of a verified step, and the stop a ban causes.

The verifier ranks decide bans (``planner.integrity``); the stage ranks must know them too, at
once, or a banned sender keeps training the model. So at the end of each verified step the lowest
verifier rank (trusted: ``planner.runtime.wire.control``) sends every rank, point to point, one tensor of
``3 x num_ranks + 1`` integers (:func:`encode` / :func:`decode`):

* per sender, its first flagged step + 1 while its flags are unresolved (0: none),
* per sender, the step it was banned at + 1 (0: not banned),
* per sender, 1 where the step's flags or alerts named it or its contribution is suspect (``suspects``: the next
  step audits every one of its microbatches, ``planner.runtime.rank.audit_inputs.agreed_suspects``; the trusted
  ranks that copy an auditor its inputs must know it as the auditor does), and
* how many microbatches of the step trained on the first stage (each first-stage rank, trusted too,
  tells the lead verifier its own count first).

No other rank adds anything to it: nothing an untrusted rank sends can ban, un-ban or excuse anyone.
A ban stops the run at the end of the step that decided it, on every rank alike
(:class:`RankBannedError`): from then on nothing the banned sender produced trains the model,
and the launcher can re-plan without its host (``--replan-on-failure``) and resume from the last
clean checkpoint: the newest one at or before the ban's resume bound (``planner.integrity.lookback``: before
the sender's first flagged step, and for a sender of an audited stage its audit lookback before it).
"""
from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

from planner.errors import RankFailureError

BANNED_EXIT = 4  # a rank's exit status when a ban stopped the run (2: bad input, 3: a rank failed)


@dataclass(frozen=True, slots=True, kw_only=True)
class BanNotice:
    """Sender ``rank`` was banned at the end of ``ban_step``; its evidence began at ``first_flagged_step`` (the
    step of the flagged microbatch: a late audit verdict names its audited step, ``audit.late_audit_event``)."""

    rank: int
    first_flagged_step: int
    ban_step: int

    def to_dict(self) -> dict[str, int]:
        return {"rank": self.rank, "first_flagged_step": self.first_flagged_step, "ban_step": self.ban_step}


@dataclass(frozen=True, slots=True, kw_only=True)
class StepVerdicts:
    """One verified step's outcome as every rank sees it."""

    unresolved: dict[int, int]      # sender -> first flagged step, while its flags stand (banned ones too)
    bans: dict[int, BanNotice]      # every sender banned so far
    trained: int                    # microbatches of the step that trained on the first stage
    suspects: frozenset[int] = frozenset()   # senders the step's flags or alerts named, or with a suspect contribution


def verdict_size(num_ranks: int) -> int:
    """How many integers a step's verdict holds."""
    return 3 * num_ranks + 1


def encode(num_ranks: int, *, unresolved: Mapping[int, int], bans: Mapping[int, tuple[int, int]],
           trained: int, suspects: Collection[int] = ()) -> torch.Tensor:
    """The lead verifier's verdict of a step (``bans``: sender -> (first flagged step, ban step))."""
    out = torch.zeros(verdict_size(num_ranks), dtype=torch.int64)
    for sender, first in unresolved.items():
        out[sender] = first + 1
    for sender, (_, step) in bans.items():
        out[num_ranks + sender] = step + 1
    for sender in suspects:
        out[2 * num_ranks + sender] = 1
    out[3 * num_ranks] = trained
    return out


def decode(verdict: torch.Tensor) -> StepVerdicts:
    """The lead verifier's verdict, read back."""
    values = [int(v) for v in verdict.tolist()]
    n = (len(values) - 1) // 3
    unresolved = {r: values[r] - 1 for r in range(n) if values[r] > 0}
    bans = {r: BanNotice(rank=r, first_flagged_step=unresolved.get(r, values[n + r] - 1), ban_step=values[n + r] - 1)
            for r in range(n) if values[n + r] > 0}
    return StepVerdicts(unresolved=unresolved, bans=bans, trained=values[3 * n],
                        suspects=frozenset(r for r in range(n) if values[2 * n + r] > 0))


def replan_hint(plan_path: str, host: str, checkpoint_dir: str | None) -> str:
    """The commands that go on without a banned host (the later checkpoints are set aside by then, so
    ``--resume`` starts from the clean one)."""
    if checkpoint_dir is None:
        resume = "stagewise run NEW.json (from the start: this run took no checkpoints)"
    else:
        resume = f"stagewise run NEW.json --resume --checkpoint-dir {checkpoint_dir} (from the last clean checkpoint)"
    return (f"stagewise replan {plan_path} --exclude {host} -o NEW.json, then {resume}; with --replan-on-failure 1 "
            "--checkpoint-dir DIR a run re-plans around a banned rank by itself")


def describe(notice: BanNotice, host: str) -> str:
    """One line: which rank was banned, where, when."""
    return (f"rank {notice.rank} (host {host}) banned at step {notice.ban_step}, first flagged at step "
            f"{notice.first_flagged_step}")


class RankBannedError(RankFailureError):
    """The run stopped because the verifiers banned a rank (every rank raises it at the same step)."""

    def __init__(self, notices: tuple[BanNotice, ...], *, hosts: Mapping[int, str], fix: str | None = None) -> None:
        what = "; ".join(describe(n, hosts[n.rank]) for n in notices)
        super().__init__(f"{what}: the run stopped there, so nothing it sends trains the model", fix=fix)
        self.notices = notices
        self.hosts = dict(hosts)
