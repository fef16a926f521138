"""Check a plan's programs, independently of the code that generated them.

``validate_programs(plan)`` re-derives what must hold from the plan's rank
layout alone and raises :class:`InvalidInputError` naming the rank, the index
and the instruction of the first problem (and how many more there are):

1. every instruction is legal on its rank (a stage rank computes, sends and
   receives only for its own stage and microbatches; ``VERIFY`` only on the
   verifier rank of that boundary and direction);
2. every microbatch runs ``F`` and ``B`` exactly once on exactly one replica
   of each stage (the one that owns it), ``F`` before ``B``; each compute is
   preceded by the receive of its input (and by the verdict on it when its
   boundary is checked) and each send follows the compute that made the tensor;
3. every send has exactly one matching receive (data, verification copies
   and verdicts), with the right ends: microbatch m goes from the owner of
   (k, m) to the owner of (k+1, m) or to the boundary's verifier;
4. every checked boundary is verified once per microbatch and direction;
5. ``ALLREDUCE`` once on every rank of a replicated stage (none otherwise),
   then ``OPTIM`` once on every stage rank, after all its backwards;
6. activations in flight on a rank never exceed ``max_in_flight``, which
   itself is at most what the schedule allows (GPipe: n; 1F1B: min(S - k, n));
7. no deadlock: a small interpreter runs all programs with the runtime's
   semantics (sends non-blocking and buffered, receives blocking,
   ``ALLREDUCE`` a barrier of the stage's replicas) and must reach the end.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from planner.errors import InvalidInputError
from planner.instructions import (
    COMPUTE_OPS,
    RECV_OPS,
    SEND_OPS,
    VERDICT_OPS,
    VERIFY_OPS,
    Instruction,
    format_instruction,
    message_keys,
)
from planner.plan import Plan
from planner.plan_values import checker_ranks

_FIX = "re-create the plan with `stagewise plan` (do not edit programs by hand)"


@dataclass(frozen=True, slots=True, kw_only=True)
class ProgramFault:
    """One fault in a program: where (rank, instruction) and what is wrong."""

    rank: int
    index: int | None
    instruction: str
    what: str

    def message(self) -> str:
        where = f"rank {self.rank}" + (f" instruction #{self.index} {self.instruction!r}" if self.index is not None
                                       else "")
        return f"{where}: {self.what}"


class _Checker:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.problems: list[ProgramFault] = []
        self.S = plan.num_stages
        self.owner = {(r.stage, m): r.rank for r in plan.ranks if r.stage is not None for m in r.microbatches}
        self.checked = checker_ranks(plan.ranks, plan.verifiers)  # (boundary, F|B, mb) -> verifier rank

    def add(self, rank: int, index: int | None, ins: Instruction | None, what: str) -> None:
        text = format_instruction(ins) if ins is not None else ""
        self.problems.append(ProgramFault(rank=rank, index=index, instruction=text, what=what))

    # --- 1/2: layout, ownership, local order ------------------------------
    def check_layout(self) -> None:
        M = self.plan.num_microbatches
        for k in range(self.S):
            owned = sorted(m for (s, m) in self.owner if s == k)
            replicas = self.plan.stage_ranks(k)
            if not replicas:
                self.add(0, None, None, f"stage {k} has no rank")
            elif owned != list(range(M)) or sum(len(self.plan.ranks[r].microbatches) for r in replicas) != M:
                self.add(replicas[0], None, None, f"stage {k}'s replicas own microbatches {owned}, "
                                                  f"expected each of 0..{M - 1} exactly once")

    def check_rank(self, rank: int) -> None:
        info = self.plan.ranks[rank]
        prog = self.plan.programs[rank]
        seen: dict[tuple[str, int], int] = {}
        have_input: set[tuple[str, int]] = set()
        verdict: set[tuple[str, int]] = set()
        live = peak = 0
        step_ops: list[tuple[int, str]] = []
        for i, ins in enumerate(prog):
            if ins.op in ("ALLREDUCE", "OPTIM"):
                step_ops.append((i, ins.op))
                if ins.stage != info.stage:
                    self.add(rank, i, ins, f"rank {rank} runs stage {info.stage}, not {ins.stage}")
                continue
            if ins.op in VERIFY_OPS:
                self._check_verify(rank, i, ins, have_input, verdict)
                continue
            if ins.stage != info.stage:
                self.add(rank, i, ins, f"rank {rank} runs stage {info.stage}, not stage {ins.stage}")
                continue
            if ins.mb not in info.microbatches:
                self.add(rank, i, ins, f"microbatch {ins.mb} belongs to another replica "
                                       f"(rank {rank} runs {list(info.microbatches)})")
                continue
            d = ins.direction
            if ins.op in COMPUTE_OPS:
                if (d, ins.mb) in seen:
                    self.add(rank, i, ins, f"{d}{ins.mb} runs twice (first at #{seen[(d, ins.mb)]})")
                seen[(d, ins.mb)] = i
                if d == "B" and ("F", ins.mb) not in seen:
                    self.add(rank, i, ins, f"backward of microbatch {ins.mb} before its forward")
                self._check_inputs(rank, i, ins, have_input, verdict)
                live += 1 if d == "F" else -1
                peak = max(peak, live)
            elif ins.op in SEND_OPS:
                self._check_send(rank, i, ins, seen)
            elif ins.op in RECV_OPS:
                self._check_recv(rank, i, ins)
                have_input.add((d, ins.mb))
            elif ins.op in VERDICT_OPS:
                if self.checked.get((ins.boundary, d, ins.mb)) != ins.peer:
                    self.add(rank, i, ins, f"rank {ins.peer} is not the verifier of boundary {ins.boundary}")
                verdict.add((d, ins.mb))
        if info.stage is not None:
            self._check_coverage(rank, seen)
            self._check_step_ops(rank, step_ops, seen)
            self._check_in_flight(rank, peak)
        elif step_ops:
            self.add(rank, step_ops[0][0], prog[step_ops[0][0]], "a verifier-only rank has no stage to step")

    def _check_inputs(self, rank: int, i: int, ins: Instruction, have_input: set, verdict: set) -> None:
        d, k = ins.direction, ins.stage
        needs_input = (d == "F" and k > 0) or (d == "B" and k < self.S - 1)
        if not needs_input:
            return
        if (d, ins.mb) not in have_input:
            self.add(rank, i, ins, f"runs before receiving its input ({k}RECV_{d}{ins.mb} missing or later)")
        boundary = k - 1 if d == "F" else k
        checker = self.checked.get((boundary, d, ins.mb))
        if checker is not None and (d, ins.mb) not in verdict:
            self.add(rank, i, ins, f"uses boundary {boundary}'s tensor before its verdict "
                                   f"(verifier rank {checker})")

    def _check_send(self, rank: int, i: int, ins: Instruction, seen: dict) -> None:
        d, k = ins.direction, ins.stage
        if (d, ins.mb) not in seen:
            self.add(rank, i, ins, f"sends before computing it ({k}{d}{ins.mb} missing or later)")
        nxt = k + 1 if d == "F" else k - 1
        if not 0 <= nxt < self.S:
            self.add(rank, i, ins, f"stage {k} has no stage {nxt} to send to")
            return
        boundary = k if d == "F" else k - 1
        allowed = {self.owner.get((nxt, ins.mb)), self.checked.get((boundary, d, ins.mb))}
        if ins.peer not in allowed:
            self.add(rank, i, ins, f"rank {ins.peer} neither runs microbatch {ins.mb} of stage {nxt} "
                                   f"nor verifies boundary {boundary}")

    def _check_recv(self, rank: int, i: int, ins: Instruction) -> None:
        d, k = ins.direction, ins.stage
        prev = k - 1 if d == "F" else k + 1
        if not 0 <= prev < self.S:
            self.add(rank, i, ins, f"stage {k} has no stage {prev} to receive from")
        elif self.owner.get((prev, ins.mb)) != ins.peer:
            self.add(rank, i, ins, f"microbatch {ins.mb} of stage {prev} runs on rank "
                                   f"{self.owner.get((prev, ins.mb))}, not {ins.peer}")

    def _check_verify(self, rank: int, i: int, ins: Instruction, have_input: set, verdict: set) -> None:
        d = ins.direction
        if self.checked.get((ins.boundary, d, ins.mb)) != rank:
            self.add(rank, i, ins, f"rank {rank} is not the verifier of boundary {ins.boundary} ({d})")
            return
        consumer = self.owner.get((ins.stage, ins.mb))
        producer_stage = ins.stage - 1 if d == "F" else ins.stage + 1
        producer = self.owner.get((producer_stage, ins.mb))
        if ins.peer is None and rank not in (consumer, producer):
            self.add(rank, i, ins, "verifies locally a tensor this rank neither makes nor receives")
        if ins.peer is not None and ins.peer != producer:
            self.add(rank, i, ins, f"the tensor comes from rank {producer}, not {ins.peer}")
        if rank == consumer:
            if ins.dest is not None:
                self.add(rank, i, ins, "the consumer verifies for itself: no verdict to send")
            elif (d, ins.mb) not in have_input:
                self.add(rank, i, ins, "verifies a tensor before receiving it")
            verdict.add((d, ins.mb))
        elif ins.dest != consumer:
            self.add(rank, i, ins, f"the verdict must go to rank {consumer} (the consumer), not {ins.dest}")

    def _check_coverage(self, rank: int, seen: dict) -> None:
        info = self.plan.ranks[rank]
        for m in info.microbatches:
            for d in COMPUTE_OPS:
                if (d, m) not in seen:
                    self.add(rank, None, None, f"microbatch {m} has no {d} on stage {info.stage}")

    def _check_step_ops(self, rank: int, step_ops: list, seen: dict) -> None:
        info = self.plan.ranks[rank]
        replicated = len(self.plan.stage_ranks(info.stage)) > 1
        expected = ["ALLREDUCE", "OPTIM"] if replicated else ["OPTIM"]
        if [op for _, op in step_ops] != expected:
            self.add(rank, None, None, f"expected {' then '.join(expected)} once each, found "
                                       f"{[op for _, op in step_ops] or 'none'}")
            return
        last_b = max((i for (d, _), i in seen.items() if d == "B"), default=-1)
        if step_ops[0][0] < last_b:
            self.add(rank, step_ops[0][0], self.plan.programs[rank][step_ops[0][0]],
                     f"comes before the last backward (#{last_b})")

    def _check_in_flight(self, rank: int, peak: int) -> None:
        info = self.plan.ranks[rank]
        n = len(info.microbatches)
        if info.max_in_flight > n:
            self.add(rank, None, None, f"max_in_flight {info.max_in_flight} exceeds the rank's {n} microbatches")
        if peak > info.max_in_flight:
            self.add(rank, None, None, f"holds {peak} microbatches' activations at once, "
                                       f"the plan promises at most {info.max_in_flight}")

    # --- 3/4: matching and coverage of verification ------------------------
    def check_matching(self) -> None:
        sends: dict[tuple, list[tuple[int, int]]] = {}
        recvs: dict[tuple, list[tuple[int, int]]] = {}
        for rank, prog in enumerate(self.plan.programs):
            for i, ins in enumerate(prog):
                for side, key in message_keys(ins, rank):
                    (sends if side == "send" else recvs).setdefault(key, []).append((rank, i))
        for key, where in sends.items():
            n = len(recvs.get(key, ()))
            if n != 1 or len(where) != 1:
                rank, i = where[0]
                self.add(rank, i, self.plan.programs[rank][i],
                         f"sent {len(where)} time(s) and received {n} time(s) on rank {key[4]} "
                         f"(expected exactly one matching receive)")
        for key, where in recvs.items():
            if key not in sends:
                rank, i = where[0]
                self.add(rank, i, self.plan.programs[rank][i], f"no rank {key[3]} sends it")
        self._check_verified_once()

    def _check_verified_once(self) -> None:
        count = Counter((ins.boundary, ins.direction, ins.mb) for prog in self.plan.programs
                        for ins in prog if ins.op in VERIFY_OPS)
        for (boundary, d, m), rank in self.checked.items():
            if count[(boundary, d, m)] != 1:
                self.add(rank, None, None, f"boundary {boundary} ({d}) of microbatch {m} is verified "
                                           f"{count[(boundary, d, m)]} times, expected once")

    # --- 7: deadlock -----------------------------------------------------
    def check_deadlock(self) -> None:
        """Run every program with non-blocking sends and blocking receives; all must finish."""
        programs = self.plan.programs
        pc = [0] * len(programs)
        mailbox: Counter = Counter()
        at_barrier: dict[int, set[int]] = {}
        progress = True
        while progress:
            progress = False
            for rank, prog in enumerate(programs):
                while pc[rank] < len(prog) and self._step(rank, prog[pc[rank]], mailbox, at_barrier):
                    pc[rank] += 1
                    progress = True
            for stage, waiting in list(at_barrier.items()):
                group = set(self.plan.stage_ranks(stage))
                if waiting == group:  # every replica reached ALLREDUCE: release them together
                    for rank in group:
                        pc[rank] += 1
                    del at_barrier[stage]
                    progress = True
        for rank, prog in enumerate(programs):
            if pc[rank] < len(prog):
                self.add(rank, pc[rank], prog[pc[rank]], "deadlock: blocks forever here")

    def _step(self, rank: int, ins: Instruction, mailbox: Counter, at_barrier: dict) -> bool:
        """Execute ``ins`` if it cannot block; False if it waits."""
        if ins.op == "ALLREDUCE":
            at_barrier.setdefault(ins.stage, set()).add(rank)
            return False
        keys = message_keys(ins, rank)
        for side, key in keys:
            if side == "recv" and mailbox[key] < 1:
                return False
        for side, key in keys:
            mailbox[key] += 1 if side == "send" else -1
        return True


def find_problems(plan: Plan) -> list[ProgramFault]:
    """Every problem found in ``plan``'s programs (empty when they are valid)."""
    checker = _Checker(plan)
    checker.check_layout()
    checker.check_matching()  # first: an unmatched message is usually the root cause of the rest
    for rank in range(plan.num_ranks):
        checker.check_rank(rank)
    if not checker.problems:  # a deadlock report is only meaningful for well-formed programs
        checker.check_deadlock()
    return checker.problems


def validate_programs(plan: Plan) -> None:
    """Raise InvalidInputError describing the first problem of ``plan``'s programs, if any."""
    problems = find_problems(plan)
    if problems:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise InvalidInputError(f"invalid plan program: {problems[0].message()}{more}", fix=_FIX)
