"""One interpretation of a plan's programs (``planner.simulate``, whose docstring gives the semantics): the ranks'
clocks, program counters, messages, barriers and boxes, and each instruction run at its cost."""
from __future__ import annotations

from dataclasses import dataclass, field

from cost_models.measured import MessageCost
from planner.instruction_costs import CostModel
from planner.instructions import (
    RECV_OPS,
    SEND_OPS,
    STEP_OPS,
    VERDICT_OPS,
    VERIFY_OPS,
    Instruction,
    format_instruction,
    message_keys,
)
from planner.plan import Plan
from planner.simulate_events import Event
from planner.solver.audit_stepper import Stepper

WORK_OPS = frozenset(("F", "B", "OPTIM", *VERIFY_OPS))  # instructions that occupy a processor
MESSAGE_OPS = frozenset((*SEND_OPS, *RECV_OPS))  # ... and these too, where messages cost CPU time


def deferred_verdicts(program: tuple[Instruction, ...]) -> dict[int, tuple[int, ...]]:
    """Where a rank waits for its verdicts: instruction index -> indices of the ``VERDICT_*`` it waits
    for just before it (see the module docstring). A verdict with no such instruction after it is
    waited for before the program's last instruction."""
    waits: dict[int, list[int]] = {}
    for i, ins in enumerate(program):
        if ins.op not in VERDICT_OPS:
            continue
        at = next((j for j in range(i + 1, len(program)) if _gated(ins, program[j])), len(program) - 1)
        waits.setdefault(max(at, i), []).append(i)
    return {j: tuple(v) for j, v in waits.items()}


def _gated(verdict: Instruction, later: Instruction) -> bool:
    """Whether ``later`` must wait for ``verdict``: it passes the checked microbatch on (its send, or
    the last stage's backward), or it ends the step; a gradient's verdict also comes before the rank's
    next backward (the executor holds one backward's parameter gradients apart at a time)."""
    if verdict.op == "VERDICT_F":
        return later.mb == verdict.mb and later.op in ("SEND_F", "B")
    return ((later.mb == verdict.mb and later.op == "SEND_B") or later.op in STEP_OPS
            or (later.op == "B" and later.mb != verdict.mb))


@dataclass(slots=True)
class _Run:
    """Mutable state of one interpretation."""

    plan: Plan
    costs: CostModel
    clock: list[float]
    pc: list[int]
    emulated: bool = False
    messages: MessageCost | None = None
    mailbox: dict[tuple, float] = field(default_factory=dict)
    link_free: dict[tuple[int, int], float] = field(default_factory=dict)
    barrier: dict[int, set[int]] = field(default_factory=dict)
    live: list[int] = field(default_factory=list)
    peak: list[int] = field(default_factory=list)
    reached_optim: list[float] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    verdict_waits: list[dict[int, tuple[int, ...]]] = field(default_factory=list)
    # (auditor rank, boundary, direction) -> the recompute an audit adds to each such check (``_audits``)
    audit_checks: dict[tuple[int, int, str], float] = field(default_factory=dict)
    # rank -> what each of its forwards adds signing or checking signed inputs (``_signing``)
    signing: dict[int, float] = field(default_factory=dict)
    # auditor rank -> its copies' stepper, sharing its device from the step's start (``_steppers``)
    steppers: dict[int, Stepper] = field(default_factory=dict)

    def box(self, rank: int, kind: str, ins: Instruction, start: float, dur: float, peer: int | None = None) -> None:
        self.events.append(Event(rank=rank, kind=kind, start_ms=start, end_ms=start + dur,
                                 label=format_instruction(ins), stage=ins.stage, mb=ins.mb, peer=peer))

    def send(self, rank: int, ins: Instruction, key: tuple, start: float) -> None:
        kind, boundary, _, src, dst = key
        begin = max(start, self.link_free.get((src, dst), 0.0))
        dur = self.costs.message_ms(kind, boundary, src, dst)
        # The link is busy while the bytes go out; the latency overlaps the next message.
        self.link_free[(src, dst)] = begin + max(dur - self.costs.latency_ms(src, dst), 0.0)
        self.mailbox[key] = begin + dur
        if not kind.startswith("V"):
            self.box(rank, "send", ins, begin, dur, peer=dst)

    def _receives(self, rank: int, ins: Instruction) -> list[tuple]:
        """The messages the instruction at ``rank``'s program counter waits for: its own receives (a
        ``VERDICT_*`` waits later), and the verdicts deferred to it."""
        keys = [key for side, key in message_keys(ins, rank) if side == "recv" and ins.op not in VERDICT_OPS]
        program = self.plan.programs[rank]
        for i in self.verdict_waits[rank].get(self.pc[rank], ()):
            keys += [key for _, key in message_keys(program[i], rank)]
        return keys

    def ready_at(self, rank: int, ins: Instruction) -> float | None:
        """When ``ins`` (the instruction at ``rank``'s program counter) can start; None while a message
        it waits for has not been sent."""
        t = self.clock[rank]
        for key in self._receives(rank, ins):
            if key not in self.mailbox:
                return None
            t = max(t, self.mailbox[key])
        return t

    def is_work(self, ins: Instruction) -> bool:
        """Whether ``ins`` occupies its rank's processor: a pass, or a message when messages cost CPU."""
        return ins.op in WORK_OPS or (self.messages is not None and ins.op in MESSAGE_OPS)

    def message_cpu_ms(self, rank: int, ins: Instruction) -> float:
        """The CPU time ``rank`` spends on the message of a ``SEND_*``/``RECV_*`` (its end of it)."""
        assert self.messages is not None
        ((side, key),) = message_keys(ins, rank)
        nbytes = self.costs.wire_bytes[key[1]]
        bare = self.messages.send_cpu_ms(nbytes) if side == "send" else self.messages.recv_cpu_ms(nbytes)
        return bare + self.messages.executor_ms

    def executor_pass_ms(self) -> float:
        """The executor's own CPU time around each pass (0 unless messages are priced)."""
        return self.messages.executor_pass_ms if self.messages is not None else 0.0

    def work_ms(self, rank: int, ins: Instruction) -> float:
        """Duration of a pass (:meth:`is_work`) on a processor of its own."""
        if ins.op in MESSAGE_OPS:
            return self.message_cpu_ms(rank, ins)
        if ins.op in ("F", "B"):
            return self.costs.compute_ms(rank, ins.op) + self.executor_pass_ms() + self.signing_ms(rank, ins)
        if ins.op in VERIFY_OPS:
            extra = self.audit_checks.get((rank, ins.boundary, ins.direction), 0.0)
            return self.costs.verify_ms(rank, ins.boundary, ins.direction) + extra
        return self.costs.optim_ms(rank)

    def core_ms(self, rank: int, ins: Instruction) -> float:
        """The part of a pass that needs a processor: all of it, except the padding of an emulated
        rehearsal of a slower device (a sleep)."""
        if self.emulated and ins.op in ("F", "B"):
            return self.costs.local_ms(rank, ins.op) + self.executor_pass_ms() + self.signing_ms(rank, ins)
        return self.work_ms(rank, ins)

    def signing_ms(self, rank: int, ins: Instruction) -> float:
        """What a forward adds signing its output or checking its input's signature (a signed audit's)."""
        return self.signing.get(rank, 0.0) if ins.op == "F" else 0.0

    def step(self, rank: int, ins: Instruction, dur: float | None = None) -> bool:
        """Run ``ins`` on ``rank`` if it can start; False if it must wait for a message or a barrier.
        ``dur`` overrides a pass's duration (a pass that shared its processor took longer)."""
        t = self.ready_at(rank, ins)
        if t is None:
            return False
        if ins.op == "ALLREDUCE":
            return self._allreduce(rank, ins, t)
        if self.is_work(ins):
            if dur is None:   # on a device of its own, beside its copies' stepper if it audits (``Stepper``)
                dur = self.work_ms(rank, ins)
                dur = self.steppers[rank].share(t, dur) if rank in self.steppers else dur
            if ins.op == "OPTIM":
                self.reached_optim[rank] = t
            kind = (ins.op if ins.op in ("F", "B") else "optim" if ins.op == "OPTIM"
                    else "message" if ins.op in MESSAGE_OPS else "verify")
            self.box(rank, kind, ins, t, dur)
            t += dur
            if ins.op in ("F", "B"):
                self.live[rank] += 1 if ins.op == "F" else -1
                self.peak[rank] = max(self.peak[rank], self.live[rank])
        for side, key in message_keys(ins, rank):
            if side == "send":
                self.send(rank, ins, key, t)
        self.clock[rank] = t
        return True

    def _allreduce(self, rank: int, ins: Instruction, ready: float) -> bool:
        self.clock[rank] = ready  # arrived at the barrier (after any verdict it waited for)
        waiting = self.barrier.setdefault(ins.stage, set())
        waiting.add(rank)
        group = self.plan.stage_ranks(ins.stage)
        if waiting != set(group):
            return False
        start = max(self.clock[r] for r in group)
        dur = self.costs.allreduce_ms(ins.stage)
        for r in group:
            self.box(r, "allreduce", ins, start, dur)
            self.clock[r] = start + dur
            if r != rank:
                self.pc[r] += 1  # released from the barrier
        del self.barrier[ins.stage]
        return True
