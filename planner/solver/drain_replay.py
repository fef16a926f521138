"""The times pass of ``drain_schedule``: the order ``drain_order`` placed, run as the simulator runs it."""
from __future__ import annotations

from planner.solver.audit_stepper import Stepper
from planner.solver.drain_device import Key
from planner.solver.drain_order import Lister

__all__ = ["Replay"]


class Replay:
    """The placed order run with the simulator's timing: a device blocks until what its next step needs is in,
    and a verdict waits for its link's wire like any message (``planner.simulate``)."""

    def __init__(self, lister: Lister, steppers: dict[str, Stepper] | None = None, *,
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
