"""Which stages a run audits and one rank's part in their audits (``planner.runtime.rank.audits``): the audited
stages as the planner's rule places them, the state every rank keeps for them, and the auditor's copies, built
before the run starts."""
from __future__ import annotations

import secrets
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from planner.integrity import audit
from planner.runtime.rank import (
    audit_contrib,
    audit_inputs,
    audit_recompute,
    audit_signed,
)
from planner.runtime.rank.audit_background import Background
from planner.runtime.rank.audit_copy import StageCopy
from planner.runtime.rank.audit_recompute import Deferred
from planner.runtime.rank.random_ops import random_op
from planner.runtime.rank.rank_setup import (
    make_lr_schedule,
    make_optimizer,
    prepare_rank,
)
from planner.runtime.wire import control
from planner.simulate_audits import audit_site
from planner.solver.audit_price import AuditWhere


@dataclass(frozen=True, slots=True)
class AuditedStage:
    """An audited stage, its replicas, its auditor and the replica that sends its applied gradient whole; the
    upstream ranks that copy the auditor the audited inputs (empty: it verifies them itself) and, with them, the
    downstream ranks that copy it the gradients they sent (empty: outputs only, ``audit_grads``)."""

    stage: int
    replicas: tuple[int, ...]
    auditor: int
    source: int
    every: int   # each of a replica's microbatches audited with probability 1 / every
    copied_from: tuple[int, ...] = ()
    signed_by: tuple[int, ...] = ()   # the untrusted stage before, whose signed sends the replicas forward
    grads_from: tuple[int, ...] = ()   # copied: the trusted stage after, which copies it the gradients it sent


def audited_stages(plan: Any, *, every: int | None, verifying: bool) -> dict[int, AuditedStage]:
    """Stage -> how it is audited, for every stage with an untrusted replica the planner's rule lets its auditor
    audit (``simulate_audits.audit_site``; the same on every rank: the plan and the run's options decide). ``every`` (``--audit-every``): one in this
    many microbatches for every such stage (0: none); None: as the plan chose per stage (``StageInfo.audit_every``,
    priced; 0 there, as in a plan that predates audits: not audited)."""
    if not verifying or every == 0:
        return {}
    out = {}
    for stage in range(plan.num_stages):
        share = plan.stages[stage].audit_every if every is None else every
        where = audit_site(plan, stage) if share > 0 else None
        if not isinstance(where, AuditWhere):
            continue   # the planner's rule (``audit_price.audit_rule``): this auditor could never audit it
        out[stage] = AuditedStage(stage=stage, replicas=tuple(sorted(plan.stage_ranks(stage))),
                                  auditor=int(where.auditor), source=int(where.source), every=share,
                                  copied_from=tuple(int(r) for r in where.copied_from),
                                  signed_by=tuple(int(r) for r in where.signed_by),
                                  grads_from=tuple(int(r) for r in where.grads_from))
    return out


@dataclass(slots=True)
class RuntimeAudits:
    """One rank's part in the audits: the auditor's copies, schedule and kept tensors; a replica's applied
    gradient. Every rank holds one (``stages`` empty where nothing is audited)."""

    stages: dict[int, AuditedStage]
    copies: dict[int, StageCopy] = field(default_factory=dict)
    schedules: dict[int, audit.AuditSchedule] = field(default_factory=dict)   # the auditor's, by stage
    trusted: frozenset[int] = frozenset()
    kept: dict[tuple[int, str, int], list[torch.Tensor]] = field(default_factory=dict)
    applied: torch.Tensor | None = None   # a replica's: the gradient its optimizer stepped with this step
    outbox_flat: torch.Tensor | None = None   # the buffer ``applied`` is written into every step
    sending: Any = None   # the source's: that gradient on its way to the auditor (``comm.Pending``), sent as it steps
    in_flight: Any = None   # ... still on its way after the step's end: waited before ``outbox_flat`` is rewritten
    claim: Future | None = None   # a replica's digest of it, hashed on ``hasher`` as its optimizer steps
    hasher: Executor | None = None   # twins' digests off the run's thread: a replica's of its applied gradient, the auditor's of what it hears
    hearing: dict[int, Any] = field(default_factory=dict)   # the auditor's receives of it, by stage, posted early
    # the auditor's two receive buffers per stage, used in turn, so a receive never waits for the copy's step
    inboxes: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    filling: dict[int, int] = field(default_factory=dict)        # stage -> the buffer its posted receive fills
    stepped_from: dict[int, int] = field(default_factory=dict)   # stage -> the buffer its copy's last step read
    suspended: dict[int, int] = field(default_factory=dict)   # stage -> step its replicas' digests disagreed
    # an upstream rank's, for a stage audited from copies: the auditor's schedule, and this step's kept inputs
    sharing: dict[int, audit.AuditSchedule] = field(default_factory=dict)
    outbox: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    # where gradients come copied too (``audit_grads``): an upstream rank's kept input gradients (with their taint
    # header) and a downstream rank's kept gradients sent (with whether they went tainted), each as references with
    # the loss scale in force (unscaled at the step's end); the auditor's: the (stage, mb) whose input gradient the
    # replica marked tainted, and whose gradient the stage after sent tainted (``audit_grads.resolve``)
    gin_outbox: dict[tuple[int, int], tuple[list[torch.Tensor], bool, float | None]] = field(default_factory=dict)
    grad_outbox: dict[tuple[int, int], tuple[list[torch.Tensor], bool, float | None]] = field(default_factory=dict)
    gin_tainted: set[tuple[int, int]] = field(default_factory=set)
    g_tainted: set[tuple[int, int]] = field(default_factory=set)
    skipped_seen: int | None = None   # the fp16 scaler's skipped steps at the last step's end (``overflow_skipped``)
    tainted: set[tuple[int, int]] = field(default_factory=set)   # (stage, mb) whose replica computed on zeros
    signed: audit_signed.SignedState = field(default_factory=audit_signed.SignedState)
    # the auditor's: a step's audits left at its end, recomputing on the copy's stepper in the next step, by stage
    deferred: dict[int, Deferred] = field(default_factory=dict)
    last_step: int | None = None   # the run's last step, which audits in line (None: every step does)
    # every rank's: the senders the last step's verdict left unresolved or named suspects, read once a step
    # (``agreed_suspects``)
    agreed: frozenset[int] = frozenset()
    agreed_step: int | None = None
    checkpoint_every: int | None = None   # a step that writes a checkpoint audits in line (None: none written)
    # the lead auditor's: this step's recomputed parameter gradients of fully audited replicas, by stage
    contrib: dict[int, audit_contrib.ContribSums] = field(default_factory=dict)
    # the auditor's, fp16: input gradients audited in the step, recorded once the overflow vote is known
    in_step_grads: list[audit_recompute.Outcome] = field(default_factory=list)
    # the auditor's copies' stepper at the idle CPU class but while the run's thread waits on it (``audit_background``)
    background: Background | None = None

    def inline_at(self, step: int) -> bool:
        """Whether ``step``'s audits are done by its end (its verdict): it ends the run or writes a checkpoint, so no
        checkpoint and no run's end leaves an audit out (``audit_recompute``); else they recompute in the next."""
        every = self.checkpoint_every
        return self.last_step is None or step >= self.last_step or (every is not None and (step + 1) % every == 0)

    def auditing(self, rank: int) -> dict[int, AuditedStage]:
        return {k: s for k, s in self.stages.items() if s.auditor == rank and k in self.copies
                and not self.copies[k].drifts and self.copies[k].random is None and k not in self.suspended}


def build(plan: Any, rank: int, opts: Any, device: torch.device, *, verifying: bool) -> RuntimeAudits:
    """This rank's audits for a run with options ``opts`` (``--audit-every``): the auditor builds its copies
    here, before the run starts, the way the stage's first replica builds its stage."""
    stages = audited_stages(plan, every=opts.audit_every, verifying=verifying)
    out = RuntimeAudits(stages=stages, trusted=control.trusted_ranks(plan), last_step=opts.steps - 1,
                        checkpoint_every=opts.checkpoint_every if opts.checkpoint_dir is not None else None)
    # a twin's digests (its own applied gradient; the auditor's of the gradient it hears) off the copies' stepper,
    # whose queue holds the stages' recomputes: a digest behind them would hold each stage's verdict back
    if any(len(st.replicas) > 1 and (rank in st.replicas or rank == st.auditor) for st in stages.values()):
        out.hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="audit-digest")
    secret = secrets.token_bytes(16)   # the auditor's: shared only with the trusted ranks that copy it inputs
    stepper, background = None, Background(device)
    for k, st in stages.items():
        mine = audit_inputs.stage_key(secret, k) if st.auditor == rank else None
        # from signed inputs the key stays the auditor's: the replicas forward what it asks for after the step
        key = (mine or b"") if st.signed_by else audit_inputs.share_key(st, rank, mine, device)
        if (rank in st.copied_from or rank in st.grads_from) and not st.signed_by:
            out.sharing[k] = audit.AuditSchedule(key, st.every)
        if st.auditor != rank:
            continue
        setup = prepare_rank(plan, st.replicas[0], opts, device)
        runtime = setup.stage
        assert runtime is not None
        optimizer = make_optimizer(plan.config.optimizer, [p for _, p in runtime.parameters()], lr=opts.lr,
                                   weight_decay=opts.weight_decay)
        schedule = make_lr_schedule(optimizer, warmup=opts.lr_warmup, schedule=opts.lr_schedule,
                                    total_steps=opts.steps)
        # one thread for all the copies: each copy's steps run in order, one at a time, on idle CPU time
        stepper = stepper or ThreadPoolExecutor(max_workers=1, thread_name_prefix="audit-copy-step",
                                                initializer=background.start)
        out.background = background
        out.copies[k] = StageCopy(runtime=runtime, optimizer=optimizer, schedule=schedule,
                                  random=random_op(runtime.module), stepper=stepper,
                                  tied=audit_contrib.tied_names(plan, setup.split, k), background=background)
        out.schedules[k] = audit.AuditSchedule(key, st.every)
    out.signed = audit_signed.setup(stages, rank, device)
    return out
