"""Running a plan's programs (``planner.simulate``): every rank on a device of its own, or all of them sharing a
machine's cores (each pass progressing as the measured or even sharing allows, an emulated slower device padded)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from planner.simulate_run import _Run


def _run_dedicated(run: _Run) -> None:
    """Every rank on its own device: run each rank as far as it can go, until none can move."""
    progress = True
    while progress:
        progress = False
        for rank, prog in enumerate(run.plan.programs):
            while run.pc[rank] < len(prog) and run.step(rank, prog[run.pc[rank]]):
                run.pc[rank] += 1
                progress = True


@dataclass(slots=True)
class _Pass:
    """A pass in progress on shared cores: when it started, the work it still needs (ms on a core of its
    own), the CPU time it has had so far, and ``factor``: an emulated slower device pads the pass, once
    its work is done, until it has lasted ``factor`` x that CPU time (as ``planner.runtime.rank.emulate``
    does; a core slowed by company inflates the CPU time, time-slicing does not). ``until`` is set then."""

    start: float
    left: float
    factor: float = 1.0
    cpu: float = 0.0
    until: float = 0.0

    def end(self, t: float, speed: float) -> float:
        """When the pass ends if nothing changes after ``t``: its work done, then any padding."""
        return t + self.left / speed if self.left > 0 else max(t, self.until)


def _run_shared(run: _Run, cores: int, rate: Callable[[int], float]) -> None:
    """The ranks share the machine's ``cores``: advance time from event to event (a pass's work is done,
    a pass ends, a rank's message arrives); between events each of the ``k`` passes that compute
    progresses at ``rate(k)`` of a pass alone and is on a core ``min(1, cores / k)`` of the time; a
    pass padding up to its device's time (emulated) waits without a core. An auditor's copies' stepper is one
    more computing thread from the step's start (keyed ``-1 - rank``)."""
    programs = run.plan.programs
    running: dict[int, _Pass] = {-1 - r: _Pass(start=0.0, left=st.left_ms) for r, st in run.steppers.items()
                                 if st.left_ms > 0}
    t = 0.0
    while True:
        _start_ready(run, t, running)
        computing = sum(1 for p in running.values() if p.left > 0)
        speed, on_core = (rate(computing), min(1.0, cores / computing)) if computing else (0.0, 0.0)
        events = [p.end(t, speed) for p in running.values()]
        events += [run.clock[r] for r, prog in enumerate(programs)
                   if r not in running and run.pc[r] < len(prog) and run.clock[r] > t]
        if not events:
            return  # finished, or blocked for good (simulate reports that)
        t_next = min(events)
        for rank, p in list(running.items()):
            if p.left > 0:
                p.cpu += (t_next - t) * on_core
                if t + p.left / speed <= t_next:  # its work is done (exactly, not up to rounding)
                    p.left, p.until = 0.0, p.start + p.factor * p.cpu
                else:
                    p.left -= (t_next - t) * speed
            if p.left == 0 and p.until <= t_next:  # this pass ends now
                del running[rank]
                if rank < 0:   # a stepper's queue: done
                    run.steppers[-1 - rank].ran_shared(t_next)
                    continue
                run.clock[rank] = p.start
                done = run.step(rank, programs[rank][run.pc[rank]], dur=t_next - p.start)
                assert done, "a pass that started has its inputs"
                run.pc[rank] += 1
        t = t_next


def _start_ready(run: _Run, t: float, running: dict[int, _Pass]) -> None:
    """At time ``t``, run every instruction that can start: messages and barriers take no processor
    time; a pass whose inputs are here joins ``running``."""
    progress = True
    while progress:
        progress = False
        for rank, prog in enumerate(run.plan.programs):
            while rank not in running and run.pc[rank] < len(prog) and run.clock[rank] <= t:
                ins = prog[run.pc[rank]]
                if run.is_work(ins):
                    ready = run.ready_at(rank, ins)
                    if ready is not None and ready <= t:
                        core = run.core_ms(rank, ins)
                        factor = run.work_ms(rank, ins) / core if core > 0 else 1.0
                        running[rank] = _Pass(start=t, left=core, factor=factor)
                        progress = True
                    elif ready is not None:
                        run.clock[rank] = ready  # wakes up when its message arrives
                    break
                if not run.step(rank, ins):
                    break
                run.pc[rank] += 1
                progress = True
