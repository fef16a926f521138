"""Discrete-event interpreter of a plan's programs with the cost models.

The simulator runs the same programs the runtime runs, with the same
semantics (see ``planner.instructions``), and prices every instruction:

* ``F``/``B``: ``cost_models.compute.range_fwd_ms/range_bwd_ms`` of the
  stage's blocks on the rank's device (the solver's formula), occupying the
  rank.
* ``SEND_*``: non-blocking for the program. The tensor (the boundary
  activation, scaled from the traced microbatch size and dtype to the
  configured ones) travels over ``cluster.link(src, dst)`` and takes
  ``cost_models.comm.transfer_ms`` (latency + bytes / bandwidth). One directed
  link (src rank -> dst rank) puts one message's bytes on the wire at a time,
  in the sender's program order (the next may start after bytes / bandwidth;
  latencies overlap); transfers to different peers overlap each other and
  compute.
* ``RECV_*``: wait until the message has arrived.
* ``VERIFY_*``: wait for the copy (if sent), then :func:`verify_ms` on the
  verifier's device; the verdict (:data:`VERDICT_BYTES`) is then sent to the
  consumer like any message.
* ``VERDICT_*`` (deferred verdicts): the instruction itself does not block, so
  the verifier's latency overlaps the consumer's compute. The consumer waits
  for the verdict on microbatch ``mb`` only where it would pass the tensor's
  influence on: a ``VERDICT_F`` just before its ``SEND_F`` of ``mb`` (on the
  last stage, before its ``B`` of ``mb``), a ``VERDICT_B`` just before its
  ``SEND_B`` of ``mb`` and before its next ``B`` (on the first stage, before its
  next ``B``, ``ALLREDUCE`` or ``OPTIM``). A slow verifier thus delays a send, not
  a pass.
* ``ALLREDUCE``: a barrier of the stage's replicas, then
  ``cost_models.comm.group_allreduce_ms`` of the stage's gradient bytes.
* ``OPTIM``: ``cost_models.optim.optim_ms``, a memory-bound pass over weights, gradients
  and optimizer state.
* A stage the plan audits (``StageInfo.audit_every``): its auditor recomputes the audited microbatches
  (where it audits gradients, each as its last check of the microbatch ends: that check lasts the expected
  share longer; else on its copy's stepper in the next step, ``AuditCost.deferred``: the last step's recomputes
  and copy steps are work on the auditor's device from the step's start, beside its own passes and checks,
  ``audit_stepper.Stepper``; on shared cores, one more computing thread), once its program is done (and, where
  the trusted stage before copies it the audited inputs, once each of its ranks, done, has sent them: an
  "input copies" box; from signed inputs, the stage's replicas send them, each once done and asked) hears the
  replicas' applied gradient, and steps its copy (``cost_models.audit.AuditCost.end_ms``); the step ends no
  sooner. Audited from signed inputs, each ``F`` of the stage before signs what it sends the stage, each ``F``
  of a replica checks its input's signature (``cost_models.audit.sign_ms``, ``check_signature_ms``): those
  passes last that much longer.

``simulate(plan, cores=C)`` rehearses the plan on one machine whose ``C``
processors all ranks share (``stagewise run`` on a laptop, the runtime
benchmark's four ranks on two cores): the passes (``F``, ``B``, ``VERIFY_*``,
``OPTIM``) that overlap in time share the processors. By default that is
even processor sharing: ``k`` passes at once each progress at ``min(1, C / k)``
of a pass running alone. ``sharing=`` (a measured
:class:`cost_models.measured.CoreSharing` of that machine) replaces that ideal
with how fast ``k`` concurrent single-thread processes really progress there:
cores that are hyperthreads of one physical core, or share caches and memory
bandwidth, slow each other down even while ``k <= C``, and time-slicing more
processes than cores costs switches. ``emulated=True`` prices a rehearsal with
the runtime's emulation of slower devices (``stagewise run --emulate-speed``): a
pass computes what the stage costs on the fastest planned device for it
(sharing the cores), then sleeps, without a core, until it has lasted its
device's slow-down factor times the CPU time it had (as ``planner.runtime.
emulate`` pads: a core slowed by company inflates that CPU time,
time-slicing does not). With ``C`` at least the number of ranks and no sharing table
this is the plain simulation (which is also the default: one device per rank).

``messages=`` (a measured :class:`cost_models.measured.MessageCost`) also prices
the CPU time a message costs the processes at its two ends, beyond its time on
the wire: posting it and the backend's threads moving its bytes. A ``SEND_*``
then occupies its rank (and, sharing cores, a core) for the sender's part
before the message leaves, a ``RECV_*`` for the receiver's part once it has
arrived. Its ``executor_ms`` (the runtime executor's own CPU per message
instruction, measured by ``planner.profiling.overhead_probe``) is added to each
end's part, and its ``executor_pass_ms`` (the executor's bookkeeping per pass)
to every ``F``/``B`` (on the core, not padded by an emulated slow device).
Without it (the default) messages cost the ranks no processor time.

``CostModel.for_rehearsal(plan, local)`` prices ``stagewise run`` of a plan
for remote devices on this machine (``local``: its profile): every rank's
passes at the profiled speed, padded as the runtime's emulation pads them,
and messages over the measured local link (``planner.rehearsal``).

``pipeline_ms`` is when the last rank reaches its optimizer step: that is
what the closed forms ``(M + S - 1)(t_f + t_b)`` and the solver objective
describe. ``step_ms`` adds the optimizer steps. Memory per rank is weights +
gradients + optimizer state + communication buffers
(``cost_models.memory.stage_memory``) + saved activations times the
microbatches actually in flight as the program runs, + the verifier's state.
"""
from __future__ import annotations

from dataclasses import replace

from cost_models.measured import CoreSharing, MessageCost
from planner.errors import InvalidInputError
from planner.instruction_costs import CostModel
from planner.instructions import (
    SEND_OPS,
    VERDICT_OPS,
    VERIFY_OPS,
    Instruction,
    format_instruction,
)
from planner.plan import Plan
from planner.simulate_audits import _audit_checks, _signing, _steppers
from planner.simulate_cores import _run_dedicated, _run_shared
from planner.simulate_events import SimResult
from planner.simulate_run import _Run, deferred_verdicts
from planner.simulate_step_end import _audits, _norm_exchange, _verdict_exchange


def simulate(plan: Plan, costs: CostModel | None = None, *, cores: int | None = None,
             sharing: CoreSharing | None = None, emulated: bool = False,
             messages: MessageCost | None = None, clip: bool = False, accumulate: int = 1,
             verdicts: bool = False) -> SimResult:
    """Interpret ``plan``'s programs against the cost model; ``cores``: the ranks share this many
    processors (default: a device each), ``sharing``: how fast concurrent passes progress on them
    (measured; default: even sharing), ``emulated``: slower devices are emulated by padding passes
    with sleeps, ``messages``: the CPU time a message costs each end (measured; default none);
    ``clip``: the run clips the global gradient norm (``stagewise run --clip-grad``); ``accumulate``: the
    run's passes per optimizer step (``--accumulate``); ``verdicts``: a verified step ends with the verdict
    exchange (:func:`_verdict_exchange`; rehearsals price it, the planner's objective does not yet). See the
    module docstring."""
    costs = costs or CostModel.for_plan(plan)
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise InvalidInputError("accumulated passes", expected="a whole number >= 1", found=repr(accumulate))
    if accumulate > 1:
        return _accumulated(plan, costs, accumulate, cores=cores, sharing=sharing, emulated=emulated,
                            messages=messages, clip=clip, verdicts=verdicts)
    n = plan.num_ranks
    if cores is not None and (isinstance(cores, bool) or not isinstance(cores, int) or cores < 1):
        raise InvalidInputError("simulated cores", expected="a whole number >= 1 (or None: a device per rank)",
                                found=repr(cores))
    if sharing is not None and cores is None:
        raise InvalidInputError("core sharing table", expected="cores= (the machine the table was measured on)",
                                found="sharing= without cores=", fix="pass cores=sharing.cores")
    run = _Run(plan=plan, costs=costs, clock=[0.0] * n, pc=[0] * n, live=[0] * n, peak=[0] * n,
               reached_optim=[0.0] * n, emulated=emulated, messages=messages,
               verdict_waits=[deferred_verdicts(prog) for prog in plan.programs])
    run.audit_checks = _audit_checks(plan, costs)
    run.signing = _signing(plan, costs)
    run.steppers = _steppers(plan, costs)
    if cores is None or (cores >= n and sharing is None):
        _run_dedicated(run)
    else:
        rate = sharing.rate if sharing is not None else (lambda k: min(1.0, cores / k))
        _run_shared(run, cores, rate)
    stuck = [r for r in range(n) if run.pc[r] < len(plan.programs[r])]
    if stuck:
        r = stuck[0]
        raise InvalidInputError(f"plan programs deadlock: rank {r} blocks forever at instruction #{run.pc[r]} "
                                f"{format_instruction(plan.programs[r][run.pc[r]])!r}",
                                fix="validate the plan (planner.validate.validate_programs)")
    if clip:
        _norm_exchange(run)
    _audits(run)
    if verdicts:
        _verdict_exchange(run)
    return _summarise(plan, costs, run)


def _accumulated(plan: Plan, costs: CostModel, passes: int, **kw) -> SimResult:
    """``passes`` runs of the programs per step: each but the last without the all-reduce, the optimizer step
    and the step's end (clipping, verdicts), one after another (a pass drains before the next starts: the
    runtime settles its sends)."""
    inner = replace(plan, programs=tuple(tuple(i for i in prog if i.op not in ("ALLREDUCE", "OPTIM"))
                                         for prog in plan.programs), verifiers=())
    early, last = simulate(inner, costs, **{**kw, "clip": False}), simulate(plan, costs, **kw)
    extra = (passes - 1) * early.step_ms
    moved = tuple(replace(e, start_ms=e.start_ms + extra, end_ms=e.end_ms + extra) for e in last.events)
    return replace(last, step_ms=last.step_ms + extra, pipeline_ms=last.pipeline_ms + extra,
                   busy_ms=tuple(a + (passes - 1) * b for a, b in zip(last.busy_ms, early.busy_ms)),
                   compute_ms=tuple(a + (passes - 1) * b for a, b in zip(last.compute_ms, early.compute_ms)),
                   idle_ms=tuple(a + (passes - 1) * b for a, b in zip(last.idle_ms, early.idle_ms)),
                   events=early.events + moved)


def _summarise(plan: Plan, costs: CostModel, run: _Run) -> SimResult:
    n = plan.num_ranks
    step = max(run.clock)
    stage_ranks = [r.rank for r in plan.ranks if r.stage is not None]
    pipeline = max(run.reached_optim[r] for r in stage_ranks)
    busy, comp = [0.0] * n, [0.0] * n
    worked: list[list[tuple[float, float]]] = [[] for _ in range(n)]
    for ev in run.events:
        if ev.kind not in ("send", "control"):  # a transfer, or waiting for the verdict: no work of the rank's
            worked[ev.rank].append((ev.start_ms, ev.end_ms))
        if ev.kind in ("F", "B"):
            comp[ev.rank] += ev.end_ms - ev.start_ms
    for r, spans in enumerate(worked):   # a stepper's boxes overlap the passes it shares the device with
        reach = 0.0
        for a, b in sorted(spans):
            busy[r] += max(0.0, b - max(a, reach))
            reach = max(reach, b)
    work = sum(comp[r] for r in stage_ranks)
    bubble = 1.0 - work / (len(stage_ranks) * pipeline) if pipeline > 0 else 0.0
    peak_mem = tuple(costs.memory_bytes(r, run.peak[r]) for r in range(n))
    events = tuple(sorted(run.events, key=lambda e: (e.rank, e.start_ms, e.kind)))
    return SimResult(step_ms=step, pipeline_ms=pipeline, busy_ms=tuple(busy), compute_ms=tuple(comp),
                     idle_ms=tuple(max(step - b, 0.0) for b in busy), bubble_fraction=min(max(bubble, 0.0), 1.0),
                     peak_mem_bytes=peak_mem, peak_in_flight=tuple(run.peak), events=events)


def without_verification(plan: Plan) -> Plan:
    """``plan`` as a run with ``--no-verify`` executes it: no checks, no verdicts, no copies for verifiers
    (a send whose peer is not the microbatch's consumer, as ``executor_p2p._send`` skips it), and no
    verifier-only ranks (numbered last, they idle)."""
    if not plan.verifiers:
        return plan

    def kept(rank: int, ins: Instruction) -> bool:
        if ins.op in VERIFY_OPS or ins.op in VERDICT_OPS:
            return False
        if ins.op in SEND_OPS:
            stage = plan.ranks[rank].stage
            assert stage is not None and ins.mb is not None
            return ins.peer == plan.owner(stage + (1 if ins.direction == "F" else -1), ins.mb)
        return True

    staged = [r for r in plan.ranks if r.stage is not None]
    assert [r.rank for r in staged] == list(range(len(staged))), "verifier-only ranks come last"
    programs = tuple(tuple(i for i in plan.programs[r.rank] if kept(r.rank, i)) for r in staged)
    predicted = replace(plan.predicted, peak_mem_bytes=plan.predicted.peak_mem_bytes[:len(staged)])
    return replace(plan, ranks=tuple(staged), programs=programs, verifiers=(), predicted=predicted,
                   policy=replace(plan.policy, enabled=False))


def predict(plan: Plan, costs: CostModel | None = None) -> Plan:
    """``plan`` with its ``predicted`` figures filled in by simulating its programs."""
    return replace(plan, predicted=simulate(plan, costs).predicted())
