"""The executor's verification: scoring boundary tensors, verdicts, and the end-of-step exchange of bans.

Verification (when the plan has verifiers and it is not switched off): every
transfer of a boundary tensor carries a 1-element taint header (1 = this
microbatch was already dropped upstream). A verifier scores the copy it gets
and sends ``[flagged, tainted]`` to the consumer. A flagged or tainted
microbatch is dropped: the consumer zeroes the tensor, the last stage
multiplies its loss by 0, and the taint header it sends on is 1. At the end of
the step the verifier ranks exchange their flags and resolve blame and bans, and every rank
learns the outcome from the lead verifier alone, point to point (``planner.runtime.wire.bans``): the
bans, the senders whose flags are unresolved, and how many microbatches trained.

Deferred verdicts (the default): the consumer only posts the verdict's receive
at ``VERDICT`` and computes with the tensor at once, so the check runs while it
computes instead of before; it waits for the verdict where the computation's
result would first leave the microbatch's own state:

* forward: before the output is sent (``SEND_F``, a verifier's copy included),
  before the last stage's backward reads the loss, at the latest before the
  optimizer. A dropped microbatch's forward is run again on zeros (restoring
  the RNG and the buffers first), which gives exactly what waiting first gives.
* backward: the accumulated parameter gradients are set aside (no copy) and the
  backward leaves only this microbatch's in ``.grad``; the verdict is awaited
  before the input gradient is sent, before the next backward, at the latest
  before the all-reduce / optimizer. Honest: the set-aside gradients plus this
  one (the same in-place sum autograd would do); dropped: the set-aside ones
  alone, and a zero input gradient (what back-propagating zeros gives).

``defer_verdicts=False`` waits for each verdict at ``VERDICT`` (the same
results; ``stagewise run --wait-verdicts``).
"""
from __future__ import annotations

import torch

from planner.instructions import Instruction
from planner.integrity import audit
from planner.integrity.blame import flatten_events
from planner.integrity.hooks import FLAG_EVENTS_SCHEMA
from planner.runtime.rank import audit_sync, audit_verdicts, audits, replica_checks
from planner.runtime.rank.deferred import merge_grads
from planner.runtime.rank.executor_p2p import ACT_KINDS
from planner.runtime.wire import bans as ban_exchange
from planner.runtime.wire import comm, control, messages
from planner.runtime.wire.comm import Pending


class Verification:
    """Verifier checks, verdicts (deferred or awaited) and blame.

    Mixed into :class:`~planner.runtime.rank.executor.Executor`, whose per-step state (``_reset``) it reads
    and writes.
    """

    def _verify(self, ins: Instruction) -> None:
        """Score the copy of a boundary tensor; keep the verdict here or send it to the consumer."""
        assert self.verify is not None
        d, mb, boundary = ins.direction, ins.mb, ins.boundary
        assert mb is not None and boundary is not None
        sender_stage = boundary if d == "F" else boundary + 1
        if ins.peer is not None:  # a copy sent by the sender
            pending = self._post(d, peer=ins.peer, boundary=boundary, mb=mb,
                                 doing=f"receiving the copy for {ins} (step {self.step})")
            assert pending is not None
            received = self._wait(pending)
            tensors, tainted_in = self._decoded(d, boundary, received[:-1]), bool(received[-1].item())
            sender = ins.peer
        elif self.info.stage == sender_stage:  # a trusted sender checking what it just sent
            self._settle_sent(d, mb)
            tensors = self._delivered(d, mb)
            tainted_in = mb in (self.dropped_f if d == "F" else self.dropped_f | self.dropped_b)
            sender = self.rank
        else:  # the consumer checking what it received
            tensors = self._take((d, mb))
            tainted_in = self.taint_in.get((d, mb), False)
            sender = self.plan.owner(sender_stage, mb)
        if d == "B" and self.scaler is not None:  # fp16 gradients carry the loss scale: score them without it
            tensors = [t.float() / self.scaler.scale for t in tensors]
        with self._timed("verify"):
            flagged, tainted = self.verify.check(boundary, d, tensors, step=self.step, mb=mb, sender=sender,
                                                 tainted=tainted_in)
        self.flagged += int(flagged)
        audit_verdicts.observe(self, boundary, d, mb, sender, tensors, dropped=flagged or tainted, tainted=tainted_in)
        if ins.dest is None:
            if flagged or tainted:
                self._drop(d, mb)
            return
        verdict = torch.tensor([int(flagged), int(tainted)], dtype=torch.int64, device=self.device)
        _, _, verdict_kind = ACT_KINDS[d]
        with self._timed("comm"):
            self.sends.append(comm.send([verdict], peer=ins.dest, kind=verdict_kind, boundary=boundary, mb=mb,
                                        doing=f"sending the verdict of {ins} (step {self.step})"))

    def _verdict(self, ins: Instruction) -> None:
        """Post the receive of a verifier's verdict on a tensor this rank is about to use; wait
        for it here only when not deferring (else where the tensor's results leave the rank)."""
        d, mb = ins.direction, ins.mb
        assert mb is not None and ins.boundary is not None
        _, _, verdict_kind = ACT_KINDS[d]
        with self._timed("comm"):
            pending = comm.recv([((2,), torch.int64)], peer=ins.peer, kind=verdict_kind, boundary=ins.boundary, mb=mb,
                                device=self.device, doing=f"waiting for the verdict {ins} (step {self.step})")
        if self.defer_verdicts:
            self.verdicts[(d, mb)] = pending
        else:
            self._conclude(d, mb, pending)

    def _conclude(self, d: str, mb: int, pending: Pending) -> bool:
        """Wait for a verdict and drop the microbatch if it is flagged or tainted; True if dropped now."""
        flagged, tainted = (bool(v) for v in self._wait(pending)[0].tolist())
        if flagged or tainted:
            already = mb in (self.dropped_f if d == "F" else self.dropped_b)
            self._drop(d, mb)
            return not already
        return False

    def _settle_forward(self, mb: int) -> None:
        """Await the deferred verdict on ``mb``'s input; if it drops the microbatch, run its forward
        again on zeros from the state it started from (what waiting first would have computed)."""
        pending = self.verdicts.pop(("F", mb), None)
        if pending is None:
            return
        replay = self.replays.pop(mb, None)
        if not self._conclude("F", mb, pending) or mb not in self.saved or replay is None:
            return
        replay.restore(self.device)
        inputs, _ = self.saved.pop(mb)
        self._run_forward(mb, [torch.zeros_like(t, requires_grad=False) for t in inputs])

    def _settle_backward(self) -> None:
        """Await the verdict on the held backward's incoming gradient and merge its parameter
        gradients (or drop them, and its input gradient, if the verdict drops the microbatch)."""
        held, self.held = self.held, None
        if held is None:
            return
        dropped = self._conclude("B", held.mb, self.verdicts.pop(("B", held.mb)))
        merge_grads(self.params, held.stash, keep=not dropped)
        if dropped and held.mb in self.input_grads:
            self.input_grads[held.mb] = [torch.zeros_like(g) for g in self.input_grads[held.mb]]

    def _settle_sent(self, d: str, mb: int) -> None:
        """Before (direction, mb)'s output or input gradient leaves: its taint header needs the forward's
        verdict, and a backward's also the backward's."""
        self._settle_forward(mb)
        if d == "B":
            self._settle_backward()

    def _settle_all(self) -> None:
        """Every verdict still out (before the gradients are summed or used, and at the step's end)."""
        self._settle_backward()
        for d, mb in list(self.verdicts):
            if d == "F":
                self._settle_forward(mb)
            else:
                self._conclude(d, mb, self.verdicts.pop((d, mb)))

    def _end_verification(self, step: int) -> set[int]:
        """Verifier ranks exchange flags and resolve blame; then the lead verifier, having heard how many
        microbatches trained from the first-stage ranks, sends every rank the step's verdict (bans,
        unresolved flags, what trained). Returns the ranks banned so far."""
        if self.verify is None:
            return set()
        audit_sync.post_hearing(self, step)       # the applied gradients travel while the rest is exchanged
        replica_checks.exchange(self, step)   # the replicas' gradient sketches join the step's flags
        audits.end_step(self, step)           # and the auditors' failed audits
        flags = self._resolve_blame(step)
        lead = min(self.groups.verifier_ranks)
        with self._timed("comm"):
            trained = self._gather_trained(lead, step)
            verdict = None
            if self.rank == lead:
                verifier = self.verify.verifier
                self.verify.record_drops(step, flags, dropped=self.plan.num_microbatches - trained)
                verdict = ban_exchange.encode(self.plan.num_ranks, unresolved=verifier.unresolved(),
                                              bans=verifier.ban_records(), trained=trained,
                                              suspects=self._suspects(flags)).to(self.device)
            verdict = control.send_from(verdict, src=lead, me=self.rank, ranks=range(self.plan.num_ranks),
                                        topic=control.Topic.VERDICTS,
                                        shape=(ban_exchange.verdict_size(self.plan.num_ranks),),
                                        dtype=torch.int64, device=self.device,
                                        doing=f"hearing step {step}'s verdict from the lead verifier rank {lead}")
        got = ban_exchange.decode(verdict.cpu())
        self.bans, self.unresolved, self.suspects = got.bans, got.unresolved, got.suspects
        if got.trained == 0:
            self.untrained_steps.append(step)
        return set(self.bans)

    def _suspects(self, flags: list) -> frozenset[int]:
        """At the lead verifier: the senders every verifier's flags and alerts of the step name (those an audit
        refuted are gone by then) and those whose contribution is suspect (``contributions.SUSPECT_H``): the next
        step audits every one of their microbatches (``audit_inputs.agreed_suspects``)."""
        named = audit.flagged_senders(flatten_events(flags))
        contrib = getattr(self, "_contributions", None)
        if contrib is not None:
            named |= {r for k in range(self.plan.num_stages) for r in contrib.suspects(k)}
        return frozenset(named)

    def _gather_trained(self, lead: int, step: int) -> int:
        """At the lead verifier: how many microbatches trained on the first stage, as its (trusted) ranks
        count them; a count past a rank's microbatches is a protocol breach. 0 elsewhere."""
        senders = sorted({*self._first_stage_ranks, lead})
        if self.rank not in senders:
            return 0
        mine = torch.tensor([self._trained_here()], dtype=torch.int64, device=self.device)
        got = control.gather_to(mine, dst=lead, me=self.rank, ranks=senders, topic=control.Topic.TRAINED,
                                device=self.device, doing=f"counting what trained in step {step}")
        if got is None:
            return 0
        counts = control.checked_ints(
            got, what="count of trained microbatches", expected="at most the rank's microbatches of a step",
            allowed=lambda r, v: 0 <= v <= len(self.plan.ranks[r].microbatches))
        return sum(v for r, v in counts.items() if r in self._first_stage_ranks)

    def _trained_here(self) -> int:
        """This rank's microbatches of the step that were not dropped (0 on a verifier-only rank)."""
        if self.stage is None:
            return 0
        dropped = self.dropped_f | self.dropped_b
        return sum(1 for mb in self.info.microbatches if mb not in dropped)

    def _resolve_blame(self, step: int) -> list:
        """Exchange flags among the verifier ranks and resolve blame (verifier ranks only); returns every
        verifier's flags of the step (none elsewhere)."""
        assert self.verify is not None
        if self.verify.verifier is None:
            return []
        with self._timed("verify"):
            flags = self.verify.step_flags(step)
        with self._timed("comm"):
            if self.groups.verifiers is not None:
                gathered = messages.all_gather_json(flags, group=self.groups.verifiers,
                                                    ranks=self.groups.verifier_ranks, what="list of verifier flags",
                                                    schema=FLAG_EVENTS_SCHEMA, doing="exchanging verification flags")
            else:
                gathered = [flags]
        with self._timed("verify"):
            self.verify.end_step(step, gathered)   # blame and bans: verification work too
        return gathered
