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
  ``audit_price.Stepper``; on shared cores, one more computing thread), once its program is done (and, where
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

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from cost_models import compute, memory
from cost_models.audit import (
    AuditCost,
    audit_ms,
    copy_ms,
    signing_work,
)
from cost_models.cluster import Link
from cost_models.measured import CoreSharing, MessageCost
from cost_models.optim import optim_ms
from cost_models.verify import VERDICT_BYTES, verdict_exchange
from planner.errors import InvalidInputError
from planner.instruction_costs import CostModel, stage_param_tensors
from planner.instructions import (
    RECV_OPS,
    SEND_OPS,
    STEP_OPS,
    VERDICT_OPS,
    VERIFY_OPS,
    Instruction,
    format_instruction,
    message_keys,
)
from planner.ir import dtype_bytes
from planner.plan import Plan
from planner.plan_values import Predicted
from planner.solver.audit_price import (
    AuditWhere,
    Stepper,
    audit_rule,
    audited_backward_ms,
    copied_message_bytes,
    stepper_parts,
    with_copied_grads,
)

WORK_OPS = frozenset(("F", "B", "OPTIM", *VERIFY_OPS))  # instructions that occupy a processor
MESSAGE_OPS = frozenset((*SEND_OPS, *RECV_OPS))  # ... and these too, where messages cost CPU time


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """One box of the timeline: ``kind`` is F, B, send (a transfer), message (a rank's CPU time on one,
    with ``simulate(messages=...)``), verify, allreduce or optim."""

    rank: int
    kind: str
    start_ms: float
    end_ms: float
    label: str
    stage: int | None = None
    mb: int | None = None
    peer: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SimResult:
    """What one simulated optimizer step looks like (per-rank tuples are indexed by rank)."""

    step_ms: float
    pipeline_ms: float
    busy_ms: tuple[float, ...]
    compute_ms: tuple[float, ...]
    idle_ms: tuple[float, ...]
    bubble_fraction: float
    peak_mem_bytes: tuple[int, ...]
    peak_in_flight: tuple[int, ...]
    events: tuple[Event, ...]

    def predicted(self) -> Predicted:
        return Predicted(step_ms=self.step_ms, bubble_fraction=self.bubble_fraction,
                         peak_mem_bytes=self.peak_mem_bytes)


def deferred_verdicts(program: tuple[Instruction, ...]) -> dict[int, tuple[int, ...]]:
    """Where a rank waits for its verdicts: instruction index -> indices of the ``VERDICT_*`` it waits
    for just before it (see the module docstring). A verdict with no such instruction after it is
    waited for before the program's last instruction."""
    waits: dict[int, list[int]] = {}
    for i, ins in enumerate(program):
        if ins.op not in VERDICT_OPS:
            continue
        at = next((j for j in range(i + 1, len(program)) if _gated(ins, program[j])), len(program) - 1)
        waits.setdefault(max(at, i), []).append(i)
    return {j: tuple(v) for j, v in waits.items()}


def _gated(verdict: Instruction, later: Instruction) -> bool:
    """Whether ``later`` must wait for ``verdict``: it passes the checked microbatch on (its send, or
    the last stage's backward), or it ends the step; a gradient's verdict also comes before the rank's
    next backward (the executor holds one backward's parameter gradients apart at a time)."""
    if verdict.op == "VERDICT_F":
        return later.mb == verdict.mb and later.op in ("SEND_F", "B")
    return ((later.mb == verdict.mb and later.op == "SEND_B") or later.op in STEP_OPS
            or (later.op == "B" and later.mb != verdict.mb))


@dataclass(slots=True)
class _Run:
    """Mutable state of one interpretation."""

    plan: Plan
    costs: CostModel
    clock: list[float]
    pc: list[int]
    emulated: bool = False
    messages: MessageCost | None = None
    mailbox: dict[tuple, float] = field(default_factory=dict)
    link_free: dict[tuple[int, int], float] = field(default_factory=dict)
    barrier: dict[int, set[int]] = field(default_factory=dict)
    live: list[int] = field(default_factory=list)
    peak: list[int] = field(default_factory=list)
    reached_optim: list[float] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    verdict_waits: list[dict[int, tuple[int, ...]]] = field(default_factory=list)
    # (auditor rank, boundary, direction) -> the recompute an audit adds to each such check (``_audits``)
    audit_checks: dict[tuple[int, int, str], float] = field(default_factory=dict)
    # rank -> what each of its forwards adds signing or checking signed inputs (``_signing``)
    signing: dict[int, float] = field(default_factory=dict)
    # auditor rank -> its copies' stepper, sharing its device from the step's start (``_steppers``)
    steppers: dict[int, Stepper] = field(default_factory=dict)

    def box(self, rank: int, kind: str, ins: Instruction, start: float, dur: float, peer: int | None = None) -> None:
        self.events.append(Event(rank=rank, kind=kind, start_ms=start, end_ms=start + dur,
                                 label=format_instruction(ins), stage=ins.stage, mb=ins.mb, peer=peer))

    def send(self, rank: int, ins: Instruction, key: tuple, start: float) -> None:
        kind, boundary, _, src, dst = key
        begin = max(start, self.link_free.get((src, dst), 0.0))
        dur = self.costs.message_ms(kind, boundary, src, dst)
        # The link is busy while the bytes go out; the latency overlaps the next message.
        self.link_free[(src, dst)] = begin + max(dur - self.costs.latency_ms(src, dst), 0.0)
        self.mailbox[key] = begin + dur
        if not kind.startswith("V"):
            self.box(rank, "send", ins, begin, dur, peer=dst)

    def _receives(self, rank: int, ins: Instruction) -> list[tuple]:
        """The messages the instruction at ``rank``'s program counter waits for: its own receives (a
        ``VERDICT_*`` waits later), and the verdicts deferred to it."""
        keys = [key for side, key in message_keys(ins, rank) if side == "recv" and ins.op not in VERDICT_OPS]
        program = self.plan.programs[rank]
        for i in self.verdict_waits[rank].get(self.pc[rank], ()):
            keys += [key for _, key in message_keys(program[i], rank)]
        return keys

    def ready_at(self, rank: int, ins: Instruction) -> float | None:
        """When ``ins`` (the instruction at ``rank``'s program counter) can start; None while a message
        it waits for has not been sent."""
        t = self.clock[rank]
        for key in self._receives(rank, ins):
            if key not in self.mailbox:
                return None
            t = max(t, self.mailbox[key])
        return t

    def is_work(self, ins: Instruction) -> bool:
        """Whether ``ins`` occupies its rank's processor: a pass, or a message when messages cost CPU."""
        return ins.op in WORK_OPS or (self.messages is not None and ins.op in MESSAGE_OPS)

    def message_cpu_ms(self, rank: int, ins: Instruction) -> float:
        """The CPU time ``rank`` spends on the message of a ``SEND_*``/``RECV_*`` (its end of it)."""
        assert self.messages is not None
        ((side, key),) = message_keys(ins, rank)
        nbytes = self.costs.wire_bytes[key[1]]
        bare = self.messages.send_cpu_ms(nbytes) if side == "send" else self.messages.recv_cpu_ms(nbytes)
        return bare + self.messages.executor_ms

    def executor_pass_ms(self) -> float:
        """The executor's own CPU time around each pass (0 unless messages are priced)."""
        return self.messages.executor_pass_ms if self.messages is not None else 0.0

    def work_ms(self, rank: int, ins: Instruction) -> float:
        """Duration of a pass (:meth:`is_work`) on a processor of its own."""
        if ins.op in MESSAGE_OPS:
            return self.message_cpu_ms(rank, ins)
        if ins.op in ("F", "B"):
            return self.costs.compute_ms(rank, ins.op) + self.executor_pass_ms() + self.signing_ms(rank, ins)
        if ins.op in VERIFY_OPS:
            extra = self.audit_checks.get((rank, ins.boundary, ins.direction), 0.0)
            return self.costs.verify_ms(rank, ins.boundary, ins.direction) + extra
        return self.costs.optim_ms(rank)

    def core_ms(self, rank: int, ins: Instruction) -> float:
        """The part of a pass that needs a processor: all of it, except the padding of an emulated
        rehearsal of a slower device (a sleep)."""
        if self.emulated and ins.op in ("F", "B"):
            return self.costs.local_ms(rank, ins.op) + self.executor_pass_ms() + self.signing_ms(rank, ins)
        return self.work_ms(rank, ins)

    def signing_ms(self, rank: int, ins: Instruction) -> float:
        """What a forward adds signing its output or checking its input's signature (a signed audit's)."""
        return self.signing.get(rank, 0.0) if ins.op == "F" else 0.0

    def step(self, rank: int, ins: Instruction, dur: float | None = None) -> bool:
        """Run ``ins`` on ``rank`` if it can start; False if it must wait for a message or a barrier.
        ``dur`` overrides a pass's duration (a pass that shared its processor took longer)."""
        t = self.ready_at(rank, ins)
        if t is None:
            return False
        if ins.op == "ALLREDUCE":
            return self._allreduce(rank, ins, t)
        if self.is_work(ins):
            if dur is None:   # on a device of its own, beside its copies' stepper if it audits (``Stepper``)
                dur = self.work_ms(rank, ins)
                dur = self.steppers[rank].share(t, dur) if rank in self.steppers else dur
            if ins.op == "OPTIM":
                self.reached_optim[rank] = t
            kind = (ins.op if ins.op in ("F", "B") else "optim" if ins.op == "OPTIM"
                    else "message" if ins.op in MESSAGE_OPS else "verify")
            self.box(rank, kind, ins, t, dur)
            t += dur
            if ins.op in ("F", "B"):
                self.live[rank] += 1 if ins.op == "F" else -1
                self.peak[rank] = max(self.peak[rank], self.live[rank])
        for side, key in message_keys(ins, rank):
            if side == "send":
                self.send(rank, ins, key, t)
        self.clock[rank] = t
        return True

    def _allreduce(self, rank: int, ins: Instruction, ready: float) -> bool:
        self.clock[rank] = ready  # arrived at the barrier (after any verdict it waited for)
        waiting = self.barrier.setdefault(ins.stage, set())
        waiting.add(rank)
        group = self.plan.stage_ranks(ins.stage)
        if waiting != set(group):
            return False
        start = max(self.clock[r] for r in group)
        dur = self.costs.allreduce_ms(ins.stage)
        for r in group:
            self.box(r, "allreduce", ins, start, dur)
            self.clock[r] = start + dur
            if r != rank:
                self.pc[r] += 1  # released from the barrier
        del self.barrier[ins.stage]
        return True


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


def _norm_exchange(run: _Run) -> None:
    """Clipping: a stage rank's optimizer step waits for the global gradient norm. Every rank sends its
    squared norm to the control rank (0), which sends back the sum (``executor_optim._clip``); OPTIM ends a
    stage rank's program, so its box moves by the wait."""
    plan, costs = run.plan, run.costs
    stage_ranks = [r.rank for r in plan.ranks if r.stage is not None]
    arrive = {r: run.reached_optim[r] if r in stage_ranks else run.clock[r] for r in range(plan.num_ranks)}
    total = max(t + (costs.verdict_ms(r, 0) if r else 0.0) for r, t in arrive.items())
    for r in stage_ranks:
        wait = total + (costs.verdict_ms(0, r) if r else 0.0) - arrive[r]
        if wait <= 0:
            continue
        run.events[:] = [replace(e, start_ms=e.start_ms + wait, end_ms=e.end_ms + wait)
                         if e.rank == r and e.start_ms >= arrive[r] and e.kind != "send" else e for e in run.events]
        run.events.append(Event(rank=r, kind="control", start_ms=arrive[r], end_ms=arrive[r] + wait,
                                label="gradient norm"))
        run.clock[r] += wait


def audit_site(plan: Plan, k: int) -> AuditWhere | str:
    """Where stage ``k`` of ``plan`` can be audited, by ranks, or why not (``audit_price.audit_rule``, the rule
    the planner prices; the runtime's audits use this too). Its auditor: the lowest rank verifying its outputs."""
    cluster = plan.effective_cluster()
    trusted = {r.rank for r in plan.ranks if cluster.device(r.device).trusted}
    auditor = min((v.rank for v in plan.verifiers if v.boundary == k and "act" in v.directions), default=None)
    last = plan.num_stages - 1
    return audit_rule(stage=k, num_stages=plan.num_stages, replicas=sorted(plan.stage_ranks(k)),
                      upstream=plan.stage_ranks(k - 1) if k > 0 else (),
                      downstream=plan.stage_ranks(k + 1) if k < last else (), trusted=trusted, auditor=auditor,
                      auditor_checks={(v.boundary, d) for v in plan.verifiers if v.rank == auditor
                                      for d in v.directions},
                      codecs=(plan.stages[k - 1].out_codec if k > 0 else "none", plan.stages[k].out_codec),
                      random_ops=tuple(dict.fromkeys(op for b in plan.stages[k].blocks for op in b.random_ops)))


def audited_stages(plan: Plan) -> dict[int, tuple[int, int, bool]]:
    """Stage -> (auditor rank, source rank, gradients audited too) for every stage the plan audits
    (``audit_every``) where ``audit_site`` allows it, as the runtime audits them."""
    return {k: (int(w.auditor), int(w.source), w.grads) for k, w in _audit_wheres(plan).items()}


def _audit_wheres(plan: Plan) -> dict[int, AuditWhere]:
    """Stage -> where it is audited (``audit_site``), for every stage the plan audits."""
    if not plan.policy.enabled:
        return {}
    out = {}
    for k, st in enumerate(plan.stages):
        where = audit_site(plan, k) if st.audit_every else None
        if isinstance(where, AuditWhere):
            out[k] = where
    return out


def _audit_cost(plan: Plan, costs: CostModel, k: int, where: AuditWhere) -> AuditCost:
    """One step's audit of stage ``k`` (``cost_models.audit``), priced as the stage's passes on the auditor."""
    auditor, source = int(where.auditor), int(where.source)
    chain, config, spec = costs.chain, costs.config, costs.spec[auditor]
    lo, hi = costs.ranges[k]
    traced = memory.trace_dtype(chain)
    fwd = compute.range_fwd_ms(chain, lo, hi, spec, config.dtype, trace_dtype=traced)
    bwd = compute.range_bwd_ms(chain, lo, hi, spec, config.dtype, trace_dtype=traced) \
        + (fwd if costs.recompute[k] else 0.0)
    params, tensors = memory.stage_param_count(chain, lo, hi), stage_param_tensors(chain, lo, hi)
    device = plan.ranks[auditor].device
    slowest = max(plan.stage_ranks(k), key=lambda r: costs.message_ms("F", k, r, auditor))
    every, inputs = plan.stages[k].audit_every, costs.boundary_bytes[k - 1] if k else 0.0
    # the input gradient's share of the backward, the weights' too for a contribution audit (as the planner prices)
    bwd = audited_backward_ms(bwd, every=every, replica_microbatches=[len(plan.ranks[r].microbatches)
                                                                     for r in plan.stage_ranks(k)],
                              contributions=bool(where.grads or where.grads_from))
    cost = audit_ms(every=every, microbatches=plan.num_microbatches, params=params,
                    param_tensors=tensors, forward_ms=fwd, backward_ms=bwd if where.grads else None,
                    output_bytes=costs.boundary_bytes[k], input_bytes=inputs,
                    source_link=costs.cluster.link(plan.ranks[source].device, device),
                    digest_link=costs.cluster.link(plan.ranks[slowest].device, device),
                    verifier_mem_bw_bytes_per_s=spec.mem_bw_bytes_per_s,
                    optim_ms=optim_ms(params, config, spec, param_tensors=tensors),
                    copy_links=_copy_links(plan, costs, where), input_elem_bytes=dtype_bytes(config.dtype),
                    signed=bool(where.signed_by), sole=len(plan.stage_ranks(k)) == 1)
    if not where.grads_from:
        return cost
    # gradients audited from copies too (``audit_price.with_copied_grads``, as the planner prices them)
    return with_copied_grads(cost, every=every, microbatches=plan.num_microbatches, backward_ms=bwd,
                             input_bytes=inputs, output_bytes=costs.boundary_bytes[k],
                             elem_bytes=dtype_bytes(config.dtype), verifier_mem_bw_bytes_per_s=spec.mem_bw_bytes_per_s,
                             upstream=_copy_links(plan, costs, where),
                             downstream=_copy_links(plan, costs, where, where.grads_from))


def _copy_links(plan: Plan, costs: CostModel, where: AuditWhere,
                senders: tuple[int, ...] | None = None) -> tuple[tuple[Link | None, int], ...]:
    """Per rank copying the auditor the audited inputs (an upstream rank, or signed, a replica; ``senders``: those
    ranks instead, the downstream ones copying gradients): its link there (None: the auditor itself) and the
    microbatches it sends the stage (takes) a step."""
    auditor = plan.ranks[int(where.auditor)].device
    return tuple((None if int(r) == int(where.auditor) else costs.cluster.link(plan.ranks[int(r)].device, auditor),
                  len(plan.ranks[int(r)].microbatches))
                 for r in (where.copied_from if senders is None else senders))


def _audit_checks(plan: Plan, costs: CostModel) -> dict[tuple[int, int, str], float]:
    """An auditor that audits gradients too recomputes a microbatch once it has checked the gradient the
    replica sent upstream (its last tensor): that check takes the recompute's expected share longer."""
    out = {}
    for k, where in _audit_wheres(plan).items():
        if where.grads:
            cost = _audit_cost(plan, costs, k, where)
            out[(int(where.auditor), k - 1, "B")] = cost.recompute_ms / plan.num_microbatches
    return out


def _signing(plan: Plan, costs: CostModel) -> dict[int, float]:
    """Rank -> what each of its forwards adds for the audits from signed inputs: an upstream rank signs the
    activation it sends the audited stage, a replica checks its input's signature (``audit_price.signing_ms``)."""
    out: dict = {}
    for k, where in _audit_wheres(plan).items():
        if where.signed_by:
            signing_work(costs.wire_bytes[k - 1], plan.stage_ranks(k - 1), plan.stage_ranks(k), out)
    return out


def _hear_inputs(run: _Run, k: int, where: AuditWhere, cost: AuditCost, posted: float) -> float:
    """When the auditor of stage ``k`` can recompute: its program (and its audits of earlier stages) done and,
    copied, every sender's copy in. It receives them one rank after another, in rank order; a rank's copy
    leaves once its program (and what it did for earlier stages' audits) is done, and its send returns when it
    is received (``runtime.rank.audits.end_step``, which runs the stages in order). Signed, the senders are the
    replicas, each asked once the copy before is in (``runtime.rank.audit_signed.hear``) and sending once the
    request reached it (a latency), the source behind its applied gradient on their link (its receive ``posted``
    as the auditor's program ended)."""
    auditor = int(where.auditor)
    every, t = run.plan.stages[k].audit_every, run.clock[auditor]
    # per microbatch: wire bytes, signed; else float32, with the input gradients where those come copied too, and
    # then the downstream ranks' copies of the gradients they sent (``audit_price.copied_message_bytes``)
    up, down = copied_message_bytes(run.costs.boundary_bytes[k - 1], run.costs.boundary_bytes[k],
                                    dtype_bytes(run.costs.config.dtype), grads=bool(where.grads_from))
    if where.signed_by:
        up = run.costs.boundary_bytes[k - 1]
    messages = [(link, sent, r, up, "input copy") for (link, sent), r in
                zip(_copy_links(run.plan, run.costs, where), where.copied_from)]
    messages += [(link, sent, r, down, "gradient copy") for (link, sent), r in
                 zip(_copy_links(run.plan, run.costs, where, where.grads_from), where.grads_from)]
    for link, sent, r, one, what in messages:
        r = int(r)
        if link is None:
            continue
        begin = max(t, run.clock[r], run.link_free.get((r, auditor), 0.0))
        if where.signed_by:
            begin = max(begin, t + link.latency_ms)   # the request, sent once the copy before is in
            if r == int(where.source):
                begin = max(begin, max(run.reached_optim[r], posted) + cost.gradient_ms)
        t = begin + copy_ms(every=every, sent_microbatches=sent, input_bytes=one, link=link)
        run.events.append(Event(rank=r, kind="send", start_ms=begin, end_ms=t, label=f"stage {k} audit: {what}",
                                stage=k, peer=auditor))
        run.clock[r] = t
    return t


def _audits(run: _Run) -> None:
    """Each audited stage, in order: its auditor, once its program is done (and, copied, the upstream ranks'
    copies of the audited inputs are in), recomputes the step's audited microbatches, then hears the replicas'
    digests and applied gradient (after their optimizer steps; its receive posted as its program ended): its step
    ends then (a sole replica's: once it has the digest, the gradient needed only by the next step's recompute);
    its copy steps on a thread of its own, once the gradient is in, into the next step
    (``planner.runtime.rank.audits``). Recomputes left to the step's end (all but those among the checks) run on
    that thread in the next step, before the copy's step (``AuditCost.deferred``): work on the auditor's device
    from the step's start, beside its own passes (``audit_price.Stepper``, run with the programs); the auditor's
    audit of a stage waits for that stage's parts there (and those queued before them), not for a later stage's
    (``Stepper.through_ms``)."""
    plan = run.plan
    for st in run.steppers.values():
        st.done_ms()   # alone once the auditor's program is done
    posted = list(run.clock)   # each auditor posts its receives of the applied gradients as its program ends
    for k, where in _audit_wheres(plan).items():
        auditor = int(where.auditor)
        cost = _audit_cost(plan, run.costs, k, where)
        free = run.clock[auditor]
        start = _hear_inputs(run, k, where, cost, posted[auditor])
        left = 0.0 if cost.during_step or cost.deferred else cost.recompute_ms
        done = max(run.clock[r] for r in plan.stage_ranks(k))
        sent = run.reached_optim[int(where.source)]
        stepper = run.steppers[auditor].through_ms(k) if cost.deferred and auditor in run.steppers else None
        heard = cost.heard_ms(recompute_from_ms=start, replicas_done_ms=done, posted_ms=posted[auditor],
                              gradient_sent_ms=sent, stepper_ms=stepper)
        stepping = max(heard, cost.gradient_in_ms(replicas_done_ms=done, posted_ms=posted[auditor],
                                                  gradient_sent_ms=sent))
        ahead = () if cost.deferred else (("optim", stepping, stepping + cost.optim_ms, "copy's step"),)
        boxes = (("control", free, start, "input copies"), ("verify", start, start + left, "recompute"),
                 ("control", start + left, heard, "applied gradient"), *ahead)
        run.events.extend(Event(rank=auditor, kind=kind, start_ms=a, end_ms=b, label=f"stage {k} audit: {what}",
                                stage=k) for kind, a, b, what in boxes if b > a)
        run.clock[auditor] = heard
    for auditor, st in run.steppers.items():   # each part from the one before it (the first: the step's start)
        run.events.extend(Event(rank=auditor, kind="verify" if part.recompute else "optim", start_ms=a, end_ms=b,
                                label=part.label, stage=part.stage)
                          for part, a, b in zip(st.parts, [0.0, *st.ends], st.ends) if b > a)


def _steppers(plan: Plan, costs: CostModel) -> dict[int, Stepper]:
    """Auditor rank -> its copies' stepper: the last step's deferred recomputes and copy steps, queued at the
    step's start (``audit_price.stepper_parts``)."""
    parts = stepper_parts([(k, int(w.auditor), _audit_cost(plan, costs, k, w)) for k, w in _audit_wheres(plan).items()])
    return {int(a): Stepper(parts=p) for a, p in parts.items()}


def _verdict_exchange(run: _Run) -> None:
    """A verified step ends with the lead verifier's verdict (``cost_models.verify.verdict_exchange``): each
    rank waits for it from the end of its program. The next step starts when the first stage's ranks have
    heard it: the others' wait is drawn, but overlaps the next step's activations on their way to them."""
    plan, costs = run.plan, run.costs
    verifiers = sorted({v.rank for v in plan.verifiers})
    if not verifiers or not plan.policy.enabled:
        return
    cluster = plan.effective_cluster()
    trusted = {r.rank for r in plan.ranks if cluster.device(r.device).trusted}
    replicas = [plan.stage_ranks(k) for k in range(plan.num_stages)]
    sketches = [r for ranks in replicas if len(ranks) >= 2 and not set(ranks) <= trusted for r in ranks]

    def message_ms(src: int, dst: int) -> float:
        cpu = 0.0 if run.messages is None else (run.messages.send_cpu_ms(VERDICT_BYTES)
                                                 + run.messages.recv_cpu_ms(VERDICT_BYTES))
        return costs.verdict_ms(src, dst) + cpu

    heard = verdict_exchange(dict(enumerate(run.clock)), verifiers=verifiers, counters=replicas[0],
                             sketches=sketches, message_ms=message_ms, blame_ms=costs.blame_ms)
    for rank, t in heard.items():
        if t > run.clock[rank]:
            run.events.append(Event(rank=rank, kind="control", start_ms=run.clock[rank], end_ms=t,
                                    label="verdict exchange"))
    for rank in replicas[0]:
        run.clock[rank] = heard[rank]


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
