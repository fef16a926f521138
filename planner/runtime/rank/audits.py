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

Here: the step's end and the run's. Which stages are audited and each rank's state: ``audit_state``; the kept
tensors, the recomputes and their verdicts: ``audit_verdicts``; the applied gradient and the copy's step:
``audit_sync``.
"""
from __future__ import annotations

from typing import Any

from planner.runtime.rank import (
    audit_grads,
    audit_inputs,
    audit_signed,
)
from planner.runtime.rank.audit_background import urgent
from planner.runtime.rank.audit_recompute import error as _error  # noqa: F401 - the comparison, as tests name it
from planner.runtime.rank.audit_state import RuntimeAudits
from planner.runtime.rank.audit_sync import _send_applied, _sent, _sync_copy
from planner.runtime.rank.audit_verdicts import (
    _audit_stage,
    _collect,
    _deferring,
    _settle_contrib,
    settle_in_step_grads,
)


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


def _report_random(ex: Any, audits: RuntimeAudits, step: int) -> None:
    """An auditor's stages that draw random numbers, in its summary once (their audits never run)."""
    verifier = ex.verify.verifier if ex.verify is not None else None
    for k, copy in audits.copies.items():
        if copy.random is not None and k not in audits.suspended and verifier is not None:
            audits.suspended[k] = step
            verifier.suspend_audits(k, step, why=f"the stage draws random numbers ({copy.random}): a recompute "
                                                 f"would draw others")
