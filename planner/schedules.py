"""Per-rank programs for GPipe and 1F1B, with replicas and verifiers.

The list scheduler (:func:`build_programs`) repeatedly places the action that
could start earliest (an estimate from :class:`StepCosts`) among those whose
inputs have already been placed, and emits around each compute the receives
it needs before and the sends it makes after (plus verification copies,
``VERIFY`` and ``VERDICT`` ops). Every receive thus follows its send in one
global order, so with non-blocking sends and blocking receives the programs
cannot deadlock.

What a stage rank may place next: GPipe runs every forward, then every
backward, in microbatch order. 1F1B runs its forwards in microbatch order
while fewer than ``max_in_flight`` of its microbatches are in flight (the
plan's limit, at least ``min(S - k, n)``, more where the solver found memory
for it and the pipeline needs it), and the backward of any in-flight
microbatch whose gradient has arrived; at equal start times the pass unlike
its last one goes first (1F1B's alternation). No rank can starve: the lowest microbatch not yet finished holds no
in-flight slot anywhere it has not been, so it can always advance.

Replicas: the solver routes each microbatch to one replica per stage
(``planner.solver.routing``: interleaved in proportion to the replicas'
shares), written into ``RankInfo.microbatches``; microbatch m flows from
whichever replica of stage k owns it to whichever replica of stage k+1 owns
it, and each replica keeps its own rhythm over its own microbatches.

Verification of boundary b (stage b -> b+1) in one direction, with sender S,
consumer C and verifier rank V:
* V == C: C verifies the tensor it received itself (``VERIFY`` with no peer).
* V == S: S scores its own tensor after sending it and sends C the verdict.
* otherwise S also sends V a copy; V runs ``VERIFY<S>C``; C waits for the
  verdict (``VERDICT<V``) after receiving the tensor and before using it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from planner.errors import InvalidInputError
from planner.instructions import Instruction
from planner.plan_values import RankInfo, VerifierInfo, checker_ranks


def max_in_flight(schedule: str, stage: int, num_stages: int, num_mbs: int) -> int:
    """The least in-flight limit a schedule needs: GPipe holds every microbatch, 1F1B ``min(S - k, n)``
    (the memory every plan must afford; the solver may allow a replica more where memory has room)."""
    if schedule == "gpipe":
        return num_mbs
    return min(num_stages - stage, num_mbs)


class StepCosts(Protocol):
    """Duration estimates used only to order the list scheduling (the simulator prices the result)."""

    def compute_ms(self, rank: int, op: str) -> float: ...

    def transfer_ms(self, src: int, dst: int, stage: int, op: str) -> float:
        """Time to move the tensor ``op`` ("F": stage's output activation; "B": gradient of its input)."""
        ...

    def verify_ms(self, rank: int, boundary: int, op: str) -> float: ...

    def latency_ms(self, src: int, dst: int) -> float:
        """The part of a transfer from ``src`` to ``dst`` that overlaps the next one on the same link."""
        ...

    def verdict_ms(self, src: int, dst: int) -> float:
        """Time for a verdict (a few bytes) to go from verifier ``src`` to consumer ``dst``."""
        ...


@dataclass(frozen=True, slots=True)
class UnitCosts:
    """Fallback estimates: forward 1, backward 2, free communication and verification."""

    def compute_ms(self, rank: int, op: str) -> float:
        return 1.0 if op == "F" else 2.0

    def transfer_ms(self, src: int, dst: int, stage: int, op: str) -> float:
        return 0.0

    def verify_ms(self, rank: int, boundary: int, op: str) -> float:
        return 0.0

    def latency_ms(self, src: int, dst: int) -> float:
        return 0.0

    def verdict_ms(self, src: int, dst: int) -> float:
        return 0.0


@dataclass(slots=True)
class _State:
    """Mutable bookkeeping of one list-scheduling run."""

    programs: list[list[Instruction]]
    clock: list[float]
    # stage rank -> its forwards still to place (ascending), and microbatches forwarded, not yet backward
    forwards: dict[int, list[int]]
    in_flight: dict[int, list[int]]
    # (boundary, op, mb) -> time the consumer may have the verdict
    verdict: dict[tuple[int, str, int], float] = field(default_factory=dict)
    # (stage, op, mb) -> when that tensor arrives at its consumer
    arrival: dict[tuple[int, str, int], float] = field(default_factory=dict)
    # (src, dst) rank pair -> when its wire is free for the next message (one message's bytes at a time)
    link_free: dict[tuple[int, int], float] = field(default_factory=dict)
    # verifier rank -> list of (arrival time, Instruction, verdict key, consumer)
    verify_queue: dict[int, list[tuple[float, Instruction, tuple[int, str, int], int]]] = \
        field(default_factory=dict)


class _Lowering:
    """Lowers compute orders into programs for one plan layout (see module docstring)."""

    def __init__(self, schedule: str, num_stages: int, ranks: tuple[RankInfo, ...],
                 verifiers: tuple[VerifierInfo, ...], costs: StepCosts) -> None:
        self.num_stages = num_stages
        self.ranks = ranks
        self.costs = costs
        self.owner: dict[tuple[int, int], int] = {}
        for r in ranks:
            if r.stage is not None:
                for m in r.microbatches:
                    self.owner[(r.stage, m)] = r.rank
        # (boundary, "F"|"B", mb) -> verifier rank (a boundary's verifiers may split its senders)
        self.checker: dict[tuple[int, str, int], int] = checker_ranks(ranks, verifiers)
        self.gpipe = schedule == "gpipe"
        if schedule not in ("gpipe", "1f1b"):
            raise InvalidInputError("schedule", expected="1f1b or gpipe", found=repr(schedule))
        stage_ranks = [r for r in ranks if r.stage is not None]
        self.limit = {r.rank: len(r.microbatches) if self.gpipe else r.max_in_flight or
                      max_in_flight(schedule, r.stage, num_stages, len(r.microbatches)) for r in stage_ranks}
        self.last_op: dict[int, str] = {}
        self.b_gate: dict[int, float] = {}  # rank -> verdict its next backward waits for
        self.st = _State(programs=[[] for _ in ranks], clock=[0.0] * len(ranks),
                         forwards={r.rank: list(r.microbatches) for r in stage_ranks},
                         in_flight={r.rank: [] for r in stage_ranks},
                         verify_queue={r.rank: [] for r in ranks})
        # Each rank's placeable actions change only when something it waits for is placed:
        # recompute those ranks only (keeps compiling large plans fast).
        self.cached: list[list[tuple[float, int, int, str]]] = [[] for _ in ranks]
        self.dirty: set[int] = {r.rank for r in ranks}

    # --- dependencies ----------------------------------------------------
    def _source(self, stage: int, op: str, mb: int) -> tuple[int, int] | None:
        """(producer stage, producer rank) of what ``op`` of ``stage`` consumes, None for none."""
        if op == "F":
            return None if stage == 0 else (stage - 1, self.owner[(stage - 1, mb)])
        return None if stage == self.num_stages - 1 else (stage + 1, self.owner[(stage + 1, mb)])

    def _boundary(self, stage: int, op: str) -> int:
        """Boundary crossed by the tensor ``op`` of ``stage`` consumes."""
        return stage - 1 if op == "F" else stage

    def _ready_time(self, rank: int, stage: int, op: str, mb: int) -> float | None:
        """Earliest start of compute ``op``/``mb`` on ``rank``, or None if its input is not placed yet."""
        src = self._source(stage, op, mb)
        if op == "B" and stage == self.num_stages - 1 and stage > 0:
            # The last stage's backward uses its checked input: it waits for that verdict (as it runs).
            key = (stage - 1, "F", mb)
            if key in self.checker and self.checker[key] != rank:
                if key not in self.st.verdict:
                    return None
                return max(self.st.clock[rank], self.st.verdict[key], self.b_gate.get(rank, 0.0))
        if src is None:
            return self.st.clock[rank]
        pstage, _ = src
        ready = self.st.arrival.get((pstage, op, mb))
        if ready is None:
            return None
        key = (self._boundary(stage, op), op, mb)
        if key in self.checker and self.checker[key] != rank and key not in self.st.verdict:
            return None  # its verdict is placed first; it gates what the pass sends, not the pass
        return max(self.st.clock[rank], ready, self.b_gate.get(rank, 0.0) if op == "B" else 0.0)

    # --- emission --------------------------------------------------------
    def _emit(self, rank: int, ins: Instruction) -> None:
        self.st.programs[rank].append(ins)

    def _place_compute(self, rank: int, stage: int, op: str, mb: int, start: float) -> None:
        src = self._source(stage, op, mb)
        boundary_in = self._boundary(stage, op)
        checker_in = self.checker.get((boundary_in, op, mb)) if src is not None else None
        if src is not None:
            self._emit(rank, Instruction(op=f"RECV_{op}", stage=stage, mb=mb, peer=src[1]))
            if checker_in == rank:  # the consumer is its own verifier: check locally
                self._emit(rank, Instruction(op=f"VERIFY_{op}", stage=stage, mb=mb))
                start += self.costs.verify_ms(rank, boundary_in, op)
            elif checker_in is not None:
                self._emit(rank, Instruction(op=f"VERDICT_{op}", stage=stage, mb=mb, peer=checker_in))
        self._emit(rank, Instruction(op=op, stage=stage, mb=mb))
        self.dirty.add(rank)
        end = start + self.costs.compute_ms(rank, op)
        # A remote check's verdict is awaited before the result leaves the rank (and, for a gradient, before
        # the rank's next backward): the rank blocks there (``planner.simulate_run.deferred_verdicts``).
        gate = self.st.verdict.get((boundary_in, op, mb), 0.0) if checker_in not in (None, rank) else 0.0
        sends = 0 <= (stage + 1 if op == "F" else stage - 1) < self.num_stages
        if op == "B":
            self.b_gate[rank] = gate
        self.st.clock[rank] = max(end, gate) if sends else end
        self._emit_sends(rank, stage, op, mb, self.st.clock[rank])

    def _emit_sends(self, rank: int, stage: int, op: str, mb: int, end: float) -> None:
        nxt = stage + 1 if op == "F" else stage - 1
        if not 0 <= nxt < self.num_stages:
            return
        consumer = self.owner[(nxt, mb)]
        self.dirty.add(consumer)
        self._emit(rank, Instruction(op=f"SEND_{op}", stage=stage, mb=mb, peer=consumer))
        self.st.arrival[(stage, op, mb)] = self._transmit(rank, consumer, stage, op, end)
        boundary = self._boundary(nxt, op)
        checker = self.checker.get((boundary, op, mb))
        key = (boundary, op, mb)
        if checker is None or checker == consumer:
            return  # unchecked, or checked by the consumer itself after its RECV
        if checker == rank:  # the sender verifies its own output (only when it is trusted)
            self._emit(rank, Instruction(op=f"VERIFY_{op}", stage=nxt, mb=mb, dest=consumer))
            self.st.clock[rank] += self.costs.verify_ms(rank, boundary, op)
            self.st.verdict[key] = self.st.clock[rank] + self.costs.verdict_ms(rank, consumer)
            return  # the consumer is already marked dirty
        self._emit(rank, Instruction(op=f"SEND_{op}", stage=stage, mb=mb, peer=checker))
        arrival = self._transmit(rank, checker, stage, op, end)
        ins = Instruction(op=f"VERIFY_{op}", stage=nxt, mb=mb, peer=rank, dest=consumer)
        self.st.verify_queue[checker].append((arrival, ins, key, consumer))
        self.dirty.add(checker)

    def _transmit(self, src: int, dst: int, stage: int, op: str, sent: float) -> float:
        """Arrival of a message sent at ``sent``: it waits for the link's wire, as the simulator prices it."""
        total = self.costs.transfer_ms(src, dst, stage, op)
        if total <= 0.0:
            return sent
        start = max(sent, self.st.link_free.get((src, dst), 0.0))
        self.st.link_free[(src, dst)] = start + total - self.costs.latency_ms(src, dst)
        return start + total

    def _place_verify(self, rank: int) -> None:
        queue = self.st.verify_queue[rank]
        # Copies may arrive out of placement order (different links): of those that can start first, the lowest
        # microbatch's (the pipeline's fill and drain wait on it), a gradient before an activation.
        clock = self.st.clock[rank]
        arrival, ins, key, consumer = queue.pop(min(
            range(len(queue)), key=lambda i: (max(queue[i][0], clock), queue[i][2][2], queue[i][2][1] != "B")))
        self._emit(rank, ins)
        start = max(self.st.clock[rank], arrival)
        end = start + self.costs.verify_ms(rank, key[0], key[1])
        self.st.clock[rank] = end
        self.st.verdict[key] = end + self.costs.verdict_ms(rank, consumer)
        self.dirty.update((rank, consumer))

    # --- main loop -------------------------------------------------------
    def _compute_choices(self, r: RankInfo) -> list[tuple[str, int]]:
        """The passes ``r`` may place next: its next forward while under its in-flight limit, and the
        backward of any microbatch in flight (GPipe: backwards in order, once every forward is placed)."""
        fwd, live = self.st.forwards[r.rank], self.st.in_flight[r.rank]
        if self.gpipe:
            return [("F", fwd[0])] if fwd else [("B", live[0])] if live else []
        out = [("B", m) for m in live]
        if fwd and len(live) < self.limit[r.rank]:
            out.append(("F", fwd[0]))
        return out

    def _rank_candidates(self, r: RankInfo) -> list[tuple[float, int, int, str, int]]:
        """(start estimate, kind, rank, op, mb) of what ``r`` could place next: the earliest start wins; at the
        same time a check first (kind 0), then the pass unlike the rank's last one (1F1B's alternation, which
        keeps feeding the next stage while backwards wait), then the other."""
        found = []
        queue = self.st.verify_queue[r.rank]
        if queue:
            first = min(item[0] for item in queue)
            found.append((max(self.st.clock[r.rank], first), 0, r.rank, "V", -1))
        if r.stage is not None:
            for op, mb in self._compute_choices(r):
                start = self._ready_time(r.rank, r.stage, op, mb)
                if start is not None:
                    found.append((start, 2 if op == self.last_op.get(r.rank) else 1, r.rank, op, mb))
        return found

    def _candidates(self) -> list[tuple[float, int, int, str, int]]:
        for rank in self.dirty:
            self.cached[rank] = self._rank_candidates(self.ranks[rank])
        self.dirty.clear()
        return [c for per_rank in self.cached for c in per_rank]

    def run(self) -> tuple[tuple[Instruction, ...], ...]:
        while True:
            candidates = self._candidates()
            if not candidates:
                break
            start, kind, rank, op, mb = min(candidates)
            if kind == 0:
                self._place_verify(rank)
                continue
            self.last_op[rank] = op
            if op == "F":
                self.st.forwards[rank].remove(mb)
                self.st.in_flight[rank].append(mb)
            else:
                self.st.in_flight[rank].remove(mb)
            self._place_compute(rank, self.ranks[rank].stage, op, mb, start)
        stuck = {r: f"F{fwd[0]}" if fwd else f"B{self.st.in_flight[r][0]}"
                 for r, fwd in self.st.forwards.items() if fwd or self.st.in_flight[r]}
        if stuck:
            detail = ", ".join(f"rank {r} at {what}" for r, what in sorted(stuck.items()))
            raise InvalidInputError("pipeline schedule deadlocks", expected="compute orders that can all finish",
                                    found=f"stuck: {detail}", fix="use another microbatch split or schedule")
        return tuple(tuple(p) for p in self.st.programs)


def _append_step_ops(programs: tuple[tuple[Instruction, ...], ...], ranks: tuple[RankInfo, ...]
                     ) -> tuple[tuple[Instruction, ...], ...]:
    """ALLREDUCE (replicated stages only) then OPTIM at the end of every stage rank's program."""
    replicas: dict[int, int] = {}
    for r in ranks:
        if r.stage is not None:
            replicas[r.stage] = replicas.get(r.stage, 0) + 1
    out = []
    for r, prog in zip(ranks, programs):
        tail: tuple[Instruction, ...] = ()
        if r.stage is not None:
            if replicas[r.stage] > 1:
                tail += (Instruction(op="ALLREDUCE", stage=r.stage),)
            tail += (Instruction(op="OPTIM", stage=r.stage),)
        out.append(prog + tail)
    return tuple(out)


def build_programs(schedule: str, num_stages: int, ranks: tuple[RankInfo, ...],
                   verifiers: tuple[VerifierInfo, ...], costs: StepCosts | None = None
                   ) -> tuple[tuple[Instruction, ...], ...]:
    """One program per rank for ``schedule`` over the given rank layout (see the module docstring)."""
    for i, r in enumerate(ranks):
        if r.rank != i:
            raise InvalidInputError("rank layout", expected=f"rank {i} at position {i}", found=str(r.rank))
    lowering = _Lowering(schedule, num_stages, ranks, verifiers, costs or UnitCosts())
    return _append_step_ops(lowering.run(), ranks)
