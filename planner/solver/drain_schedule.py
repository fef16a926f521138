"""The compiled 1F1B programs' passes, checks and messages, list-scheduled earliest first: when each stage's
last backward ends (issue 36: throttled drains and forced grids).

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
is in, whichever can start first (at equal times a check first, then the pass unlike its last); a pass whose
input a remote verifier checks is placed once that verdict is; a consumer that checks its input runs the check
first, a sender that checks its output runs it after sending; a verifier checks the copies that can start
first, the lowest microbatch's. Then the times (``_Replay``): each device runs that order as the simulator
does, blocking until what its next step needs is in; a result leaves (a gradient's: the next backward starts)
only once its input's verdict is; each message, verdicts included, takes its directed link's wire after the
ones sent before it (the latency overlapping the next): a verdict queued behind its verifier's activations
halts the programs that wait on it, in their compiled order (``verdict_backlog``'s case, exactly). Not run:
audits (``program_cost`` adds what they add on its closed forms), shared cores. Cost: one heap operation
per pass, check and message, then (with verifiers) one step each.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from planner.solver.problem import Problem
from planner.solver.routing import owners

Key = tuple[int, str, int]  # (boundary, F|B, microbatch): a checked tensor


@dataclass(slots=True)
class _Device:
    """One device's state: a stage replica's (``stage`` >= 0) and/or a verifier's queue of copies."""

    order: int
    stage: int = -1
    ids: tuple[int, ...] = ()
    limit: int = 0
    fwd_ms: float = 0.0
    bwd_ms: float = 0.0
    next_fwd: int = 0
    held: int = 0
    inputs: dict[int, float] = field(default_factory=dict)     # microbatch -> its input's arrival
    waiting: list[tuple[float, int]] = field(default_factory=list)  # gradients in (arrival, microbatch), not yet due
    due: list[int] = field(default_factory=list)               # microbatches whose gradient is in by the clock
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
        self.owner = [owners(st.microbatches) for st in stages]
        self.dev: dict[str, _Device] = {}
        for k, st in enumerate(stages):
            routes: list[list[int]] = [[] for _ in st.devices]
            for x, (i, _) in enumerate(self.owner[k]):
                routes[i].append(x)
            for i, d in enumerate(st.devices):
                self.dev[d] = _Device(order=len(self.dev), stage=k, ids=tuple(routes[i]),
                                      limit=max(1, limits[k][i]), fwd_ms=fb[k][i] - bw[k][i], bwd_ms=bw[k][i])
        for v in verifiers:
            self.dev.setdefault(v.device, _Device(order=len(self.dev)))
        for d in stages[0].devices:
            self.dev[d].inputs = {x: 0.0 for x in self.dev[d].ids}
        self.checker = _checkers(stages, verifiers)
        self.nbytes = [problem.wire_bytes(st.last_block, st.out_codec) for st in stages[:-1]]
        self.check: dict[tuple[str, int, str], float] = {}  # (device, boundary, F|B) -> ms
        self.links: dict[tuple[str, str], tuple[float, float]] = {}  # (wire ms per byte, latency)
        self.verdict: dict[Key, float] = {}
        self.grads: dict[Key, tuple[str, float]] = {}  # a checked gradient in before its verdict: (consumer, arrival)
        self.free: dict[tuple[str, str], float] = {}
        self.heap: list[tuple[float, int, int, int, str, int, str]] = []
        self.last_b = [0.0] * self.S

    def run(self) -> tuple[float, ...]:
        for name in self.dev:
            self.offer(name)
        while self.heap:
            t, _, _, version, op, x, name = heapq.heappop(self.heap)
            d = self.dev[name]
            if version != d.version:
                continue
            d.offered = float("inf")
            if op == "V":
                self.place_check(name, d)
            else:
                self.place_pass(name, d, op, x, t)
            self.offer(name)
        return tuple(self.last_b)

    def link(self, a: str, b: str) -> tuple[float, float]:
        """(wire ms per byte, latency ms) from ``a`` to ``b``."""
        out = self.links.get((a, b))
        if out is None:
            spec = self.problem.link(a, b)
            out = self.links[(a, b)] = (1e3 / spec.bytes_per_s, spec.latency_ms)
        return out

    def transmit(self, a: str, b: str, nbytes: float, at: float) -> float:
        """Arrival of a message sent at ``at``: after the ones before it on the wire; the latency overlaps."""
        if a == b:
            return at
        per_byte, latency = self.link(a, b)
        begin = max(at, self.free.get((a, b), 0.0))
        end = self.free[(a, b)] = begin + nbytes * per_byte
        return end + latency

    def latency(self, a: str, b: str) -> float:
        """A verdict's few bytes: the compiler orders by its latency, not waiting for the wire."""
        return self.link(a, b)[1]

    def check_ms(self, d: str, boundary: int, op: str) -> float:
        ms = self.check.get((d, boundary, op))
        if ms is None:
            raw = self.problem.raw_bytes(self.stages[boundary].last_block)
            ms = self.check[(d, boundary, op)] = self.problem.verify_ms(raw, self.problem.class_of(d))
        return ms

    def source(self, k: int, op: str, x: int) -> tuple[Key, str] | None:
        """The verdict key of pass ``op`` of ``x`` at stage ``k``'s input, and its checker (None: unchecked)."""
        if not self.checker:
            return None
        b = k - 1 if op == "F" else k
        if not 0 <= b < self.S - 1:
            return None
        at = b if op == "F" else b + 1
        v = self.checker.get((b, op, self.stages[at].devices[self.owner[at][x][0]]))
        return None if v is None else ((b, op, x), v)

    def offer(self, name: str) -> None:
        """Put ``name``'s earliest possible next step on the heap (replacing the one it had there)."""
        d = self.dev[name]
        d.version += 1
        while d.copies and d.copies[0][0] <= d.clock:
            arrival, x, flag, key, consumer = heapq.heappop(d.copies)
            heapq.heappush(d.checkable, (x, flag, arrival, key, consumer))
        best = (d.clock, 0, "V", -1) if d.checkable else (d.copies[0][0], 0, "V", -1) if d.copies else None
        if d.stage >= 0:
            waiting, clock = d.waiting, d.clock
            while waiting and waiting[0][0] <= clock:
                heapq.heappush(d.due, heapq.heappop(waiting)[1])
            kind = 2 if d.last_op == "B" else 1
            if d.due:  # of the gradients in, the lowest microbatch's
                b = (max(clock, d.b_gate), kind, "B", d.due[0])
                best = b if best is None or b < best else best
            elif waiting:
                b = (max(waiting[0][0], d.b_gate), kind, "B", waiting[0][1])
                best = b if best is None or b < best else best
            if d.next_fwd < len(d.ids) and d.held < d.limit and d.ids[d.next_fwd] in d.inputs:
                x = d.ids[d.next_fwd]
                src = self.source(d.stage, "F", x)
                if src is None or src[1] == name or src[0] in self.verdict:  # a remote verdict is placed first
                    f = (max(clock, d.inputs[x]), 3 - kind, "F", x)
                    best = f if best is None or f < best else best
        d.offered = best[0] if best is not None else float("inf")
        if best is not None:
            heapq.heappush(self.heap, (best[0], best[1], d.order, d.version, best[2], best[3], name))

    def arrived(self, name: str, at: float) -> None:
        """Something ``name`` needs arrives at ``at``: only a step that could start before the one it has on the
        heap changes its choice (one starting later cannot, and it offers again once that one is placed)."""
        if at <= self.dev[name].offered:
            self.offer(name)

    def place_check(self, name: str, d: _Device) -> None:
        # of the copies that can start first, the lowest microbatch's, a gradient before an activation
        if d.checkable:
            _, _, arrival, key, consumer = heapq.heappop(d.checkable)
        else:
            arrival, _, _, key, consumer = heapq.heappop(d.copies)
        d.program.append(("V", key, consumer))
        d.clock = max(d.clock, arrival) + self.check_ms(name, key[0], key[1])
        self.verdict[key] = d.clock + self.latency(name, consumer)
        held = self.grads.pop(key, None)
        if held is not None:
            heapq.heappush(self.dev[consumer].waiting, (held[1], key[2]))
        self.offer(consumer)

    def place_pass(self, name: str, d: _Device, op: str, x: int, start: float) -> None:
        k = d.stage
        src = self.source(k, op, x)
        if src is not None and src[1] == name:  # the consumer checks its input itself, first
            start += self.check_ms(name, src[0][0], op)
        end = start + (d.fwd_ms if op == "F" else d.bwd_ms)
        gate = self.verdict.get(src[0], 0.0) if src is not None and src[1] != name else 0.0
        nxt = k + 1 if op == "F" else k - 1
        d.program.append((op, x))
        if op == "F":
            d.next_fwd += 1
            d.held += 1
        else:
            if d.due and d.due[0] == x:
                heapq.heappop(d.due)
            else:
                heapq.heappop(d.waiting)  # offered as the earliest gradient still to come
            d.held -= 1
            d.b_gate = gate
            self.last_b[k] = max(self.last_b[k], end)
        d.clock = max(end, gate) if 0 <= nxt < self.S else end
        d.last_op = op
        if 0 <= nxt < self.S:
            self.send(name, d, k, nxt, op, x)
        elif op == "F":  # the last stage's backward follows its forward (and its input's verdict)
            heapq.heappush(d.waiting, (max(d.clock, gate), x))

    def send(self, name: str, d: _Device, k: int, nxt: int, op: str, x: int) -> None:
        b = min(k, nxt)
        consumer = self.stages[nxt].devices[self.owner[nxt][x][0]]
        at = self.transmit(name, consumer, self.nbytes[b], d.clock)
        v = self.checker.get((b, op, name)) if self.checker else None
        if op == "F":
            self.dev[consumer].inputs[x] = at
        elif v is None or v == consumer or (b, op, x) in self.verdict:
            heapq.heappush(self.dev[consumer].waiting, (at, x))
        else:  # a remotely checked gradient counts once its verdict is placed
            self.grads[(b, op, x)] = (consumer, at)
        if v == name:  # the sender checks its own output after sending it
            d.clock += self.check_ms(name, b, op)
            self.verdict[(b, op, x)] = d.clock + self.latency(name, consumer)
            held = self.grads.pop((b, op, x), None)
            if held is not None:
                heapq.heappush(self.dev[consumer].waiting, (held[1], x))
        elif v is not None and v != consumer:
            copy = self.transmit(name, v, self.nbytes[b], d.clock)
            heapq.heappush(self.dev[v].copies, (copy, x, 0 if op == "B" else 1, (b, op, x), consumer))
            self.arrived(v, copy)
        self.arrived(consumer, at)


def drain_schedule(problem: Problem, stages, verifiers, fb, bw, limits) -> tuple[float, ...]:
    """Per stage, when its last backward ends: the passes of ``stages`` (``fb``/``bw``: per replica forward +
    backward and backward ms; ``limits``: in-flight limit per replica) and ``verifiers``' checks, ordered as the
    compiler orders them and run as the simulator runs that order (module docstring)."""
    lister = _Lister(problem, stages, verifiers, fb, bw, limits)
    placed = lister.run()
    # without verdicts the compiler's estimates are the simulator's times: the order's own times are the run's
    return _Replay(lister).run() if verifiers else placed


class _Replay:
    """The placed order run with the simulator's timing: a device blocks until what its next step needs is in,
    and a verdict waits for its link's wire like any message (``planner.simulate``)."""

    def __init__(self, lister: _Lister) -> None:
        self.ls = lister
        lister.free.clear()
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
            program = ls.dev[name].program
            while at[name] < len(program):
                missing = self.missing(name, program[at[name]])
                if missing is not None:
                    self.waits[missing] = name
                    break
                self.execute(name, program[at[name]])
                at[name] += 1
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
        src = self.ls.source(d.stage, "F" if op == "B" and last else op, x)
        if src is not None and src[1] != name and src[0] not in self.verdict:
            return ("v", src[0])
        return None

    def execute(self, name: str, step: tuple) -> None:
        ls = self.ls
        if step[0] == "V":
            _, key, consumer = step
            self.clock[name] = max(self.clock[name], self.copies[key]) + ls.check_ms(name, key[0], key[1])
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
            src = ls.source(k, "F", x)
            start = max(self.clock[name], self.verdict[src[0]] if src is not None and src[1] != name else 0.0)
        src = ls.source(k, op, x)
        if src is not None and src[1] == name:  # the consumer checks its input itself, first
            start += ls.check_ms(name, src[0][0], op)
        end = start + (d.fwd_ms if op == "F" else d.bwd_ms)
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
            self.clock[name] += ls.check_ms(name, b, op)
            self.send_verdict(name, consumer, (b, op, x))
        elif v is not None and v != consumer:
            self.copies[(b, op, x)] = ls.transmit(name, v, ls.nbytes[b], self.clock[name])
            self.wake(("c", (b, op, x)))

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
