"""The step time of the programs a placement compiles to: the cost every returned plan is priced at.

The compiler (``planner.schedules``) routes microbatches across a stage's
replicas in proportion to their shares (``routing``), runs 1F1B per rank up to
an in-flight limit, sends without blocking (one message on a directed link's
wire at a time, latencies overlapping), has the consumer of a checked tensor
wait for its verdict only before passing its result on, and all-reduces a
replicated stage's gradients once its replicas are done. Priced the same way
(all in ms, per step of ``M`` microbatches):

* **Resources**, each busy for its share of the step: a stage replica running
  ``m`` microbatches ``m * fb + M * verify`` (forward + backward per
  microbatch, and the checks it hosts), a verifier-only device ``M * verify``,
  a directed link the wire time (bytes / bandwidth) of every message routed
  over it (activations, gradients, verifier copies).
* **Paths** (``_paths``): each microbatch's trip over its own route, one replica
  per stage: its forward up to a stage, its round trip downstream of it, its
  backward from it to the end of stage 0; each boundary's transfer counts its
  latency and the verdict wait the consumer's own pass does not hide.
* A resource works no sooner than its first microbatch reaches it and no
  later than its last one leaves; a stage replica also idles while its first
  gradient's round trip outlasts its warm-up forwards (or its warm-up waits on
  verdicts whose copies queue on a link slower than its forwards:
  ``_verdict_stall``) and while its last one's outlasts the backwards it still
  holds: ``pipe = max over resources of (busy + the path outside it)``.
* A stage replica that also verifies sends its verdicts over the links its own
  activations take, behind them (``verdict_backlog``): the consumer of a
  verdict queued so stalls after its first backward, and where the verifier's
  own first backward waits on that consumer's gradient, the verifier's whole
  program halts with it, every check behind it: every stage waits as long
  (``stream_ms``), less what the verifier would still have been busy with by
  then, and every link less the messages its senders had queued on it (one
  slower than the pace the pipeline keeps without the links into verifiers).
* A stage replica whose downstream neighbour verifies its inputs gets those
  verdicts behind the neighbour's gradients (``first_backward_delay``): a
  warm-up forward waiting on one starts its first backward, and its first
  microbatch's round trip from every stage upstream, that much later.
* An **in-flight limit** ``n`` below what covers the round trip ``D`` throttles
  a replica to ``n`` microbatches per ``fb + D + W``: ``n`` chains of pass,
  round trip (the mean over its microbatches) and the wait ``W`` behind other
  microbatches downstream, pass; the last chain starting late. The limit is
  the schedule's least (``planner.schedules.max_in_flight``) raised, as far as
  the device's memory allows, to ``1 + QUEUEING * D / fb`` (all in
  ``in_flight``). With another throttled stage downstream
  the chains do not stay bunched: the returns come back spread over the period,
  so the last forward ends the busy time and its round trip and backward follow
  it (llama-7b, bf16, 2048 tokens on 40 consumer GPUs: priced 10.8% under its
  simulation with bunched chains, 3.5% under with this).
* **1F1B's pipeline** (``drain_schedule``): the closed forms above name the
  resource that paces it, but where several nearly do at once the last
  microbatches meet each of them late in turn (issue 36: DT-FM worldwide with
  single-device first stages priced 9.3% under, SWARM-like forced grids 6-9%
  under). So the pipe and each stage's last backward come from the passes,
  checks and messages ordered as the compiler orders them and run as the
  simulator runs them, with the limits above (random throttled placements,
  ``benchmarks/throttled_windows.py``: within 0.05% of their simulation on
  average). An audited plan's programs run so too, in the order the compiler
  gives them on its estimates (which know nothing of the audits), with what the
  audits add as they run: signing and signature checks on the forwards, the
  recomputes among an auditor's gradient checks, its copies' stepper (issue 36,
  ``test_monotone_pools`` seed 13: a signed audit priced as the plan unaudited
  plus its closed forms' increment came 0.44% under, the stages after the
  signing 11 ms later as run); its audits' ends then follow from the stage
  ends and its devices' last checks (``_audits_end_ms``). The closed forms
  above only name the resource that paces the pipeline (the report's bottleneck).
* Stage ``k``'s all-reduce starts when its own last backward ends, never before its replicas' first inputs arrived and all
  their passes ran (``_own_floor``); a replica that checks gradients first
  finishes its checks; then the optimizer step (``cost_models.optim``):
  ``step = max_k (end_k + AR_k + optim_k)``.
* An audited stage's auditor (``audit_price``) recomputes its audited microbatches among its checks (its
  load per microbatch grows by their share) where it audits gradients, else once its own program is done
  (and, where the upstream stage copies it the audited inputs, once they are in: sent as the upstream stage's
  optimizer steps end; from signed inputs, the replicas send theirs once their optimizer steps end and its
  request reached them); then it hears the replicas' digests and applied gradient (sent after their optimizer
  steps) and steps its copy: the step ends no sooner (``cost_models.audit.AuditCost.end_ms``). Audited from
  signed inputs, the upstream ranks' forwards grow by signing what they send it, its replicas' by checking the
  signatures (``audit_price.signing_ms``). Outputs-only audits recompute during the next step on the auditor's
  copy stepper, work on the auditor's device from the step's start beside its own passes and checks
  (``audit_stepper.Stepper``): run with the programs (``drain_schedule``); the step ends no sooner than the stepper
  is through its queue, and each deferred audit no sooner than its own stage's parts there (and those queued
  before them, ``audit_stepper.Stepper.through_ms``), the auditor's next audit after it
  (``planner.simulate_step_end._audits``).
* GPipe's pipeline comes from its programs run (``drain_schedule``, every forward, then the backwards in the
  forwards' order): closed forms of its two phases missed where replicas' and links' phases overlap (random pools
  of 6-16 volunteers: 0.75-1.33 of the simulation, 83% within 5%; now 1.000).
"""
from __future__ import annotations

from dataclasses import dataclass

from planner.solver.audit_stepper import StepperPart
from planner.solver.drain_schedule import drain_with_steppers
from planner.solver.in_flight import limit
from planner.solver.problem import Problem
from planner.solver.program_audits import (
    _add_signing_ms,
    _audit_checks,
    _audits_end_ms,
    _steppers,
    _through,
    _with_audits,
)
from planner.solver.program_paths import _own_floor, _Paths, _paths
from planner.solver.program_resources import (
    _backlog,
    _check_queues,
    _delay_first_backwards,
    _message_resources,
    _stage_resources,
)
from planner.solver.program_traffic import _Traffic, _traffic
from planner.solver.routing import route
from planner.solver.solution import StagePlacement, VerifierPlacement


@dataclass(frozen=True, slots=True, kw_only=True)
class ProgramCost:
    """The priced program: its step, the pipeline part (to stage 0's last backward), the in-flight limit per
    stage replica, and the resource that paces it."""

    step_ms: float
    pipe_ms: float
    in_flight: tuple[tuple[int, ...], ...]
    bottleneck: str
    stepper_ms: float = 0.0   # when the auditors' copy steppers are through their queues (0: none priced)


def codec_of(problem: Problem, st: StagePlacement) -> str:
    """The codec of stage ``st``'s output boundary."""
    return problem.codec if st.out_codec is None else st.out_codec


def _add_codec_ms(problem: Problem, stages, fb, bw) -> None:
    """Each replica's passes grow by its encoding and decoding: forward, its output's encode and its input's
    decode; backward, the returning gradient's decode and the one it sends back's encode."""
    S = len(stages)
    for k, st in enumerate(stages):
        out = codec_of(problem, st) if k < S - 1 else "none"
        into = codec_of(problem, stages[k - 1]) if k > 0 else "none"
        if out == "none" and into == "none":
            continue
        for i, d in enumerate(st.devices):
            cls = problem.class_of(d)
            f = (problem.codec_ms(st.last_block, out, cls, "encode", "F") if out != "none" else 0.0) + \
                (problem.codec_ms(stages[k - 1].last_block, into, cls, "decode", "F") if into != "none" else 0.0)
            b = (problem.codec_ms(st.last_block, out, cls, "decode", "B") if out != "none" else 0.0) + \
                (problem.codec_ms(stages[k - 1].last_block, into, cls, "encode", "B") if into != "none" else 0.0)
            fb[k][i] += f + b
            bw[k][i] += b


def program_cost(problem: Problem, stages: tuple[StagePlacement, ...], verifiers: tuple[VerifierPlacement, ...],
                 *, verify_load: dict[str, float], verifier_state: dict[str, int],
                 allreduce_ms: tuple[float, ...]) -> ProgramCost:
    """Price the compiled programs of ``stages``/``verifiers`` (see the module docstring)."""
    kw = {"verify_load": verify_load, "verifier_state": verifier_state, "allreduce_ms": allreduce_ms}
    background = _steppers(problem, stages, verifiers)
    # Audited or not, the programs run as the compiler orders them on its estimates, with the signing, the
    # recomputes among the checks and the steppers an audit adds (``drain_schedule``); the audits' ends follow.
    r = _priced(problem, stages, verifiers, background=background, **kw)
    audits = _audits_end_ms(problem, stages, verifiers, r.traffic, r.ends, r.sent, r.p, r.stepping,
                            _through(background, r.stepped), r.done)
    return r.cost(max(r.pipeline_ms, audits))


@dataclass(slots=True)
class _Run:
    """One pricing of the programs but their audits' ends: the last optimizer step (``pipeline_ms``), the pipe, the
    in-flight limits and the pacing resource; per stage its ends, its senders' finishes (``sent``) and its
    optimizer steps' starts (``stepping``); the traffic and paths the audits read; per auditor, when its stepper is
    through its queue (``stepped``)."""

    pipeline_ms: float
    pipe_ms: float
    limits: list[tuple[int, ...]]
    name: str
    ends: list[float]
    sent: list[float]
    stepping: list[float]
    traffic: _Traffic
    p: _Paths
    stepped: dict[str, float]
    done: dict[str, float]   # device -> when its last pass or check ends (the programs run; empty: closed forms)

    @property
    def stepper_ms(self) -> float:
        return max(self.stepped.values(), default=0.0)

    def cost(self, programs_ms: float) -> ProgramCost:
        """The priced program whose programs and audits end at ``programs_ms``, its steppers' queues after."""
        return ProgramCost(step_ms=max(programs_ms, self.stepper_ms), pipe_ms=self.pipe_ms,
                           in_flight=tuple(self.limits), bottleneck=self.name, stepper_ms=self.stepper_ms)


def _priced(problem: Problem, stages, verifiers, *, verify_load: dict[str, float], verifier_state: dict[str, int],
            allreduce_ms: tuple[float, ...],
            background: dict[str, tuple[StepperPart, ...]] | None = None) -> _Run:
    """``program_cost``'s parts but the audits' ends, the pipeline from the programs run (``drain_schedule``; the
    closed forms name the resource that paces it); ``background``: the auditors' copy steppers' queues
    (``_steppers``), run beside their devices' work."""
    background = background or {}
    stepped: dict[str, float] = {}
    verify_load = _with_audits(problem, stages, verifiers, verify_load)
    fb = [[problem.tables(st.recompute).range_time_ms(st.first_block, st.last_block, problem.class_of(d))
           for d in st.devices] for st in stages]
    bw = [[problem.tables(st.recompute).range_bwd_ms(st.first_block, st.last_block, problem.class_of(d))
           for d in st.devices] for st in stages]
    _add_codec_ms(problem, stages, fb, bw)
    estimated = [list(row) for row in fb]   # the compiler's, which orders the programs: no signing
    _add_signing_ms(problem, stages, verifiers, fb)
    traffic = _traffic(problem, stages, verifiers)
    routes = [route(st.microbatches) for st in stages]
    p = _paths(problem, stages, routes, fb, bw, traffic.wait)
    periods = [tuple(limit(problem, stages, k, i, routes[k][i], fb, bw, p.down, verifier_state)
                     for i in range(len(st.devices))) for k, st in enumerate(stages)]
    limits = [tuple(n for n, _ in row) for row in periods]
    backlog = _backlog(problem, stages, verifiers, routes, fb, bw, p, periods, traffic, verify_load)
    backlog = _delay_first_backwards(problem, stages, verifiers, routes, fb, bw, p, limits, backlog)
    busy = _stage_resources(problem, stages, routes, fb, bw, p, verify_load, periods, traffic, backlog)
    busy += _message_resources(stages, traffic, p, verify_load, backlog, max(b for b, _, _ in busy))
    busy += _check_queues(problem, stages, verifiers, p, bw)
    name = max(((b + fill, n) for b, fill, n in busy), key=lambda x: x[0])[1]
    # the passes, checks and messages placed as the compiler places them and run as they run (``drain_schedule``)
    drained = drain_with_steppers(problem, stages, verifiers, estimated, bw, limits, background, run_fb=fb,
                                  check_extra=_audit_checks(problem, stages, verifiers))
    finishes, stepped, done = list(drained.finishes), drained.stepped, drained.done
    pipe = finishes[0]
    finishes = [max(f, own) for f, own in zip(finishes, _own_floor(routes, fb, p))]
    last = len(p.fwd) - 1
    sent = list(finishes)  # the checks wait on the senders' own finishes, whatever order the checks come in
    for k, st in enumerate(stages):  # a replica that checks gradients all-reduces after its last check
        for dev in st.devices:
            for b, direction in traffic.checks.get(dev, ()):
                if direction == "grad":
                    finishes[k] = max(finishes[k], sent[b + 1] + p.hop_b[last][b])
            finishes[k] = max(finishes[k], done.get(dev, 0.0))   # its checks after its last backward, as run
    optim_ms = [max(problem.range_optim_ms(st.first_block, st.last_block, problem.class_of(d)) for d in st.devices)
                for st in stages]
    ends = [f + ar + opt for f, ar, opt in zip(finishes, allreduce_ms, optim_ms)]
    stepping = [e - opt for e, opt in zip(ends, optim_ms)]   # a source sends its auditor its gradient from then
    return _Run(pipeline_ms=max(max(ends), pipe + optim_ms[0]), pipe_ms=pipe, limits=limits, name=name,
                ends=ends, sent=sent, stepping=stepping, traffic=traffic, p=p, stepped=stepped, done=done)
