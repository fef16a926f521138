"""Audits of an untrusted stage's replicas in the distributed runtime (issue 37; ``planner.integrity.audit``).

A stage with an untrusted replica, where the planner's rule allows it (``audit_price.audit_rule``), is audited by
its *auditor*, the verifier of the stage's output activations (trusted: ``control.check_authorities``). The
auditor builds its own copy of the stage as the stage's ranks build theirs (``rank_setup.prepare_rank``: the same
seed or saved weights) and keeps it at the replicas' weights: at the end of every step each replica sends it a
digest (blake2b) of the gradient its optimizer applied (after the sum over replicas, clipping and unscaling; a sole
replica, with no twin to agree with, only whether it stepped), one replica (the lowest trusted one, else the
lowest) sends that gradient whole, and the auditor, finding every digest equal to the tensor's, applies the same
optimizer step to its copy, on a thread of its own while the run goes on (``audit_copy.StageCopy.step_later``: the copy's next
recompute waits for it; a sole replica's report needs no tensor to judge, so there the step's end does not wait
for the gradient either: the copy steps once it is in, ``step_when_heard``). During the step the auditor keeps, for the
microbatches ``AuditSchedule.audited`` picks with its secret key (every one of a sender under suspicion: one left
unresolved by the step before's verdict, or, where it holds the input, one its own monitors suspect), the tensors its checks already see: the stage's input (as the verifier of the boundary before
it), the replica's output, the gradient the replica was sent and the one it sent upstream. As soon as a
microbatch's tensors are in, with the copy still at the weights the replicas compute the whole step with, it
recomputes the stage on that input and compares; a relative error past ``audit.TOLERANCE`` is an ``audit_event``
among the step's flags, which the verifiers' exchange turns into a ban at once. The rest, whose tensors are in only
at the step's end (all of them where the inputs come copied), recompute on the copy's stepper during the next step,
before the copy steps (``audit_recompute``), on CPU time nothing else wants (``audit_background``: the idle
scheduling class but while the run's thread waits on it): their verdict joins the next step's flags, from the
audited step on (``since``), except on a step that writes a checkpoint or ends the run, which audits them by its
end.

Contribution audits (``audit_contrib``). Where the auditor is the lead verifier (it hears the replicas'
contribution sketches, ``replica_checks.exchange``) and holds or is copied the stage's inputs and gradients, a
replica all of
whose microbatches of a step are audited (every one of a suspect's, or all drawn: ``--audit-every 1``) has its
contribution audited too: the same backward of the copy that gives each audited microbatch's input gradient gives
its parameter gradients, and the sketch of their sum (what the replica's ``Executor._sum_grads`` hands its
all-reduce: before clipping, the mean's 1 / M in the gradient it was sent; fp16's loss scale out of both, the
replica's sketch and the gradient this verifier keeps) is compared with the sketch the replica reported. Past the
tolerance it is a failed audit (a ban at once, proof); a pass close to none vouches for the contribution (where
judged as the sketches arrive, its contribution flag of the step is withdrawn; the contribution monitor's CUSUMs
of it restart unless it was a suspect, which knew it would be audited). An overflowed fp16 step and a replica
that trained nothing give no verdict. A stage whose auditor is another verifier
is not checked so (the lead would have to send it the sketches). The weight half of the backward is spent only
on those replicas' microbatches.

Where the auditor does not verify the stage's input boundary, the trusted ranks of the stage before copy it the
inputs: at the start the auditor sends each of them its key for that stage, point to point (never to a replica),
and at each step's end each sends it, in one message, the inputs of the audited microbatches it sent the stage,
as the consumer decoded them (``audit_inputs``). Where the stage after is trusted too, its ranks get the key as well
and copy the auditor the gradients they sent the audited microbatches, and the upstream ranks add the input
gradients the replicas sent back, as received (``audit_grads``): the auditor recomputes forward and backward once
the copies are in, and, the lead verifier, audits contributions as where it holds them. Where the stage after is
untrusted (it could send the auditor another gradient than the replica's), outputs only. Either way on zeros where
the replica's taint header says its input was dropped, and on a zero gradient where the stage after sent it tainted;
held or copied, an input gradient is compared whatever the replica's header says, one marked with no cause the
auditor sees fails (``audit_grads.judge_marked``), and none on a step the fp16 overflow vote skipped (held, fp16: the
input gradients recomputed in the step are judged at its end, ``settle_in_step_grads``). A stage
with one untrusted replica is audited this way as well. Every message is an end-of-step control message (``control.Topic.AUDIT``,
``AUDIT_INPUT``; the gradient whole leaves as the source's optimizer steps, into a receive the auditor posts before
its recomputes), outside the compiled programs like the contribution sketches; the planner prices them
(``cost_models.audit``).

Threat model. A replica cannot tell which of its microbatches are audited: it has sent a microbatch's output and
input gradient before the auditor recomputes them, the auditor asks it for nothing per microbatch, an audit's
outcome leaves the auditor only with the step's flags, and the positions come from a key it never sees; so
corrupting a share ``q`` of its tensors is caught with probability ``q / every`` per microbatch, each drawn
independently (``audit.AuditSchedule``): seeing that a step held an audit (the auditor's work shows in the step's
end) says nothing of the next microbatches. It cannot make its twin fail an audit: the twin is audited against the
gradient the twin itself reports applying, on an input a trusted rank sent. Where the replica sending that
gradient whole is trusted and its one twin exchanged with it directly (two replicas), its report is the truth: a
twin whose digest differs lies about its own state (both apply one all-reduced sum) and fails an audit
(``judge_applied``). Otherwise (no trusted replica, or three or more, whose all-reduce relays partial sums through
replicas that could hand an honest one another sum), a digest that differs from the tensor or from another
replica's stops the stage's audits instead of choosing whom to believe (recorded in the verifier's summary as
``audits.suspended``). That is what a lying replica *can* do: turn such a stage's audits off by misreporting its
digest (visible, never silent), claim its input was dropped (its output is then dropped downstream: lost data,
counted), and corrupt what the audits cannot see: a microbatch whose tensors this verifier does not check (the
gradients sent to it by an untrusted downstream stage: those audits are skipped; gradients where the inputs are
copied and the stage after is untrusted), and its own gradient contribution where the contribution audit does not
run (the contribution monitor
and ``--robust-reduce`` watch that; a sole replica's applied gradient is its own word). The contribution audit
holds a replica to the sketch *it reports*: one that sums a poisoned contribution into the all-reduce while
reporting the sketch of the honest one passes it (the sketch is its word, as the monitor's input is); what the
audit adds is that a replica which reports what it sums (every fault, and an attacker that does not lie about
itself, as ``dir=params`` does here) is proven on the first fully audited step instead of flagged by a CUSUM
after several, and that an honest replica the CUSUM drifted against is cleared. The liar's reach into the sum
stays what the robust reduce bounds it to (``--robust-reduce``: the clipping radius), and the applied-gradient
digests still prove the replicas stepped with one sum. Like every check of this verifier, an audit takes the copy a replica
sends it for what the consumer received (the transfers are not signed, except where the stage before is
untrusted: the replicas then forward the audited inputs under that stage's signatures, ``audit_signed``). Nothing
received is unpickled or executed: keys and digests are int64 tensors, the gradient and the input copies float
tensors of sizes the plan fixes, received into buffers of that shape. A resumed run's copies start from the
checkpoint the replicas resume from (``recovery.rank_checkpoint.resume_copies``). Not audited: a stage the
planner's rule rules out (the first or last stage, a sole replica whose link tests check it), a stage whose
forward updates its buffers (BatchNorm: the copy, seeing only the audited microbatches, would drift).
"""
from __future__ import annotations

import secrets
from collections.abc import Sequence
from concurrent.futures import CancelledError, Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from planner.integrity import audit
from planner.runtime.rank import (
    audit_contrib,
    audit_grads,
    audit_inputs,
    audit_recompute,
    audit_signed,
)
from planner.runtime.rank.audit_applied import (
    DIGEST_WORDS,
    digest,
    judge_applied,
    stepped_only,
)
from planner.runtime.rank.audit_background import Background, urgent
from planner.runtime.rank.audit_copy import StageCopy
from planner.runtime.rank.audit_recompute import ROLES, Deferred
from planner.runtime.rank.audit_recompute import error as _error  # noqa: F401 - the comparison, as tests name it
from planner.runtime.rank.random_ops import random_op
from planner.runtime.rank.rank_setup import (
    make_lr_schedule,
    make_optimizer,
    prepare_rank,
)
from planner.runtime.wire import comm, control
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
    audit (``simulate.audit_site``; the same on every rank: the plan and the run's options decide). ``every`` (``--audit-every``): one in this
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


# ----------------------------------------------------------------------------- during the step (auditor)

def _role(st: AuditedStage, boundary: int, d: str, sender: int) -> str | None:
    """What a checked tensor is to the audited stage: its input, its output, the gradient sent to it, the one
    it sent upstream (None: nothing of it)."""
    k = st.stage
    if boundary == k - 1 and d == "F":
        return "x"
    if boundary == k and d == "F" and sender in st.replicas:
        return "y"
    if boundary == k and d == "B":
        return "g"
    if boundary == k - 1 and d == "B" and sender in st.replicas:
        return "gin"
    return None


def _audited(ex: Any, st: AuditedStage, mb: int) -> bool:
    """On the auditor: ``mb`` is audited, or every one of a suspect's: one the last step's verdict left unresolved
    or named a suspect (any verifier's flag or alert of it, or a contribution CUSUM past half its alarm:
    ``audit_inputs.agreed_suspects``), known to every rank alike, so from copies or signed inputs too, where the
    upstream ranks or the replicas send what the same rule picks."""
    suspected = ex.plan.owner(st.stage, mb) in audit_inputs.agreed_suspects(ex)
    return audit_inputs.scheduled(ex.plan, ex.audits.schedules[st.stage], st.stage, mb, ex.step, suspected=suspected)


def observe(ex: Any, boundary: int, d: str, mb: int, sender: int, tensors: Sequence[torch.Tensor], *,
            dropped: bool, tainted: bool = False) -> None:
    """Keep a tensor this verifier checked where an audit of ``mb`` needs it. ``dropped``: the consumer drops
    it (flagged or tainted), so the stage computed on zeros in its place; ``tainted``: its sender says it
    computed it on zeros (its input was dropped)."""
    audits: RuntimeAudits | None = getattr(ex, "audits", None)
    if audits is None:
        return
    for k, st in audits.auditing(ex.rank).items():
        role = _role(st, boundary, d, sender)
        if role is None or (role in ("x", "g") and sender not in audits.trusted) or not _audited(ex, st, mb):
            continue   # an untrusted neighbour could send this verifier another input than the replica's
        if st.copied_from and role != "y":
            continue   # audited from copies: the rest comes copied at the step's end (``audit_inputs``, ``audit_grads``)
        zero = dropped and role in ("x", "g")
        if (role == "y" and tainted) or (zero and role == "x"):
            audits.tainted.add((k, mb))   # its input dropped (or, the replica's word, its output computed on zeros)
        elif zero:
            audits.g_tainted.add((k, mb))   # the gradient sent to it dropped: the replica backpropagates zeros
        elif role == "gin" and tainted:
            audits.gin_tainted.add((k, mb))   # judged once all is in (``audit_grads.judge_marked``)
        audits.kept[(k, role, mb)] = [torch.zeros_like(t) if zero else t.detach().clone() for t in tensors]
        if all((k, r, mb) in audits.kept for r in ROLES):   # complete: audit now, while the pipeline runs on
            if (k, mb) in audits.gin_tainted:   # marked with no cause seen: a made-up drop, as from copies
                audit_grads.judge_marked(audits.kept, k, mb,
                                         caused=(k, mb) in audits.tainted or (k, mb) in audits.g_tainted,
                                         held=True)
            with ex._timed("verify"):
                _audit_stage(ex, st, ex.step, only=mb)


def keep_applied(ex: Any, idle: Sequence[torch.nn.Parameter]) -> None:
    """On a replica of an audited stage, right before its optimizer steps: the gradient it steps with."""
    audits: RuntimeAudits | None = getattr(ex, "audits", None)
    if audits is None or ex.stage is None or ex.info.stage not in audits.stages or ex.optimizer is None:
        return
    if len(idle) >= len(ex.params):
        return
    skipped = {id(p) for p in idle}
    values = [(p.grad if p.grad is not None and id(p) not in skipped else torch.zeros_like(p)).detach().float()
              .reshape(-1) for p in ex.params]
    present = torch.tensor([float(p.grad is not None and id(p) not in skipped) for p in ex.params],
                           device=values[0].device)
    _sent(audits)   # last step's gradient left ``outbox_flat`` before it is rewritten
    if audits.outbox_flat is None:
        audits.outbox_flat = torch.empty(sum(v.numel() for v in values) + len(values), device=values[0].device)
    # into last step's buffer, whose send (``_sent``) and digest are done: no fresh pages to fault in
    audits.applied = torch.cat([*values, present], out=audits.outbox_flat)
    st = audits.stages[ex.info.stage]
    if ex.rank == st.source and ex.rank != st.auditor:   # on its way while the optimizer steps (``end_step``)
        audits.sending = comm.send([audits.applied], peer=st.auditor, doing=_sending(st, ex.step),
                                   **_whole_tag(st))
    if audits.hasher is not None:   # the twins' digests: hashed meanwhile too (hashlib lets go of the GIL)
        audits.claim = audits.hasher.submit(digest, audits.applied)


def _whole_tag(st: AuditedStage) -> dict[str, Any]:
    """The tag of stage ``st``'s applied gradient, sent whole (its digests': index ``2 k``)."""
    return control._tag_args(control.Topic.AUDIT, 2 * st.stage + 1)


def _sending(st: AuditedStage, step: int) -> str:
    return f"sending stage {st.stage}'s applied gradient whole to its auditor rank {st.auditor} (step {step})"


# ----------------------------------------------------------------------------- end of step

def end_step(ex: Any, step: int) -> None:
    """Every rank, before the verifiers exchange flags: the auditor audits the step's kept microbatches (its
    flags join the step's), then hears the replicas' applied gradient and steps its copy; replicas send it."""
    audits: RuntimeAudits | None = getattr(ex, "audits", None)
    if audits is None:
        return
    applied, audits.applied = audits.applied, None
    claim, audits.claim = audits.claim, None
    _report_random(ex, audits, step)
    overflowed = audit_grads.overflow_skipped(ex)
    settle_in_step_grads(ex, step, overflowed=overflowed)
    for k, st in sorted(audits.stages.items()):
        if ex.rank in st.copied_from:
            with ex._timed("comm"):
                (audit_signed.forward if st.signed_by else audit_inputs.send_inputs)(ex, st, step)
        if ex.rank in st.grads_from:
            with ex._timed("comm"):
                audit_grads.send_grads(ex, st, step)
        if ex.rank == st.auditor:
            if st.copied_from and st.stage in audits.copies:
                with ex._timed("comm"):
                    (audit_signed.hear if st.signed_by else audit_inputs.hear_inputs)(ex, st, step)
                    if st.grads_from:
                        audit_grads.hear_grads(ex, st, step)
            if overflowed:   # an honest replica's input gradient may overflow where its copy's does not
                audit_grads.drop_input_grads(audits.kept, st.stage)
            with ex._timed("verify"):
                _collect(ex, st, step)   # last step's, recomputed meanwhile: their verdict joins this step's
                inline = audits.inline_at(step)
                if inline:
                    _audit_stage(ex, st, step)
            with ex._timed("comm"):
                _sync_copy(ex, st, step, audit_first=None if inline else _deferring(ex, st, step))
            with ex._timed("verify"):
                _settle_contrib(ex, st, step)
        elif ex.rank in st.replicas:
            with ex._timed("comm"):
                _send_applied(ex, st, step, applied, claim)
    audits.kept, audits.outbox, audits.tainted = {}, {}, set()
    audits.gin_outbox, audits.grad_outbox, audits.gin_tainted, audits.g_tainted = {}, {}, set(), set()


def post_hearing(ex: Any, step: int) -> None:
    """The auditor's receives of its stages' applied gradients, posted as its program ends (before the replicas'
    sketches and its recomputes, as priced): the gradients travel meanwhile (the source sent each as it stepped,
    ``keep_applied``)."""
    audits: RuntimeAudits | None = getattr(ex, "audits", None)
    if audits is None:
        return
    for k, st in audits.stages.items():
        copy = audits.copies.get(k)
        if st.auditor == ex.rank and st.source != ex.rank and copy is not None:
            inbox = _free_inbox(audits, k, copy.flat_size, ex.device)
            tag = _whole_tag(st)
            receive = dist.P2POp(dist.irecv, inbox, st.source, tag=comm.make_tag(**tag),
                                 group=comm.channel_group(tag["kind"], tag["boundary"]))
            audits.hearing[k] = comm.post([receive], [inbox], peer=st.source,
                                          doing=f"hearing stage {k}'s applied gradient from rank {st.source} "
                                                f"(step {step})")


def _free_inbox(audits: RuntimeAudits, stage: int, size: int, device: torch.device) -> torch.Tensor:
    """The receive buffer of ``stage``'s next applied gradient: not the one its copy's last step read (that step
    may still run on the stepper, the gradients views of it), so posting never waits for it. Allocated once each:
    fresh pages cost a fill."""
    boxes = audits.inboxes.setdefault(stage, [])
    i = 1 - audits.stepped_from.get(stage, 1)
    while len(boxes) <= i:
        boxes.append(torch.empty(size, device=device))
    audits.filling[stage] = i
    return boxes[i]


def finish(ex: Any) -> None:
    """At the run's end: the copies' last steps done (an error in one raised here, not lost), the threads gone."""
    audits: RuntimeAudits | None = getattr(ex, "audits", None)
    if audits is None:
        return
    try:
        _sent(audits)
        for deferred in audits.deferred.values():   # left by a run stopped early (a ban): errors raised, no verdict
            with urgent(audits.background):
                deferred.outcomes.result()
        for copy in audits.copies.values():
            copy.settle()
    finally:
        pools = {id(e): e for e in (audits.hasher, *(c.stepper for c in audits.copies.values())) if e is not None}
        for pool in pools.values():
            pool.shutdown(wait=False)


def unaudited_since(ex: Any, *, wait_s: float = 0.0) -> int | None:
    """The earliest step whose audits this rank (an auditor) has out with no passing verdict (None: none),
    waiting up to ``wait_s`` for each step's recomputes on the copy's stepper (local work: a peer's failure does
    not stop it). A state of that step or later holds updates no audit has vouched for: a survivor checkpoint of
    it is not to be resumed from (``recovery.survivors``)."""
    audits: RuntimeAudits | None = getattr(ex, "audits", None)
    if audits is None:
        return None
    with urgent(audits.background):
        out = [d.step for d in audits.deferred.values() if not _passed(d, wait_s)]
    return min(out, default=None)


def _passed(deferred: Deferred, wait_s: float) -> bool:
    """Whether ``deferred``'s recomputes finished within ``wait_s`` and every one passed (one still running, cancelled
    or failed in torch vouches for nothing; the peer's failure stays the error the rank reports)."""
    try:
        return all(o.passed for o in deferred.outcomes.result(timeout=wait_s))
    except (TimeoutError, CancelledError, RuntimeError, ValueError):
        return False


def _report_random(ex: Any, audits: RuntimeAudits, step: int) -> None:
    """An auditor's stages that draw random numbers, in its summary once (their audits never run)."""
    verifier = ex.verify.verifier if ex.verify is not None else None
    for k, copy in audits.copies.items():
        if copy.random is not None and k not in audits.suspended and verifier is not None:
            audits.suspended[k] = step
            verifier.suspend_audits(k, step, why=f"the stage draws random numbers ({copy.random}): a recompute "
                                                 f"would draw others")


def _send_applied(ex: Any, st: AuditedStage, step: int, applied: torch.Tensor | None,
                  claim: Future | None = None) -> None:
    """A replica's report of its update to the auditor (its digest, ``claim`` where ``keep_applied`` hashed it
    already) and, from the source, the gradient whole (on its way since ``keep_applied``; else zeros, no step)."""
    doing = f"sending stage {st.stage}'s applied gradient digest to its auditor rank {st.auditor} (step {step})"
    ranks = sorted({*st.replicas, st.auditor})
    sending = None
    if ex.rank == st.source:
        sending, ex.audits.sending = ex.audits.sending, None
        if sending is None:   # it took no step (``keep_applied`` sent nothing): zeros, before the digest as ever
            _sent(ex.audits)   # last step's, still in flight: in order, and never dropped unwaited
            size = sum(p.numel() for p in ex.params) + len(ex.params)
            sending = comm.send([torch.zeros(size, device=ex.device)], peer=st.auditor, doing=_sending(st, step),
                                **_whole_tag(st))
    if claim is not None:
        report = claim.result()
    else:
        report = digest(applied) if len(st.replicas) > 1 else stepped_only(applied)
    control.gather_to(report.to(ex.device), dst=st.auditor, me=ex.rank, ranks=ranks,
                      topic=control.Topic.AUDIT, device=ex.device, index=2 * st.stage, doing=doing)
    # the transfer goes on past the step's end: waited before the buffer is rewritten (``keep_applied``, ``finish``)
    ex.audits.in_flight = sending


def _sent(audits: RuntimeAudits) -> None:
    """The source's last applied gradient received by the auditor (its send waited)."""
    in_flight, audits.in_flight = audits.in_flight, None
    if in_flight is not None:
        in_flight.wait()


def _sync_copy(ex: Any, st: AuditedStage, step: int, audit_first: Any = None) -> None:
    """The replicas' digests and the source's gradient; the copy steps as ``judge_applied`` says, a replica it
    proves lying fails an audit. ``audit_first``: queues the step's deferred recomputes on the copy's stepper,
    called right before the copy's step is queued there (after the early digest, which the step's end awaits)."""
    audits: RuntimeAudits = ex.audits
    copy = audits.copies.get(st.stage)
    ranks = sorted({*st.replicas, st.auditor})
    doing = f"hearing stage {st.stage}'s applied gradient from its replicas (step {step})"
    assert copy is not None   # every auditor builds a copy of each stage it audits (``build``)
    hearing = audits.hearing.pop(st.stage, None)
    hashed = None if st.stage in audits.suspended else _hashed_early(audits.hasher, st, hearing)
    got = control.gather_to(torch.zeros(1 + DIGEST_WORDS, dtype=torch.int64, device=ex.device), dst=st.auditor,
                            me=ex.rank, ranks=ranks, topic=control.Topic.AUDIT, device=ex.device,
                            index=2 * st.stage, doing=doing)
    filled = audits.filling.pop(st.stage, None) if hearing is not None else None
    if hearing is not None and len(st.replicas) == 1:
        assert got is not None and filled is not None
        control.checked_ints({st.source: got[st.source]}, what="applied-gradient report",
                             expected="1 (stepped) or 0 first", allowed=lambda _, v: v in (0, 1))
        # a sole replica's report is judged without its tensor (``judge_applied``): the copy steps once the
        # gradient is in, on its stepper, and the step's end (the verdict) does not wait for the transfer
        if audit_first is not None:
            audit_first()
        copy.step_when_heard(hearing, st.stage not in audits.suspended and int(got[st.source][0]) == 1)
        audits.stepped_from[st.stage] = filled
        return
    if hearing is not None:
        flat = hearing.wait()[0]
    else:   # not posted ahead (``post_hearing``); the value only gives the shape and dtype: not filled
        whole = control.gather_to(torch.empty(copy.flat_size, device=ex.device), dst=st.auditor, me=ex.rank,
                                  ranks=[st.source, st.auditor], topic=control.Topic.AUDIT, device=ex.device,
                                  index=2 * st.stage + 1, doing=doing)
        assert whole is not None
        flat = whole[st.source]
    assert got is not None
    control.checked_ints({r: got[r] for r in st.replicas}, what="applied-gradient digest",
                         expected="1 (stepped) or 0 first", allowed=lambda _, v: v in (0, 1))
    if st.stage in audits.suspended:
        return
    judged = judge_applied({r: tuple(got[r].cpu().tolist()) for r in st.replicas}, flat, source=st.source,
                           trusted=audits.trusted, hashed=None if hashed is None else hashed.result())
    verifier = ex.verify.verifier if ex.verify is not None else None
    if judged.liars and verifier is not None:
        for r in judged.liars:
            verifier.record_audit(r, step, passed=False)
        verifier.add_flags(step, [audit.applied_gradient_event(step=step, stage=st.stage, sender=r)
                                  for r in judged.liars])
    if judged.suspend:
        if audit_first is not None:   # this step's audits still run: the copy stays at its weights
            audit_first()
        audits.suspended[st.stage] = step   # someone lied about its update and nobody is believed: audit no more
        if verifier is not None:
            verifier.suspend_audits(st.stage, step)
        return
    if audit_first is not None:
        audit_first()
    copy.step_later(flat if judged.stepped else None)
    if filled is None:
        audits.stepped_from.pop(st.stage, None)   # it steps from a buffer of its own: both inboxes free
    else:
        audits.stepped_from[st.stage] = filled


def _hashed_early(hasher: Executor | None, st: AuditedStage, hearing: Any) -> Future | None:
    """The ``digest`` of a gradient already in (sent as the source stepped), hashed on the auditor's digest thread
    while the twins' digests come (None: no twin to compare with, or not in yet)."""
    if hearing is None or not hearing.completed() or len(st.replicas) < 2 or hasher is None:
        return None
    return hasher.submit(digest, hearing.wait()[0])


def _audit_stage(ex: Any, st: AuditedStage, step: int, *, only: int | None = None) -> None:
    """Recompute the kept microbatches (``only`` that one) on the copy, in line, flag each output or input
    gradient past the tolerance among the step's flags, and forget them. The copy holds the weights the replicas
    computed the whole step with (it steps after the step's end), so a microbatch is audited as soon as its
    tensors are in."""
    audits: RuntimeAudits = ex.audits
    copy = audits.copies.get(st.stage)
    verifier = ex.verify.verifier if ex.verify is not None else None
    if copy is None or copy.drifts or verifier is None or st.stage in audits.suspended:
        return
    taken = audit_recompute.take_kept(audits.kept, st.stage, only)
    outcomes = audit_recompute.recompute(copy, taken, **_recompute_args(ex, st, step))
    if only is not None and getattr(ex, "scaler", None) is not None:
        # fp16, in the step: its input gradients' verdicts wait for the overflow vote at the step's end
        # (``settle_in_step_grads``): an overflow inside an honest replica's backward is none of its copy's
        audits.in_step_grads.extend(o for o in outcomes if o.boundary == st.stage - 1)
        outcomes = [o for o in outcomes if o.boundary != st.stage - 1]
    audit_recompute.record(verifier, outcomes, at_step=step)


def settle_in_step_grads(ex: Any, step: int, *, overflowed: bool) -> None:
    """At the step's end, once the fp16 overflow vote is known: the input gradients audited in the step
    (``_audit_stage``) recorded among the step's flags, or, on a step the vote skipped, none (as from copies:
    ``audit_grads.drop_input_grads``; the step applied nothing)."""
    audits: RuntimeAudits = ex.audits
    outcomes, audits.in_step_grads = audits.in_step_grads, []
    verifier = ex.verify.verifier if ex.verify is not None else None
    if outcomes and not overflowed and verifier is not None:
        audit_recompute.record(verifier, outcomes, at_step=step)


def _tolerance(ex: Any) -> float:
    return audit.TOLERANCE.get(str(ex.precision.dtype).removeprefix("torch."), audit.TOLERANCE["float32"])


def _recompute_args(ex: Any, st: AuditedStage, step: int) -> dict[str, Any]:
    return {"stage": st.stage, "step": step, "owner": lambda mb: ex.plan.owner(st.stage, mb),
            "precision": ex.precision, "device": ex.device, "tolerance": _tolerance(ex),
            "contrib": _contrib_sums(ex, st, step)}


# ----------------------------------------------------------------------------- contribution audits (the lead's)

def _contrib_sums(ex: Any, st: AuditedStage, step: int) -> audit_contrib.ContribSums | None:
    """``st``'s contribution sums of ``step`` (made on first use), where this auditor is the lead verifier (it
    alone hears the replicas' sketches, ``replica_checks.exchange``), the stage has twins (a sole replica sends
    no sketch) and it has their gradients, held or copied (``audit_grads``; not from signed inputs or copied
    inputs alone: outputs only); None elsewhere."""
    audits: RuntimeAudits = ex.audits
    if ex.rank != min(ex.groups.verifier_ranks) or len(st.replicas) < 2 or st.signed_by \
            or (st.copied_from and not st.grads_from):
        return None
    sums = audits.contrib.get(st.stage)
    if sums is None or sums.step != step:
        owned = audit_contrib.full_replicas(ex.plan, st.stage, lambda mb: _audited(ex, st, mb))
        suspects = audit_inputs.agreed_suspects(ex)
        sums = audits.contrib[st.stage] = audit_contrib.ContribSums(
            stage=st.stage, step=step, owned=owned, predictable=frozenset(r for r in owned if r in suspects))
    return sums


def contributions_heard(ex: Any, stage: int, step: int, sketches: dict[int, torch.Tensor]) -> set[int]:
    """At the lead verifier, as ``stage``'s replicas' contribution sketches of ``step`` come in
    (``replica_checks.exchange``): each fully audited replica's, whose recomputed sum is complete, judged now
    (failed: an audit flag of the step; passed close to none: vouched, returned, its contribution flags of the
    step withdrawn by the caller); the others' kept until their recomputes end (``_settle_contrib``)."""
    audits: RuntimeAudits | None = getattr(ex, "audits", None)
    st = audits.auditing(ex.rank).get(stage) if audits is not None else None
    verifier = ex.verify.verifier if ex.verify is not None else None
    sums = _contrib_sums(ex, st, step) if st is not None and verifier is not None else None
    if sums is None:
        return set()
    outcomes = []
    for r, sent in sorted(sketches.items()):
        if not sums.wants(r):
            continue
        if not sums.complete(r):
            sums.heard[r] = sent
        elif (judged := audit_contrib.judge(sums, r, sent, tolerance=_tolerance(ex))) is not None:
            outcomes.append(judged)
    audit_contrib.record(verifier, getattr(ex, "_contributions", None), sums, outcomes, at_step=step)
    return {o.sender for o in outcomes if o.vouched}


def _settle_contrib(ex: Any, st: AuditedStage, step: int) -> None:
    """At the step's end, after its audits are in line or queued: the sketches still waiting for their sums are
    judged now (in line), or once the recomputes queued for the next step are collected (``_collect``)."""
    audits: RuntimeAudits = ex.audits
    sums = audits.contrib.pop(st.stage, None)
    deferred = audits.deferred.get(st.stage)
    if sums is None or (deferred is not None and deferred.contrib is sums):
        return
    audit_contrib.settle(ex.verify.verifier if ex.verify is not None else None, getattr(ex, "_contributions", None),
                         sums, at_step=step, tolerance=_tolerance(ex))


def _deferring(ex: Any, st: AuditedStage, step: int) -> Any:
    """What queues the step's kept microbatches of ``st`` on its copy's stepper (``audit_recompute.defer``), to
    recompute while the next step runs, before the copy steps; the tensors leave ``kept`` now. A copy without a
    stepper recomputes them in line."""
    audits: RuntimeAudits = ex.audits
    copy = audits.copies.get(st.stage)
    verifier = ex.verify.verifier if ex.verify is not None else None
    if copy is None or copy.drifts or verifier is None or st.stage in audits.suspended:
        return None
    taken = audit_recompute.take_kept(audits.kept, st.stage)

    def queue() -> None:
        deferred = audit_recompute.defer(copy, taken, **_recompute_args(ex, st, step))
        if deferred is not None:
            audits.deferred[st.stage] = deferred
        elif copy.stepper is None:
            audit_recompute.record(verifier, audit_recompute.recompute(copy, taken, **_recompute_args(ex, st, step)),
                                   at_step=step)
    return queue


def _collect(ex: Any, st: AuditedStage, step: int) -> None:
    """The verdict of ``st``'s audits deferred from the step before (recomputed on the stepper meanwhile; waited
    for only if not done yet): among this step's flags, each failed one since its audited step."""
    audits: RuntimeAudits = ex.audits
    deferred = audits.deferred.pop(st.stage, None)
    verifier = ex.verify.verifier if ex.verify is not None else None
    if deferred is None or verifier is None:
        return
    with urgent(audits.background):   # due now: at the normal class while waited for
        outcomes = deferred.outcomes.result()
    audit_recompute.record(verifier, outcomes, at_step=step, hooks=ex.verify)
    audit_contrib.settle(verifier, getattr(ex, "_contributions", None), deferred.contrib, at_step=step,
                         tolerance=_tolerance(ex))
