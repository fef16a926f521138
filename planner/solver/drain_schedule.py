"""The compiled 1F1B and GPipe programs' passes, checks and messages, list-scheduled earliest first: when each
stage's last backward ends (issue 36: throttled drains and forced grids).

The closed forms of ``program_cost`` price each resource's busy time plus the path around it, and the stages
downstream of the bottleneck from its last forward. Where several resources nearly pace the pipeline at once,
the microbatches meet each of them late in turn and the delays add up, which no single resource shows:

* DT-FM worldwide, gpt-1.3b, the first stages single-device and the later ones replicated: stage 1 runs all 64
  forwards first; the replicated stages below it each hold a long window, so the last forward waits behind
  backwards at each of them (about 100 ms a stage) and reaches the throttled last stages 340 ms later than the
  closed form says: their all-reduces start that much later (priced 9.3% under its simulation).
* SWARM-like forced grids (4x1 .. 6x1): the link from stage 1 into the trusted stage-0 verifier carries its
  gradients and the copies of its activations; the copies' verdicts gate the stages below, and the last
  gradients come back at the pace of the slowest stage downstream, not the link's (priced 6-9% under).

So this runs the programs the compiler would emit, in two passes. First the order (``_Lister``): the compiler's
list scheduler (``planner.schedules``) with its estimates: a stage replica runs its forwards in microbatch order
while fewer than its in-flight limit are in flight, and the backward of an in-flight microbatch whose gradient
is in, whichever can start first (GPipe: every forward, then the backwards in the forwards' order, each once its
gradient is in; at equal times a check first, then the pass unlike its last); a pass whose
input a remote verifier checks is placed once that verdict is; a consumer that checks its input runs the check
first, a sender that checks its output runs it after sending; a verifier checks the copies that can start
first, the lowest microbatch's. Then the times (``_Replay``): each device runs that order as the simulator
does, blocking until what its next step needs is in; a result leaves (a gradient's: the next backward starts)
only once its input's verdict is; each message, verdicts included, takes its directed link's wire after the
ones sent before it (the latency overlapping the next): a verdict queued behind its verifier's activations
halts the programs that wait on it, in their compiled order (``verdict_backlog``'s case, exactly). An audit's
work on the step's path runs here too, the order placed without it (the compiler's estimates know nothing of
it): the forwards that sign or check signed inputs run longer (``run_fb``), an auditor's gradient checks by its
recomputes (``check_extra``), and its copies' stepper (``background``: the last step's deferred recomputes and
copy steps) shares its device with its passes and checks (``audit_price.Stepper``), as the simulator runs them.
Not run: shared cores. Cost: one heap
operation per pass, check and message (GPipe finds its next backward's gradient by microbatch, in a dict),
then (with verifiers) one step each.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from planner.solver.audit_price import Stepper, StepperPart
from planner.solver.problem import Problem
from planner.solver.routing import owners

Key = tuple[int, str, int]  # (boundary, F|B, microbatch): a checked tensor


@dataclass(slots=True)
class _Device:
    """One device's state: a stage replica's (``stage`` >= 0) and/or a verifier's queue of copies."""

    order: int
    name: str = ""
    stage: int = -1
    ids: tuple[int, ...] = ()
    limit: int = 0
    fwd_ms: float = 0.0
    bwd_ms: float = 0.0
    next_fwd: int = 0
    next_bwd: int = 0   # GPipe: its backwards run in its forwards' order, this one next
    held: int = 0
    inputs: dict[int, float] = field(default_factory=dict)     # microbatch -> its input's arrival
    waiting: list[tuple[float, int]] = field(default_factory=list)  # 1F1B: gradients (arrival, mb), not yet due
    due: list[int] = field(default_factory=list)               # 1F1B: microbatches whose gradient is in by the clock
    grads: dict[int, float] = field(default_factory=dict)      # GPipe: microbatch -> its gradient's arrival
    copies: list[tuple[float, int, int, Key, str]] = field(default_factory=list)  # (arrival, mb, B first, ...)
    checkable: list[tuple[int, int, float, Key, str]] = field(default_factory=list)  # copies in by the clock
    clock: float = 0.0
    b_gate: float = 0.0
    last_op: str = ""
    version: int = 0
    offered: float = float("inf")  # when the step it has on the heap would start (inf: none)
    program: list[tuple] = field(default_factory=list)  # what it was placed to run, in order


class _Lister:
    """One list-scheduling run (``drain_schedule``)."""

    def __init__(self, problem: Problem, stages, verifiers, fb, bw, limits) -> None:
        self.problem, self.stages, self.S = problem, stages, len(stages)
        self.gpipe = problem.schedule == "gpipe"
        self.owner = [owners(st.microbatches) for st in stages]
        self.dev: dict[str, _Device] = {}
        for k, st in enumerate(stages):
            routes: list[list[int]] = [[] for _ in st.devices]
            for x, (i, _) in enumerate(self.owner[k]):
                routes[i].append(x)
            for i, d in enumerate(st.devices):
                n = len(routes[i]) if self.gpipe else limits[k][i]   # GPipe holds every microbatch
                self.dev[d] = _Device(order=len(self.dev), name=d, stage=k, ids=tuple(routes[i]),
                                      limit=max(1, n), fwd_ms=fb[k][i] - bw[k][i], bwd_ms=bw[k][i])
        for v in verifiers:
            self.dev.setdefault(v.device, _Device(order=len(self.dev), name=v.device))
        for d in stages[0].devices:
            self.dev[d].inputs = {x: 0.0 for x in self.dev[d].ids}
        self.verifiers, self.checker = verifiers, _checkers(stages, verifiers)
        # per stage, per microbatch: the device that runs it; and what checks its forward's / backward's input
        self.runs = [[st.devices[i] for i, _ in self.owner[k]] for k, st in enumerate(stages)]
        self.run_on = [[self.dev[d] for d in row] for row in self.runs]
        self.sources = {op: [[self._source(k, op, x) for x in range(len(self.owner[k]))] if self.checker else
                             [None] * len(self.owner[k]) for k in range(self.S)] for op in "FB"}
        self.nbytes = [problem.wire_bytes(st.last_block, st.out_codec) for st in stages[:-1]]
        self.check: dict[tuple[str, int, str], float] = {}  # (device, boundary, F|B) -> ms
        self.links: dict[tuple[str, str], list[float]] = {}  # [wire free from, ms per byte, latency ms]
        self.verdict: dict[Key, float] = {}
        self.grads: dict[Key, tuple[str, float]] = {}  # a checked gradient in before its verdict: (consumer, arrival)
        self.heap: list[tuple[float, int, int, int, str, int, str]] = []
        self.last_b = [0.0] * self.S

    def run(self) -> tuple[float, ...]:
        return self.run_plain() if not self.verifiers else self.run_listed()

    def run_listed(self) -> tuple[float, ...]:
        """Each placed step, its program kept; checks, copies and verdicts included."""
        for d in self.dev.values():
            self.offer(d)
        heap, pop = self.heap, heapq.heappop
        while heap:
            t, _, _, version, op, x, d = pop(heap)
            if version != d.version:
                continue
            d.offered = float("inf")
            if op == "V":
                self.place_check(d)
            else:
                self.place_pass(d, op, x, t)
            self.offer(d)
        return tuple(self.last_b)

    def run_plain(self) -> tuple[float, ...]:
        """``run`` without verifiers (no checks, copies or verdicts), its steps inlined: the same placements, and
        no programs kept (only a replay with verdicts reads them). Most pricings in a search take this path."""
        offer, S, nbytes, run_on, last_b = self.offer_plain, self.S, self.nbytes, self.run_on, self.last_b
        transmit, heap, pop, push, gpipe = self.transmit, self.heap, heapq.heappop, heapq.heappush, self.gpipe
        for d in self.dev.values():
            offer(d)
        while heap:
            t, _, _, version, op, x, d = pop(heap)
            if version != d.version:
                continue
            k = d.stage
            d.last_op = op
            if op == "F":
                end = d.clock = t + d.fwd_ms
                d.next_fwd += 1
                d.held += 1
                if k + 1 < S:
                    target = run_on[k + 1][x]
                    at = target.inputs[x] = transmit(d.name, target.name, nbytes[k], end)
                    if at <= target.offered:
                        offer(target)
                elif gpipe:  # the last stage's backward follows its forward
                    d.grads[x] = end
                else:
                    push(d.waiting, (end, x))
            else:
                end = d.clock = t + d.bwd_ms
                self.take_gradient(d, x)
                d.held -= 1
                last_b[k] = max(last_b[k], end)
                if k > 0:
                    target = run_on[k - 1][x]
                    at = transmit(d.name, target.name, nbytes[k - 1], end)
                    if gpipe:
                        target.grads[x] = at
                    else:
                        push(target.waiting, (at, x))
                    if at <= target.offered:
                        offer(target)
            offer(d)
        return tuple(last_b)

    def offer_plain(self, d: _Device) -> None:
        """``offer`` without verifiers: a stage replica's next backward or forward."""
        d.version += 1
        clock, waiting, due = d.clock, d.waiting, d.due
        while waiting and waiting[0][0] <= clock:
            heapq.heappush(due, heapq.heappop(waiting)[1])
        kind = 2 if d.last_op == "B" else 1
        if self.gpipe:
            b = self.gpipe_backward(d)
            best = None if b is None else (b[0], kind, "B", b[1])
        else:
            best = (clock, kind, "B", due[0]) if due else (waiting[0][0], kind, "B", waiting[0][1]) if waiting else None
        if d.next_fwd < len(d.ids) and d.held < d.limit and d.ids[d.next_fwd] in d.inputs:
            x = d.ids[d.next_fwd]
            at = d.inputs[x]
            f = (max(clock, at), 3 - kind, "F", x)
            best = f if best is None or f < best else best
        self._push(d, best)

    def gpipe_backward(self, d: _Device) -> tuple[float, int] | None:
        """GPipe: (when it can start, microbatch) of ``d``'s next backward: every forward placed first, then the
        backwards in the order of the forwards (``planner.schedules``), each once its gradient is in; None: not
        yet (or none left)."""
        if d.next_fwd < len(d.ids) or d.next_bwd >= len(d.ids):
            return None
        x = d.ids[d.next_bwd]
        at = d.grads.get(x)
        return None if at is None else (max(d.clock, at), x)

    def take_gradient(self, d: _Device, x: int) -> None:
        """``x``'s gradient, used by the backward placed now: 1F1B offers the lowest one in or else the earliest to
        come, GPipe the next in its forwards' order, wherever it is."""
        if self.gpipe:
            d.next_bwd += 1
            del d.grads[x]
        elif d.due and d.due[0] == x:
            heapq.heappop(d.due)
        else:
            heapq.heappop(d.waiting)  # offered as the earliest gradient still to come

    def gradient_in(self, d: _Device, at: float, x: int) -> None:
        """``x``'s gradient arrives on ``d`` at ``at``: GPipe looks it up by microbatch, 1F1B takes the earliest."""
        if self.gpipe:
            d.grads[x] = at
        else:
            heapq.heappush(d.waiting, (at, x))

    def _push(self, d: _Device, best: tuple | None) -> None:
        """``d``'s earliest step ``best`` (time, rank, op, microbatch) onto the heap; none: it waits."""
        if best is None:
            d.offered = float("inf")
        else:
            d.offered = best[0]
            heapq.heappush(self.heap, (best[0], best[1], d.order, d.version, best[2], best[3], d))

    def link(self, a: str, b: str) -> list[float]:
        """The directed link from ``a`` to ``b``: [when its wire is next free, ms per byte, latency ms]."""
        out = self.links.get((a, b))
        if out is None:
            spec = self.problem.link(a, b)
            out = self.links[(a, b)] = [0.0, 1e3 / spec.bytes_per_s, spec.latency_ms]
        return out

    def transmit(self, a: str, b: str, nbytes: float, at: float) -> float:
        """Arrival of a message sent at ``at``: after the ones before it on the wire; the latency overlaps."""
        if a == b:
            return at
        wire = self.links.get((a, b)) or self.link(a, b)
        free = wire[0]
        end = wire[0] = (max(free, at)) + nbytes * wire[1]
        return end + wire[2]

    def latency(self, a: str, b: str) -> float:
        """A verdict's few bytes: the compiler orders by its latency, not waiting for the wire."""
        return self.link(a, b)[2]

    def check_ms(self, d: str, boundary: int, op: str) -> float:
        ms = self.check.get((d, boundary, op))
        if ms is None:
            raw = self.problem.raw_bytes(self.stages[boundary].last_block)
            ms = self.check[(d, boundary, op)] = self.problem.verify_ms(raw, self.problem.class_of(d))
        return ms

    def _source(self, k: int, op: str, x: int) -> tuple[Key, str] | None:
        """The verdict key of pass ``op`` of ``x`` at stage ``k``'s input, and its checker (None: unchecked)."""
        if not self.checker:
            return None
        b = k - 1 if op == "F" else k
        if not 0 <= b < self.S - 1:
            return None
        at = b if op == "F" else b + 1
        v = self.checker.get((b, op, self.runs[at][x]))
        return None if v is None else ((b, op, x), v)

    def offer(self, d: _Device) -> None:
        """Put ``d``'s earliest possible next step on the heap (replacing the one it had there)."""
        d.version += 1
        clock, copies = d.clock, d.copies
        while copies and copies[0][0] <= clock:
            arrival, x, flag, key, consumer = heapq.heappop(copies)
            heapq.heappush(d.checkable, (x, flag, arrival, key, consumer))
        best = (clock, 0, "V", -1) if d.checkable else (copies[0][0], 0, "V", -1) if copies else None
        if d.stage >= 0:
            waiting, due = d.waiting, d.due
            while waiting and waiting[0][0] <= clock:
                heapq.heappush(due, heapq.heappop(waiting)[1])
            kind = 2 if d.last_op == "B" else 1
            if self.gpipe:   # its next backward in its forwards' order, once every forward is placed
                nxt = self.gpipe_backward(d)
                if nxt is not None:
                    b = (max(nxt[0], d.b_gate), kind, "B", nxt[1])
                    best = b if best is None or b < best else best
            elif due:  # of the gradients in, the lowest microbatch's
                b = (max(clock, d.b_gate), kind, "B", due[0])
                best = b if best is None or b < best else best
            elif waiting:
                b = (max(waiting[0][0], d.b_gate), kind, "B", waiting[0][1])
                best = b if best is None or b < best else best
            if d.next_fwd < len(d.ids) and d.held < d.limit and d.ids[d.next_fwd] in d.inputs:
                x = d.ids[d.next_fwd]
                src = self.sources["F"][d.stage][x]
                if src is None or src[1] == d.name or src[0] in self.verdict:  # a remote verdict is placed first
                    f = (max(clock, d.inputs[x]), 3 - kind, "F", x)
                    best = f if best is None or f < best else best
        self._push(d, best)

    def arrived(self, d: _Device, at: float) -> None:
        """Something ``d`` needs arrives at ``at``: only a step that could start before the one it has on the
        heap changes its choice (one starting later cannot, and it offers again once that one is placed)."""
        if at <= d.offered:
            self.offer(d)

    def place_check(self, d: _Device) -> None:
        # of the copies that can start first, the lowest microbatch's, a gradient before an activation
        if d.checkable:
            _, _, arrival, key, consumer = heapq.heappop(d.checkable)
        else:
            arrival, _, _, key, consumer = heapq.heappop(d.copies)
        d.program.append(("V", key, consumer))
        d.clock = max(d.clock, arrival) + self.check_ms(d.name, key[0], key[1])
        self.verdict[key] = d.clock + self.latency(d.name, consumer)
        held = self.grads.pop(key, None)
        target = self.dev[consumer]
        if held is not None:
            self.gradient_in(target, held[1], key[2])
        self.offer(target)

    def place_pass(self, d: _Device, op: str, x: int, start: float) -> None:
        k, name = d.stage, d.name
        src = self.sources[op][k][x]
        if src is not None and src[1] == name:  # the consumer checks its input itself, first
            start += self.check_ms(name, src[0][0], op)
        gate = self.verdict.get(src[0], 0.0) if src is not None and src[1] != name else 0.0
        d.program.append((op, x))
        d.last_op = op
        if op == "F":
            end = start + d.fwd_ms
            d.next_fwd += 1
            d.held += 1
            if k + 1 < self.S:
                d.clock = max(end, gate)
                self.send(d, k, k + 1, op, x)
            else:  # the last stage's backward follows its forward (and its input's verdict)
                d.clock = end
                self.gradient_in(d, max(end, gate), x)
            return
        end = start + d.bwd_ms
        self.take_gradient(d, x)
        d.held -= 1
        d.b_gate = gate
        self.last_b[k] = max(self.last_b[k], end)
        if k > 0:
            d.clock = max(end, gate)
            self.send(d, k, k - 1, op, x)
        else:
            d.clock = end

    def send(self, d: _Device, k: int, nxt: int, op: str, x: int) -> None:
        b, name = min(k, nxt), d.name
        target = self.run_on[nxt][x]
        consumer = target.name
        at = self.transmit(name, consumer, self.nbytes[b], d.clock)
        v = self.checker.get((b, op, name)) if self.checker else None
        if op == "F":
            target.inputs[x] = at
        elif v is None or v == consumer or (b, op, x) in self.verdict:
            self.gradient_in(target, at, x)
        else:  # a remotely checked gradient counts once its verdict is placed
            self.grads[(b, op, x)] = (consumer, at)
        if v == name:  # the sender checks its own output after sending it
            d.clock += self.check_ms(name, b, op)
            self.verdict[(b, op, x)] = d.clock + self.latency(name, consumer)
            held = self.grads.pop((b, op, x), None)
            if held is not None:
                self.gradient_in(target, held[1], x)
        elif v is not None and v != consumer:
            copy = self.transmit(name, v, self.nbytes[b], d.clock)
            checker = self.dev[v]
            heapq.heappush(checker.copies, (copy, x, 0 if op == "B" else 1, (b, op, x), consumer))
            self.arrived(checker, copy)
        self.arrived(target, at)


def drain_schedule(problem: Problem, stages, verifiers, fb, bw, limits) -> tuple[float, ...]:
    """Per stage, when its last backward ends: the passes of ``stages`` (``fb``/``bw``: per replica forward +
    backward and backward ms; ``limits``: in-flight limit per replica) and ``verifiers``' checks, ordered as the
    compiler orders them and run as the simulator runs that order (module docstring)."""
    return drain_with_steppers(problem, stages, verifiers, fb, bw, limits, {}).finishes


@dataclass(frozen=True, slots=True)
class Drained:
    """A drain's result: per stage when its last backward ends (``finishes``), per auditor when its copies'
    stepper is through its queue (``stepped``), and per device when its last pass or check ends (``done``: where
    a stage replica's all-reduce starts, and a verifier-only device's program ends)."""

    finishes: tuple[float, ...]
    stepped: dict[str, float]
    done: dict[str, float]


def drain_with_steppers(problem: Problem, stages, verifiers, fb, bw, limits,
                        background: dict[str, tuple[StepperPart, ...]], *, run_fb=None,
                        check_extra: dict[tuple[str, int, str], float] | None = None) -> Drained:
    """``drain_schedule`` with ``background`` (auditor device -> its copies' stepper's queue at the step's start,
    ``audit_price.stepper_parts``) sharing those devices. ``fb`` are the compiler's estimates, which order the
    programs; ``run_fb`` (None: ``fb``) the forwards as they run, longer where an audit from signed inputs signs
    or checks each (``audit_price.signing_ms``), and ``check_extra`` ((device, boundary, F|B) -> ms) the checks
    that run longer, an auditor's recompute among its gradient checks (``simulate._audit_checks``): the compiler
    knows of neither (``instruction_costs.CostModel``), so they stretch the order it placed."""
    lister = _Lister(problem, stages, verifiers, fb, bw, limits)
    placed = lister.run()   # the compiler orders with its estimates, which know nothing of the steppers
    exact = run_fb is None or run_fb == fb
    if not verifiers and exact:   # without verdicts the compiler's estimates are the simulator's times
        done = {d.name: d.clock for d in lister.dev.values()}
        return Drained(finishes=placed, stepped={}, done=done)
    run_fwd = None if exact else {d: run_fb[k][i] - bw[k][i] for k, st in enumerate(stages)
                                  for i, d in enumerate(st.devices)}
    replay = _Replay(lister, {d: Stepper(parts=parts) for d, parts in background.items() if d in lister.dev},
                     fwd_ms=run_fwd, check_extra=check_extra)
    finishes = replay.run()
    return Drained(finishes=finishes, stepped={d: st.done_ms() for d, st in replay.steppers.items()},
                   done=dict(replay.clock))


class _Replay:
    """The placed order run with the simulator's timing: a device blocks until what its next step needs is in,
    and a verdict waits for its link's wire like any message (``planner.simulate``)."""

    def __init__(self, lister: _Lister, steppers: dict[str, Stepper] | None = None, *,
                 fwd_ms: dict[str, float] | None = None,
                 check_extra: dict[tuple[str, int, str], float] | None = None) -> None:
        self.ls = lister
        self.steppers = steppers or {}
        self.fwd_ms = fwd_ms or {}   # device -> its forward as it runs, where not the compiler's estimate
        self.check_extra = check_extra or {}
        for wire in lister.links.values():
            wire[0] = 0.0
        self.inputs = {name: dict.fromkeys(d.ids, 0.0) if d.stage == 0 else {} for name, d in lister.dev.items()}
        self.grads: dict[str, dict[int, float]] = {name: {} for name in lister.dev}
        self.copies: dict[Key, float] = {}
        self.verdict: dict[Key, float] = {}
        self.clock = dict.fromkeys(lister.dev, 0.0)
        self.b_gate = dict.fromkeys(lister.dev, 0.0)
        self.waits: dict[tuple, str] = {}  # what a blocked device waits for -> that device
        self.woken: list[str] = []
        self.last_b = [0.0] * lister.S

    def run(self) -> tuple[float, ...]:
        ls = self.ls
        self.woken = list(ls.dev)
        at = dict.fromkeys(ls.dev, 0)
        while self.woken:
            name = self.woken.pop()
            program, i = ls.dev[name].program, at[name]
            while i < len(program):
                missing = self.missing(name, program[i])
                if missing is not None:
                    self.waits[missing] = name
                    break
                self.execute(name, program[i])
                i += 1
            at[name] = i
        return tuple(self.last_b)

    def wake(self, token: tuple) -> None:
        name = self.waits.pop(token, None)
        if name is not None:
            self.woken.append(name)

    def missing(self, name: str, step: tuple) -> tuple | None:
        """What ``step`` on ``name`` still waits for (None: it can run)."""
        if step[0] == "V":
            return None if step[1] in self.copies else ("c", step[1])
        op, x = step
        d = self.ls.dev[name]
        last = d.stage == self.ls.S - 1
        if op == "F" and x not in self.inputs[name]:
            return ("in", name, x)
        if op == "B" and not last and x not in self.grads[name]:
            return ("g", name, x)
        src = self.ls.sources["F" if op == "B" and last else op][d.stage][x]
        if src is not None and src[1] != name and src[0] not in self.verdict:
            return ("v", src[0])
        return None

    def execute(self, name: str, step: tuple) -> None:
        ls = self.ls
        if step[0] == "V":
            _, key, consumer = step
            start = max(self.clock[name], self.copies[key])
            self.clock[name] = start + self.work(name, start, self.check_ms(name, key[0], key[1]))
            self.send_verdict(name, consumer, key)
            return
        op, x = step
        d = ls.dev[name]
        k, S = d.stage, ls.S
        if op == "F":
            start = max(self.clock[name], self.inputs[name][x])
        elif k < S - 1:
            start = max(self.clock[name], self.grads[name][x], self.b_gate[name])
        else:  # the last stage's backward follows its forward and that forward's input's verdict
            src = ls.sources["F"][k][x]
            start = max(self.clock[name], self.verdict[src[0]] if src is not None and src[1] != name else 0.0)
        src = ls.sources[op][k][x]
        own = self.fwd_ms.get(name, d.fwd_ms) if op == "F" else d.bwd_ms
        if src is not None and src[1] == name:  # the consumer checks its input itself, first
            own += self.check_ms(name, src[0][0], op)
        end = start + self.work(name, start, own)
        gate = self.verdict[src[0]] if src is not None and src[1] != name else 0.0
        nxt = k + 1 if op == "F" else k - 1
        if op == "B":
            self.b_gate[name] = gate
            self.last_b[k] = max(self.last_b[k], end, gate)
        self.clock[name] = max(end, gate) if 0 <= nxt < S else end
        if 0 <= nxt < S:
            self.send(name, k, nxt, op, x)

    def send(self, name: str, k: int, nxt: int, op: str, x: int) -> None:
        ls = self.ls
        b = min(k, nxt)
        consumer = ls.stages[nxt].devices[ls.owner[nxt][x][0]]
        at = ls.transmit(name, consumer, ls.nbytes[b], self.clock[name])
        (self.inputs if op == "F" else self.grads)[consumer][x] = at
        self.wake(("in" if op == "F" else "g", consumer, x))
        v = ls.checker.get((b, op, name)) if ls.checker else None
        if v == name:  # the sender checks its own output after sending it
            self.clock[name] += self.work(name, self.clock[name], self.check_ms(name, b, op))
            self.send_verdict(name, consumer, (b, op, x))
        elif v is not None and v != consumer:
            self.copies[(b, op, x)] = ls.transmit(name, v, ls.nbytes[b], self.clock[name])
            self.wake(("c", (b, op, x)))

    def check_ms(self, name: str, boundary: int, op: str) -> float:
        """A check as it runs: the compiler's estimate, and an audit's recompute where it rides on it."""
        return self.ls.check_ms(name, boundary, op) + self.check_extra.get((name, boundary, op), 0.0)

    def work(self, name: str, start: float, ms: float) -> float:
        """How long ``ms`` of work on ``name`` from ``start`` lasts: beside its copies' stepper, if it audits."""
        stepper = self.steppers.get(name)
        return ms if stepper is None else stepper.share(start, ms)

    def send_verdict(self, name: str, consumer: str, key: Key) -> None:
        self.verdict[key] = self.ls.transmit(name, consumer, 0.0, self.clock[name])
        self.wake(("v", key))


def _checkers(stages, verifiers) -> dict[tuple[int, str, str], str]:
    """(boundary, F|B, sending device) -> the device that checks what it sends there."""
    out: dict[tuple[int, str, str], str] = {}
    for v in verifiers:
        k = v.boundary
        for direction in v.directions:
            op = "F" if direction == "act" else "B"
            for s in stages[k if op == "F" else k + 1].devices:
                if v.covers(s):
                    out[(k, op, s)] = v.device
    return out
