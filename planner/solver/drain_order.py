"""The order pass of ``drain_schedule``: the compiled programs' passes, checks and messages list-scheduled with
the compiler's estimates (``Lister``), each device's program kept for the replay (``drain_replay``)."""
from __future__ import annotations

import heapq

from planner.solver.drain_device import Device, Key, checkers
from planner.solver.problem import Problem
from planner.solver.routing import owners

__all__ = ["Lister"]


class Lister:
    """One list-scheduling run (``drain_schedule``)."""

    def __init__(self, problem: Problem, stages, verifiers, fb, bw, limits) -> None:
        self.problem, self.stages, self.S = problem, stages, len(stages)
        self.gpipe = problem.schedule == "gpipe"
        self.owner = [owners(st.microbatches) for st in stages]
        self.dev: dict[str, Device] = {}
        for k, st in enumerate(stages):
            routes: list[list[int]] = [[] for _ in st.devices]
            for x, (i, _) in enumerate(self.owner[k]):
                routes[i].append(x)
            for i, d in enumerate(st.devices):
                n = len(routes[i]) if self.gpipe else limits[k][i]   # GPipe holds every microbatch
                self.dev[d] = Device(order=len(self.dev), name=d, stage=k, ids=tuple(routes[i]),
                                      limit=max(1, n), fwd_ms=fb[k][i] - bw[k][i], bwd_ms=bw[k][i])
        for v in verifiers:
            self.dev.setdefault(v.device, Device(order=len(self.dev), name=v.device))
        for d in stages[0].devices:
            self.dev[d].inputs = {x: 0.0 for x in self.dev[d].ids}
        self.verifiers, self.checker = verifiers, checkers(stages, verifiers)
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

    def offer_plain(self, d: Device) -> None:
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

    def gpipe_backward(self, d: Device) -> tuple[float, int] | None:
        """GPipe: (when it can start, microbatch) of ``d``'s next backward: every forward placed first, then the
        backwards in the order of the forwards (``planner.schedules``), each once its gradient is in; None: not
        yet (or none left)."""
        if d.next_fwd < len(d.ids) or d.next_bwd >= len(d.ids):
            return None
        x = d.ids[d.next_bwd]
        at = d.grads.get(x)
        return None if at is None else (max(d.clock, at), x)

    def take_gradient(self, d: Device, x: int) -> None:
        """``x``'s gradient, used by the backward placed now: 1F1B offers the lowest one in or else the earliest to
        come, GPipe the next in its forwards' order, wherever it is."""
        if self.gpipe:
            d.next_bwd += 1
            del d.grads[x]
        elif d.due and d.due[0] == x:
            heapq.heappop(d.due)
        else:
            heapq.heappop(d.waiting)  # offered as the earliest gradient still to come

    def gradient_in(self, d: Device, at: float, x: int) -> None:
        """``x``'s gradient arrives on ``d`` at ``at``: GPipe looks it up by microbatch, 1F1B takes the earliest."""
        if self.gpipe:
            d.grads[x] = at
        else:
            heapq.heappush(d.waiting, (at, x))

    def _push(self, d: Device, best: tuple | None) -> None:
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

    def offer(self, d: Device) -> None:
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

    def arrived(self, d: Device, at: float) -> None:
        """Something ``d`` needs arrives at ``at``: only a step that could start before the one it has on the
        heap changes its choice (one starting later cannot, and it offers again once that one is placed)."""
        if at <= d.offered:
            self.offer(d)

    def place_check(self, d: Device) -> None:
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

    def place_pass(self, d: Device, op: str, x: int, start: float) -> None:
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

    def send(self, d: Device, k: int, nxt: int, op: str, x: int) -> None:
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
