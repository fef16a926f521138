"""The run's audit lookback (``planner.integrity.lookback``) from its plan and options: which senders are
audited, at what share, on how many microbatches a step; and where a ban's recovery resumes.

Every input is the control rank's own (or the launcher's): the plan and the run's options decide which
stages are audited (``rank.audit_state.audited_stages``, the same rule every rank builds its audits by) and the
verdicts come from the lead verifier; nothing an untrusted rank sends moves a resume point or a kept checkpoint.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from planner.integrity.lookback import Lookback
from planner.runtime.rank.audit_state import audited_stages
from planner.runtime.wire.bans import BanNotice
from planner.runtime.wire.control import trusted_ranks

if TYPE_CHECKING:
    from planner.plan import Plan


def plan_lookback(plan: Plan, *, audit_every: int | None, verifying: bool) -> Lookback:
    """The lookback of a run of ``plan`` (``audit_every``: ``--audit-every``, None: the plan's shares): per
    untrusted replica of an audited stage, its share and microbatches a step."""
    trusted = trusted_ranks(plan)
    shares = {}
    for st in audited_stages(plan, every=audit_every, verifying=verifying).values():
        for rank in st.replicas:
            count = len(plan.ranks[rank].microbatches)
            if rank not in trusted and count > 0:
                shares[rank] = (st.every, count)
    return Lookback.of(shares)


def plan_auditors(plan: Plan, *, audit_every: int | None = None, verify: bool = True) -> frozenset[int]:
    """The ranks that audit a stage in a run of ``plan`` (``audit_every``: ``--audit-every``, None: the plan's
    shares; ``verify`` False: ``--no-verify``): the trusted ranks whose verdicts can be out a step late
    (``rank.audit_verdicts.unaudited_since``)."""
    verifying = bool(verify and plan.policy.enabled and plan.verifiers)
    return frozenset(st.auditor for st in audited_stages(plan, every=audit_every, verifying=verifying).values())


def run_lookback(plan: Plan, opts: Any) -> Lookback:
    """:func:`plan_lookback` for a run with options ``opts`` (verifying as the worker decides it)."""
    verifying = bool(opts.verify and plan.policy.enabled and plan.verifiers)
    return plan_lookback(plan, audit_every=opts.audit_every, verifying=verifying)


def set_aside_from(lookback: Lookback, notices: Iterable[BanNotice]) -> int:
    """The first step whose checkpoint a ban's recovery must not resume from: one past the bans' resume bound
    (0: every checkpoint, the run starts again)."""
    bound = lookback.resume_bound({n.rank: n.first_flagged_step for n in notices})
    return int(bound) + 1
