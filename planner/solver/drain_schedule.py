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

So this runs the programs the compiler would emit, in two passes. First the order (``drain_order``): the compiler's
list scheduler (``planner.schedules``) with its estimates: a stage replica runs its forwards in microbatch order
while fewer than its in-flight limit are in flight, and the backward of an in-flight microbatch whose gradient
is in, whichever can start first (GPipe: every forward, then the backwards in the forwards' order, each once its
gradient is in; at equal times a check first, then the pass unlike its last); a pass whose
input a remote verifier checks is placed once that verdict is; a consumer that checks its input runs the check
first, a sender that checks its output runs it after sending; a verifier checks the copies that can start
first, the lowest microbatch's. Then the times (``drain_replay``): each device runs that order as the simulator
does, blocking until what its next step needs is in; a result leaves (a gradient's: the next backward starts)
only once its input's verdict is; each message, verdicts included, takes its directed link's wire after the
ones sent before it (the latency overlapping the next): a verdict queued behind its verifier's activations
halts the programs that wait on it, in their compiled order (``verdict_backlog``'s case, exactly). An audit's
work on the step's path runs here too, the order placed without it (the compiler's estimates know nothing of
it): the forwards that sign or check signed inputs run longer (``run_fb``), an auditor's gradient checks by its
recomputes (``check_extra``), and its copies' stepper (``background``: the last step's deferred recomputes and
copy steps) shares its device with its passes and checks (``audit_stepper.Stepper``), as the simulator runs them.
Not run: shared cores. Cost: one heap
operation per pass, check and message (GPipe finds its next backward's gradient by microbatch, in a dict),
then (with verifiers) one step each.
"""
from __future__ import annotations

from dataclasses import dataclass

from planner.solver.audit_stepper import Stepper, StepperPart
from planner.solver.drain_order import Lister
from planner.solver.drain_replay import Replay
from planner.solver.problem import Problem

__all__ = ["Drained", "Lister", "drain_schedule", "drain_with_steppers"]


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
    ``audit_stepper.stepper_parts``) sharing those devices. ``fb`` are the compiler's estimates, which order the
    programs; ``run_fb`` (None: ``fb``) the forwards as they run, longer where an audit from signed inputs signs
    or checks each (``audit_price.signing_ms``), and ``check_extra`` ((device, boundary, F|B) -> ms) the checks
    that run longer, an auditor's recompute among its gradient checks (``simulate_audits._audit_checks``): the compiler
    knows of neither (``instruction_costs.CostModel``), so they stretch the order it placed."""
    lister = Lister(problem, stages, verifiers, fb, bw, limits)
    placed = lister.run()   # the compiler orders with its estimates, which know nothing of the steppers
    exact = run_fb is None or run_fb == fb
    if not verifiers and exact:   # without verdicts the compiler's estimates are the simulator's times
        done = {d.name: d.clock for d in lister.dev.values()}
        return Drained(finishes=placed, stepped={}, done=done)
    run_fwd = None if exact else {d: run_fb[k][i] - bw[k][i] for k, st in enumerate(stages)
                                  for i, d in enumerate(st.devices)}
    replay = Replay(lister, {d: Stepper(parts=parts) for d, parts in background.items() if d in lister.dev},
                     fwd_ms=run_fwd, check_extra=check_extra)
    finishes = replay.run()
    return Drained(finishes=finishes, stepped={d: st.done_ms() for d, st in replay.steppers.items()},
                   done=dict(replay.clock))
