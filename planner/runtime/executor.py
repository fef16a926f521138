"""Interpret one rank's program: compute, point-to-point transfers, verification, all-reduce, optimizer.

The program is the plan's list of instructions for this rank (see
``planner.instructions`` for their meaning); one pass over it is one
optimizer step. Sends are non-blocking (their buffers are released as they
complete, and at the latest at the end of the step); the receives a compute
needs are posted when the compute before it starts, and waited for when the
tensor is used (forward, backward, verification), so transfers overlap compute.
Received tensors and input gradients are dropped after their last use, so a
rank holds what its schedule keeps in flight, not the whole step.

Gradient scaling: the last stage back-propagates ``loss_mb / M`` for each of
the step's ``M`` microbatches, and replicas of a stage sum their gradients, so
a step equals one step on the mean loss of the whole global batch.

Verification (when the plan has verifiers and it is not switched off): every
transfer of a boundary tensor carries a 1-element taint header (1 = this
microbatch was already dropped upstream). A verifier scores the copy it gets
and sends ``[flagged, tainted]`` to the consumer. A flagged or tainted
microbatch is dropped: the consumer zeroes the tensor, the last stage
multiplies its loss by 0, and the taint header it sends on is 1. At the end of
the step the verifier ranks exchange their flags and resolve blame and bans, and every rank
learns the outcome in one small all-reduce (``planner.runtime.bans``): the bans, the
senders whose flags are unresolved, and how many microbatches trained.

A parameter to whose gradient no microbatch contributed this step (all of its
stage's, or of its tied group's, were dropped) gets no optimizer step: its
gradient is zero, and Adam's momentum would still move it.

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

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import torch

from planner.errors import InvalidInputError
from planner.instructions import Instruction
from planner.integrity.hooks import FLAG_EVENTS_SCHEMA
from planner.runtime import bans as ban_exchange
from planner.runtime import comm, messages
from planner.runtime.comm import Groups, Kind, Pending
from planner.runtime.deferred import HeldBackward, ReplayPoint, merge_grads
from planner.runtime.emulate import Emulation
from planner.runtime.metrics import StepMetrics
from planner.runtime.precision import LossScaler, Precision
from planner.runtime.stage import EdgeSpecs, StageRuntime

if TYPE_CHECKING:
    from planner.integrity.hooks import AttackHooks, VerifyHooks
    from planner.plan import Plan
    from planner.runtime.data import PlanBatches

ACT_KINDS = {"F": (Kind.ACT, Kind.TAINT_ACT, Kind.VERDICT_ACT), "B": (Kind.GRAD, Kind.TAINT_GRAD, Kind.VERDICT_GRAD)}


@dataclass(slots=True)
class _Timers:
    compute: float = 0.0
    compute_cpu: float = 0.0
    pad: float = 0.0
    wait: float = 0.0
    comm: float = 0.0
    verify: float = 0.0
    optim: float = 0.0
    # This thread's CPU time in the same intervals: beside the wall times it tells the executor's own
    # work from time spent descheduled (ranks that share cores).
    wait_cpu: float = 0.0
    comm_cpu: float = 0.0
    verify_cpu: float = 0.0
    optim_cpu: float = 0.0


class Executor:
    """Runs this rank's program step by step. One instance per rank and run."""

    def __init__(self, *, plan: "Plan", rank: int, stage: StageRuntime | None,
                 edges: dict[int, EdgeSpecs], batches: "PlanBatches | None",
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
                 optimizer: torch.optim.Optimizer | None, groups: Groups, device: torch.device,
                 verify: "VerifyHooks | None" = None, attacks: "AttackHooks | None" = None,
                 emulation: Emulation = Emulation(), keep_grads: bool = False,
                 defer_verdicts: bool = True) -> None:
        """``defer_verdicts``: compute before a verifier's verdict arrives (see the module docstring)."""
        self.plan = plan
        self.rank = rank
        self.info = plan.ranks[rank]
        self.program: tuple[Instruction, ...] = plan.programs[rank]
        self.stage = stage
        self.edges = edges
        self.batches = batches
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.groups = groups
        self.device = device
        self.verify = verify
        self.attacks = attacks
        self.emulation = emulation
        # With one torch thread on CPU this thread runs every pass (CPU autograd runs on the caller), so
        # its CPU time is what a pass costs here; otherwise (intra-op threads, an asynchronous GPU) the
        # emulation can only scale wall time.
        self._pass_on_this_thread = device.type == "cpu" and torch.get_num_threads() == 1
        self.keep_grads = keep_grads
        self.defer_verdicts = defer_verdicts
        self.num_mb = plan.num_microbatches
        self.precision = Precision.of(plan.config.dtype)
        # Every rank tracks the fp16 loss scale: verifiers score gradients unscaled, whatever the scale.
        self.scaler = LossScaler() if self.precision.scaled else None
        tied_names = {n for _, _, names in groups.tied for n in names}
        named = dict(stage.parameters()) if stage is not None else {}
        # Tied parameters are summed across their stages' ranks instead (one all-reduce covers replicas too).
        self.replica_params = [p for n, p in named.items() if n not in tied_names]
        self.params = list(named.values())
        # A forward run again must start from the same state; buffers only change in place (BatchNorm).
        self.buffers = tuple(b for _, b in stage.module.named_buffers()) if stage is not None else ()
        self.last_grads: dict[str, torch.Tensor] = {}
        self.step_losses: list[float] = []
        self._check_program()
        self._next_recvs = _next_recvs(self.program)
        self._grad_last_use = self._last_uses_of_input_grads()
        self._thread_mark: float | None = None  # this thread's CPU clock when its previous step ended
        # What the end-of-step exchange told every rank (verified runs only; see planner.runtime.bans).
        self.bans: dict[int, ban_exchange.BanNotice] = {}
        self.unresolved: dict[int, int] = {}   # sender -> first flagged step, while its flags stand
        self.untrained_steps: list[int] = []   # steps in which no microbatch trained
        self._first_stage_ranks = tuple(self.plan.stage_ranks(0))

    # ------------------------------------------------------------------ setup
    def _check_program(self) -> None:
        for ins in self.program:
            if ins.op in ("F", "B", "SEND_F", "SEND_B", "RECV_F", "RECV_B", "ALLREDUCE", "OPTIM") and (
                    self.stage is None or ins.stage != self.stage.index):
                raise InvalidInputError(f"rank {self.rank}: instruction {ins}",
                                        expected=f"stage {None if self.stage is None else self.stage.index}",
                                        found=f"stage {ins.stage}", fix="regenerate the plan")

    def _last_uses_of_input_grads(self) -> dict[int, int]:
        """Program index after which a microbatch's input gradient is no longer needed (then it is freed)."""
        last: dict[int, int] = {}
        for i, ins in enumerate(self.program):
            own_check = (ins.op == "VERIFY_B" and ins.peer is None and self.stage is not None
                         and ins.boundary == self.stage.index - 1)
            if ins.op == "SEND_B" or own_check:
                last[ins.mb] = i
        return last

    @property
    def verifying(self) -> bool:
        return self.verify is not None

    # ------------------------------------------------------------------ step
    def run_step(self, step: int, start_s: float, start_cpu_s: float) -> StepMetrics:
        """Execute the program once; ``start_s``/``start_cpu_s`` are the wall and process CPU clocks
        (``time.perf_counter``, ``time.process_time``) when the previous step ended."""
        if self._thread_mark is None:
            self._thread_mark = time.thread_time()
        self._reset(step)
        for i, ins in enumerate(self.program):
            if ins.op in ("F", "B"):
                self._prefetch(i)
            self._dispatch(ins)
            if ins.op in ("SEND_B", "VERIFY_B") and self._grad_last_use.get(ins.mb) == i:
                self.input_grads.pop(ins.mb, None)  # keep memory to the schedule's in-flight bound
        self._settle_all()
        self._finish_sends()
        if self.scaler is not None and self.stage is None:
            self._overflowed()  # a verifier-only rank joins the step's overflow vote (stage ranks did in OPTIM)
        banned = self._end_verification(step)
        if self.attacks is not None:
            self.attacks.end_step()
        loss_sum, loss_count = self._losses()
        t = self.t
        thread_now = time.thread_time()
        thread_cpu, self._thread_mark = thread_now - self._thread_mark, thread_now
        return StepMetrics(step=step, rank=self.rank, step_ms=1e3 * (time.perf_counter() - start_s),
                           cpu_ms=1e3 * (time.process_time() - start_cpu_s),
                           compute_ms=1e3 * t.compute, compute_cpu_ms=1e3 * t.compute_cpu, pad_ms=1e3 * t.pad,
                           wait_ms=1e3 * t.wait,
                           comm_ms=1e3 * t.comm, verify_ms=1e3 * t.verify, optim_ms=1e3 * t.optim,
                           loss_sum=loss_sum, loss_count=loss_count, dropped=len(self.dropped_f | self.dropped_b),
                           flagged=self.flagged, banned=len(banned), thread_cpu_ms=1e3 * thread_cpu,
                           wait_cpu_ms=1e3 * t.wait_cpu, comm_cpu_ms=1e3 * t.comm_cpu,
                           verify_cpu_ms=1e3 * t.verify_cpu, optim_cpu_ms=1e3 * t.optim_cpu)

    def _reset(self, step: int) -> None:
        self.step = step
        self.t = _Timers()
        self.recvs: dict[tuple[str, int], Pending] = {}       # ("F"/"B", mb) -> posted receive
        self.received: dict[tuple[str, int], list[torch.Tensor]] = {}
        self.taint_in: dict[tuple[str, int], bool] = {}       # header of what this rank received
        self.saved: dict[int, tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.input_grads: dict[int, list[torch.Tensor]] = {}
        self.sends: list[Pending] = []
        self.dropped_f: set[int] = set()   # dropped on the way forward (zeroed, loss x 0)
        self.dropped_b: set[int] = set()   # gradient dropped on the way back
        self.flagged = 0
        self.verdicts: dict[tuple[str, int], Pending] = {}   # deferred verdicts, posted and not yet awaited
        self.replays: dict[int, ReplayPoint] = {}            # forwards that may have to run again
        self.held: HeldBackward | None = None
        self.stage_trained: int | None = None  # microbatches that trained on this stage's replicas (all-reduced)

    def _dispatch(self, ins: Instruction) -> None:
        op = ins.op
        if op == "F":
            self._forward(ins.mb)
        elif op == "B":
            self._backward(ins.mb)
        elif op in ("SEND_F", "SEND_B"):
            self._send(ins)
        elif op in ("RECV_F", "RECV_B"):
            self._post_recv(ins)
        elif op in ("VERIFY_F", "VERIFY_B"):
            if self.verifying:
                self._verify(ins)
        elif op in ("VERDICT_F", "VERDICT_B"):
            if self.verifying:
                self._verdict(ins)
        elif op == "ALLREDUCE":
            self._allreduce()
        elif op == "OPTIM":
            self._optim()
        else:  # Instruction validates ops; a new op must be taught here
            raise AssertionError(f"unhandled instruction {ins}")

    # ------------------------------------------------------------------ compute
    def _stage_inputs(self, mb: int) -> list[torch.Tensor]:
        assert self.stage is not None
        if self.stage.is_first:
            assert self.batches is not None
            return list(self.batches.microbatch(self.step, mb)[0])
        tensors = self._take(("F", mb))
        if mb in self.dropped_f:
            tensors = [torch.zeros_like(t) for t in tensors]
        return tensors

    def _forward(self, mb: int) -> None:
        raw = self._stage_inputs(mb)
        self.received.pop(("F", mb), None)  # from here on `inputs` (saved until B) hold the data
        if ("F", mb) in self.verdicts and mb not in self.dropped_f:
            self.replays[mb] = ReplayPoint.take(self.device, self.buffers)
        self._run_forward(mb, raw)

    def _run_forward(self, mb: int, raw: list[torch.Tensor]) -> None:
        stage = self.stage
        assert stage is not None
        inputs = [t.detach().requires_grad_(spec.carries_grad and t.is_floating_point())
                  for t, spec in zip(raw, stage.inputs)]
        t0, c0 = time.perf_counter(), time.thread_time()
        # Received in the compute dtype, fed in the traced one (the graph may assert it), differentiably.
        args = [t.to(spec.dtype) if t.is_floating_point() else t for t, spec in zip(inputs, stage.inputs)]
        with torch.enable_grad(), self.precision.autocast(self.device):
            outputs = tuple(stage.module(*args))
            if not stage.is_last:
                outputs = self.precision.to_wire(outputs)
            else:
                assert self.batches is not None and self.loss_fn is not None
                targets = self.batches.microbatch(self.step, mb)[1]
                loss = self.loss_fn(outputs[0] if len(outputs) == 1 else outputs, targets)
                if mb in self.dropped_f:
                    loss = loss * 0.0
                self.losses[mb] = loss
        self._computed("F", t0, c0)
        self.saved[mb] = (inputs, outputs)

    def _backward(self, mb: int) -> None:
        stage = self.stage
        assert stage is not None
        if mb not in self.saved:
            raise InvalidInputError(f"rank {self.rank}: backward of microbatch {mb} before its forward",
                                    fix="regenerate the plan (its program is out of order)")
        self._settle_forward(mb)   # the last stage's loss, or a forward that must run again
        self._settle_backward()    # the gradients of an earlier backward still held
        inputs, outputs = self.saved.pop(mb)
        hold = False
        if stage.is_last:
            scale = self.scaler.scale if self.scaler is not None else 1.0
            roots, grads = [self.losses[mb] * (scale / self.num_mb)], [None]
        else:
            received = self._take(("B", mb))
            self.received.pop(("B", mb), None)
            if mb in self.dropped_b:
                received = [torch.zeros_like(g) for g in received]
            hold = ("B", mb) in self.verdicts and mb not in self.dropped_b
            carrying = [o for o, spec in zip(outputs, stage.outputs) if spec.carries_grad]
            pairs = [(o, g) for o, g in zip(carrying, received) if o.requires_grad]
            roots, grads = [o for o, _ in pairs], [g for _, g in pairs]
        if hold:  # keep this backward's parameter gradients apart until its verdict comes
            stash = [p.grad for p in self.params]
            for p in self.params:
                p.grad = None
            self.held = HeldBackward(mb=mb, stash=stash)
        t0, c0 = time.perf_counter(), time.thread_time()
        if roots:
            torch.autograd.backward(roots, grads)
        self._computed("B", t0, c0)
        if not stage.is_first:
            self.input_grads[mb] = [
                (t.grad if t.grad is not None else torch.zeros_like(t))
                for t, spec in zip(inputs, stage.inputs) if spec.carries_grad]

    @contextmanager
    def _timed(self, what: str) -> Iterator[None]:
        """Add the wall and thread CPU time of the block to timer ``what`` (comm, wait, verify, optim)."""
        t0, cpu0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            setattr(self.t, what, getattr(self.t, what) + time.perf_counter() - t0)
            setattr(self.t, f"{what}_cpu", getattr(self.t, f"{what}_cpu") + time.thread_time() - cpu0)

    def _computed(self, op: str, t0: float, cpu0: float) -> None:
        """Book a pass that started at wall ``t0`` and thread CPU time ``cpu0``, and pad it if emulating."""
        elapsed = time.perf_counter() - t0
        cpu = time.thread_time() - cpu0 if self._pass_on_this_thread else None
        self.t.compute += elapsed
        self.t.compute_cpu += cpu or 0.0
        if self.emulation.active:
            self.t.pad += self.emulation.pad(op, elapsed, cpu)

    # ------------------------------------------------------------------ p2p
    def _boundary(self, ins: Instruction) -> int:
        """The boundary a transfer crosses: forward from stage k is boundary k, backward from k is k-1."""
        if ins.op in ("SEND_F", "RECV_B"):
            return ins.stage
        if ins.op in ("RECV_F", "SEND_B"):
            return ins.stage - 1
        assert ins.boundary is not None
        return ins.boundary

    def _tensors_for_send(self, ins: Instruction) -> list[torch.Tensor]:
        mb = ins.mb
        assert mb is not None
        if ins.op == "SEND_F":
            if mb not in self.saved:
                raise InvalidInputError(f"rank {self.rank}: {ins} before the forward of microbatch {mb}",
                                        fix="regenerate the plan")
            return [o.detach() for o in self.saved[mb][1]]
        if mb not in self.input_grads:
            raise InvalidInputError(f"rank {self.rank}: {ins} before the backward of microbatch {mb}",
                                    fix="regenerate the plan")
        return self.input_grads[mb]

    def _sent_tensors(self, d: str, mb: int) -> list[torch.Tensor]:
        """What this rank sends for (direction, mb): its output or input gradient, after any attack."""
        op = "SEND_F" if d == "F" else "SEND_B"
        assert self.stage is not None
        tensors = self._tensors_for_send(Instruction(op=op, stage=self.stage.index, mb=mb, peer=self.rank))
        if self.attacks is not None and self.attacks.active:
            tensors = self.attacks.apply(tensors, op_direction=d, step=self.step, mb=mb)
        return tensors

    def _consumer(self, ins: Instruction) -> int:
        assert self.stage is not None and ins.mb is not None
        return self.plan.owner(self.stage.index + (1 if ins.direction == "F" else -1), ins.mb)

    def _send(self, ins: Instruction) -> None:
        d = ins.direction
        if not self.verifying and ins.peer != self._consumer(ins):
            return  # a copy for a verifier, and verification is off
        self._settle_sent(d, ins.mb)
        kind, header_kind, _ = ACT_KINDS[d]
        tensors = self._sent_tensors(d, ins.mb)
        header = None
        if self.verifying:
            dropped = ins.mb in (self.dropped_f if d == "F" else self.dropped_f | self.dropped_b)
            header = torch.tensor([int(dropped)], dtype=torch.int64, device=self.device)
        if not tensors and header is None:
            return
        with self._timed("comm"):
            self.sends.append(comm.send(tensors, peer=ins.peer, kind=kind, boundary=self._boundary(ins), mb=ins.mb,
                                        header=header, header_kind=header_kind if header is not None else None,
                                        doing=f"sending {ins} (step {self.step})"))
            self._prune_sends()

    def _specs(self, d: str, boundary: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        edge = self.edges[boundary]
        values = edge.act if d == "F" else edge.grad
        return [(v.shape, self.precision.wire_dtype(v.dtype)) for v in values]

    def _post(self, d: str, *, peer: int, boundary: int, mb: int, doing: str) -> Pending | None:
        kind, header_kind, _ = ACT_KINDS[d]
        specs = self._specs(d, boundary)
        if not specs and not self.verifying:
            return None
        return comm.recv(specs, peer=peer, kind=kind, boundary=boundary, mb=mb, device=self.device, doing=doing,
                         header_kind=header_kind if self.verifying else None)

    def _prefetch(self, i: int) -> None:
        """Before computing instruction ``i``, post the receives the *next* compute needs.

        The transfer then overlaps this compute instead of starting when the
        program reaches its RECV (gloo moves a message once both sides have
        posted). At most one compute's worth of extra buffers is alive.
        """
        for ins in self._next_recvs[i]:
            if (ins.direction, ins.mb) not in self.recvs and (ins.direction, ins.mb) not in self.received:
                self._post_recv(ins)

    def _post_recv(self, ins: Instruction) -> None:
        if (ins.direction, ins.mb) in self.recvs or (ins.direction, ins.mb) in self.received:
            return  # already posted by _prefetch
        with self._timed("comm"):
            pending = self._post(ins.direction, peer=ins.peer, boundary=self._boundary(ins), mb=ins.mb,
                                 doing=f"receiving {ins} (step {self.step})")
        if pending is not None:
            self.recvs[(ins.direction, ins.mb)] = pending

    def _wait(self, pending: Pending) -> list[torch.Tensor]:
        with self._timed("wait"):
            tensors = pending.wait()
        return tensors

    def _take(self, key: tuple[str, int]) -> list[torch.Tensor]:
        """The tensors received for (direction, mb), waiting for them if needed; the header is split off."""
        if key not in self.received:
            if key not in self.recvs:
                if not self._specs(key[0], self._edge_of(key[0])):
                    return []
                raise InvalidInputError(f"rank {self.rank}: microbatch {key[1]} used before it was received "
                                        f"({'activation' if key[0] == 'F' else 'gradient'})",
                                        fix="regenerate the plan (a RECV is missing or late)")
            tensors = self._wait(self.recvs.pop(key))
            if self.verifying:
                header, tensors = tensors[-1], tensors[:-1]
                self.taint_in[key] = bool(header.item())
                if self.taint_in[key]:
                    self._drop(key[0], key[1])
            self.received[key] = tensors
        return self.received[key]

    def _edge_of(self, d: str) -> int:
        assert self.stage is not None
        return self.stage.index - 1 if d == "F" else self.stage.index

    def _drop(self, d: str, mb: int) -> None:
        (self.dropped_f if d == "F" else self.dropped_b).add(mb)

    def _prune_sends(self) -> None:
        """Release the buffers of sends that have completed (their errors, if any, surface here)."""
        if len(self.sends) > 4:
            keep = []
            for p in self.sends:
                if p.completed():
                    p.wait()
                else:
                    keep.append(p)
            self.sends = keep

    def _finish_sends(self) -> None:
        with self._timed("wait"):
            for pending in self.sends:
                pending.wait()
            self.sends = []

    # ------------------------------------------------------------------ verification
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
            tensors, tainted_in = received[:-1], bool(received[-1].item())
            sender = ins.peer
        elif self.info.stage == sender_stage:  # a trusted sender checking what it just sent
            self._settle_sent(d, mb)
            tensors = self._sent_tensors(d, mb)
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
        """Verifier ranks exchange flags and resolve blame; then every rank learns the bans, the
        unresolved flags and whether the step trained anything. Returns the ranks banned so far."""
        if self.verify is None:
            return set()
        self._resolve_blame(step)
        lead = self.verify.verifier is not None and self.rank == min(self.groups.verifier_ranks)
        mine = ban_exchange.encode(
            self.plan.num_ranks, rank=self.rank, lead=lead,
            unresolved=self.verify.verifier.unresolved() if lead else {},
            bans=self.verify.verifier.ban_records() if lead else {}, trained=self._trained_here())
        with self._timed("comm"):
            summed = mine.to(self.device)
            comm.all_reduce_sum(summed, group=None, ranks=range(self.plan.num_ranks),
                                doing="sharing the step's bans with every rank")
        got = ban_exchange.decode(summed.cpu(), first_stage_ranks=self._first_stage_ranks)
        self.bans, self.unresolved = got.bans, got.unresolved
        if got.trained == 0:
            self.untrained_steps.append(step)
        return set(self.bans)

    def _trained_here(self) -> int:
        """This rank's microbatches of the step that were not dropped (0 on a verifier-only rank)."""
        if self.stage is None:
            return 0
        dropped = self.dropped_f | self.dropped_b
        return sum(1 for mb in self.info.microbatches if mb not in dropped)

    def _resolve_blame(self, step: int) -> None:
        """Exchange flags among the verifier ranks and resolve blame (verifier ranks only)."""
        assert self.verify is not None
        if self.verify.verifier is None:
            return
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

    # ------------------------------------------------------------------ gradients and optimizer
    def _allreduce(self) -> None:
        self._settle_all()
        if self.groups.stage is None or not self.replica_params:
            return
        with self._timed("comm"):
            self.stage_trained = self._sum_grads(self.replica_params, group=self.groups.stage,
                                                 ranks=self.groups.stage_ranks,
                                                 doing=f"all-reducing stage {self.info.stage}'s gradients")

    def _sum_grads(self, params: Sequence[torch.nn.Parameter], *, group, ranks: Sequence[int], doing: str) -> int:
        """Sum ``params``' gradients over ``group``; with verification, also how many microbatches trained
        on its ranks (one more element in the same message)."""
        flat = comm.flat_grads(params)
        if self.verifying:
            flat = torch.cat([flat, flat.new_tensor([float(self._trained_here())])])
        comm.all_reduce_sum(flat, group=group, ranks=ranks, doing=doing)
        trained = self._trained_here()
        if self.verifying:
            trained, flat = int(round(float(flat[-1]))), flat[:-1]
        comm.unflatten_grads(flat, params)
        return trained

    def _sync_tied(self) -> list[torch.nn.Parameter]:
        """Sum the tied parameters' gradients across their stages; returns those no microbatch trained."""
        named = dict(self.stage.parameters()) if self.stage is not None else {}
        idle = []
        for group, ranks, names in self.groups.tied:
            params = [named[n] for n in names]
            if not self._sum_grads(params, group=group, ranks=ranks, doing="summing tied parameters' gradients"):
                idle.extend(params)
        return idle

    def _idle_params(self, tied_idle: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
        """The parameters no microbatch of this step trained (verified runs: every one dropped)."""
        if not self.verifying or self.stage is None:
            return []
        trained = self.stage_trained if self.stage_trained is not None else self._trained_here()
        return (list(self.replica_params) if trained == 0 else []) + tied_idle

    def _optim(self) -> None:
        self._settle_all()
        with self._timed("comm"):
            tied_idle = self._sync_tied()
        idle = self._idle_params(tied_idle)
        with self._timed("optim"):
            if self.scaler is not None and self._overflowed():
                if self.optimizer is not None:
                    self.optimizer.zero_grad(set_to_none=True)
                return
            if self.keep_grads and self.stage is not None:
                self.last_grads = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                                   for n, p in self.stage.parameters()}
            for p in idle:
                p.grad = None  # no step for it: the optimizer skips a parameter without a gradient
            if self.optimizer is not None:
                if len(idle) < len(self.params):
                    self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)

    def _overflowed(self) -> bool:
        """Unscale this rank's gradients and agree with every rank whether any overflowed (fp16): one vote
        per step on every rank, so all of them move the scale alike."""
        assert self.scaler is not None
        flag = torch.tensor([float(self.scaler.unscale(self.params))], device=self.device)
        if self.plan.num_ranks > 1:
            comm.all_reduce_sum(flag, group=None, ranks=range(self.plan.num_ranks),
                                doing="agreeing whether any gradient overflowed")
        overflow = bool(flag.item() > 0)
        self.scaler.update(overflow)
        return overflow

    def _losses(self) -> tuple[float, int]:
        """(sum, count) of the kept microbatches' losses on a last-stage rank; (0, 0) elsewhere.

        ``step_losses`` keeps this rank's share of the step objective (sum / M, dropped ones as 0),
        which is what the gradients of the step are gradients of.
        """
        if self.stage is None or not self.stage.is_last:
            return 0.0, 0
        kept = [float(loss.detach()) for mb, loss in self.losses.items() if mb not in self.dropped_f]
        self.step_losses.append(sum(kept) / self.num_mb)
        return sum(kept), len(kept)


def _next_recvs(program: Sequence[Instruction]) -> list[tuple[Instruction, ...]]:
    """For each compute instruction, the RECVs between it and the compute after it (the next one's inputs)."""
    out: list[tuple[Instruction, ...]] = [()] * len(program)
    computes = [i for i, ins in enumerate(program) if ins.op in ("F", "B")]
    for here, nxt in zip(computes, computes[1:]):
        out[here] = tuple(ins for ins in program[here + 1:nxt] if ins.op in ("RECV_F", "RECV_B"))
    return out
