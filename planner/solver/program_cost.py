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
  (``audit_price.Stepper``): run with the programs (``drain_schedule``); the step ends no sooner than the stepper
  is through its queue, and each deferred audit no sooner than its own stage's parts there (and those queued
  before them, ``audit_price.Stepper.through_ms``), the auditor's next audit after it (``planner.simulate._audits``).
* GPipe's pipeline comes from its programs run (``drain_schedule``, every forward, then the backwards in the
  forwards' order): closed forms of its two phases missed where replicas' and links' phases overlap (random pools
  of 6-16 volunteers: 0.75-1.33 of the simulation, 83% within 5%; now 1.000).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from cost_models import comm
from planner.solver.audit_price import (
    StepperPart,
    audit_cost,
    audit_site,
    signing_ms,
    stepper_parts,
    through_from_done,
)
from planner.solver.drain_schedule import drain_with_steppers
from planner.solver.in_flight import limit
from planner.solver.problem import Problem
from planner.solver.routing import owners, pair_counts, route
from planner.solver.solution import StagePlacement, VerifierPlacement
from planner.solver.verdict_backlog import (
    Backlog,
    first_backward_delay,
    verdict_backlog,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ProgramCost:
    """The priced program: its step, the pipeline part (to stage 0's last backward), the in-flight limit per
    stage replica, and the resource that paces it."""

    step_ms: float
    pipe_ms: float
    in_flight: tuple[tuple[int, ...], ...]
    bottleneck: str
    stepper_ms: float = 0.0   # when the auditors' copy steppers are through their queues (0: none priced)


@dataclass(slots=True)
class _Traffic:
    """What the messages of one step put on the links: wire time per directed device pair, the boundary
    directions each pair carries, and per boundary the verdict wait a consumer's own pass does not hide."""

    wire: dict[tuple[str, str], float]
    by_direction: dict[tuple[int, str, str, str], float]  # (boundary, act|grad, src, dst) -> its wire time
    kinds: dict[tuple[str, str], set[tuple[int, str]]]
    checks: dict[str, set[tuple[int, str]]]
    wait: dict[tuple[int, str, str], float]  # (boundary, act|grad, consumer) -> ms
    messages: dict[tuple[str, str], int]  # messages per directed device pair
    copied_in: dict[tuple[int, int], set[tuple[str, str]]]  # (stage, replica) -> links copying its checked inputs


def _traffic(problem: Problem, stages, verifiers) -> _Traffic:
    out = _Traffic(wire={}, by_direction={}, kinds={}, checks={}, wait={}, messages={}, copied_in={})

    def checker(k: int, direction: str, sender: str) -> VerifierPlacement | None:
        """The verifier of ``sender``'s tensors at boundary ``k`` (a boundary's verifiers may split its senders)."""
        return next((v for v in verifiers if v.boundary == k and direction in v.directions and v.covers(sender)),
                    None)

    def put(a: str, b: str, nbytes: float, count: int, kind: tuple[int, str]) -> float:
        if a == b:
            return 0.0
        link = problem.link(a, b)
        ms = count * 1e3 * nbytes / link.bytes_per_s
        out.wire[(a, b)] = out.wire.get((a, b), 0.0) + ms
        out.messages[(a, b)] = out.messages.get((a, b), 0) + count
        out.by_direction[(*kind, a, b)] = out.by_direction.get((*kind, a, b), 0.0) + ms
        out.kinds.setdefault((a, b), set()).add(kind)
        return comm.transfer_ms(nbytes, link)

    for k in range(len(stages) - 1):
        src, dst = stages[k], stages[k + 1]
        nbytes = problem.wire_bytes(src.last_block, src.out_codec)  # copies too: one encoded payload
        for (i, j), n in pair_counts(src.microbatches, dst.microbatches).items():
            a, b = src.devices[i], dst.devices[j]
            put(a, b, nbytes, n, (k, "act"))
            put(b, a, nbytes, n, (k, "grad"))
            for direction, sender, consumer in (("act", a, b), ("grad", b, a)):
                v = checker(k, direction, sender)
                if v is None:
                    continue
                out.checks.setdefault(v.device, set()).add((k, direction))
                if v.device == consumer:
                    continue
                copy = put(sender, v.device, nbytes, n, (k, direction)) if v.device != sender else 0.0
                if direction == "act" and v.device != sender:
                    out.copied_in.setdefault((k + 1, j), set()).add((sender, v.device))
                check = problem.verify_ms(problem.raw_bytes(src.last_block), problem.class_of(v.device))
                verdict = problem.link(v.device, consumer).latency_ms
                at = dst if direction == "act" else src
                cls = problem.class_of(consumer)
                tables = problem.tables(at.recompute)
                own = tables.range_bwd_ms(at.first_block, at.last_block, cls)
                if direction == "act":
                    own = tables.range_time_ms(at.first_block, at.last_block, cls) - own
                arrival = comm.transfer_ms(nbytes, problem.link(sender, consumer)) if sender != consumer else 0.0
                key = (k, direction, consumer)  # a consumer that checks its own input waits on no verdict
                out.wait[key] = max(out.wait.get(key, 0.0), copy + check + verdict - arrival - own)
    return out


@dataclass(slots=True)
class _Paths:
    """Per microbatch ``m`` on its route (one replica per stage): ``fwd[m][k]`` its forward path to stage
    ``k``, ``bwd[m][k]`` its backward path from stage ``k`` through stage 0, ``down[m][k]`` its round trip
    downstream of stage ``k``; ``late_f[m][k]`` / ``late_b[m][k]`` how long upstream replicas hold it behind
    their own earlier forwards / later backwards; ``hop_f[m][k]`` / ``hop_b[m][k]`` its activation's /
    gradient's transfer across boundary ``k`` with the verdict wait there."""

    fwd: list[list[float]]
    bwd: list[list[float]]
    down: list[list[float]]
    late_f: dict[int, list[float]]   # only for the first microbatch of some replica
    late_b: dict[int, list[float]]   # only for the last microbatch of some replica
    hop_f: list[list[float]]
    hop_b: list[list[float]]


def _paths(problem: Problem, stages, routes, fb, bw, wait) -> _Paths:
    S, M = len(stages), sum(stages[0].microbatches)
    owner = [owners(st.microbatches) for st in stages]
    # Microbatches on the same replicas share their paths (without replicas, all of them do): compute each
    # route once; only the queueing behind a replica's other microbatches depends on the microbatch.
    hops: dict[tuple[int, int, int], float] = {}
    by_route: dict[tuple[int, ...], tuple[list[float], ...]] = {}
    out = _Paths(fwd=[None] * M, bwd=[None] * M, down=[None] * M, late_f={}, late_b={}, hop_f=[None] * M,
                 hop_b=[None] * M)
    for m in range(M):
        rep = tuple(owner[k][m][0] for k in range(S))
        shared = by_route.get(rep)
        if shared is None:
            shared = by_route[rep] = _route_paths(problem, stages, rep, fb, bw, wait, hops)
        out.fwd[m], out.bwd[m], out.down[m], out.hop_f[m], out.hop_b[m] = shared
    # Queueing is read only for a replica's first microbatch (forwards) and its last (backwards).
    for m in {ids[0] for rs in routes for ids in rs}:
        out.late_f[m] = _late(S, [pos * (fb[k][i] - bw[k][i]) for k, (i, pos) in enumerate(own[m] for own in owner)])
    for m in {ids[-1] for rs in routes for ids in rs}:
        out.late_b[m] = _late(S, [(stages[k].microbatches[i] - 1 - pos) * bw[k][i]
                                  for k, (i, pos) in enumerate(own[m] for own in owner)])
    return out


def _late(S: int, held: list[float]) -> list[float]:
    """Per stage k, the longest hold of any stage before it (``held[j]``: stage j's)."""
    out = [0.0] * S
    for k in range(1, S):
        out[k] = max(out[k - 1], held[k - 1])
    return out


def _route_paths(problem: Problem, stages, rep: tuple[int, ...], fb, bw, wait,
                 hops: dict[tuple[int, int, int], float]) -> tuple[list[float], ...]:
    """``fwd``, ``bwd``, ``down``, ``hop_f``, ``hop_b`` of a microbatch routed through replicas ``rep``
    (shared between the microbatches on that route: read only)."""
    S = len(stages)
    fwd, bwd, down, hop_f, hop_b = ([0.0] * S for _ in range(5))
    for k in range(S - 1):
        a, b = stages[k].devices[rep[k]], stages[k + 1].devices[rep[k + 1]]
        ms = hops.get((k, rep[k], rep[k + 1]))
        if ms is None:
            nbytes = problem.wire_bytes(stages[k].last_block, stages[k].out_codec)
            ms = hops[k, rep[k], rep[k + 1]] = comm.transfer_ms(nbytes, problem.link(a, b))
        hop_f[k] = ms + wait.get((k, "act", b), 0.0)
        hop_b[k] = ms + wait.get((k, "grad", a), 0.0)
    for k in range(1, S):
        i = rep[k - 1]
        fwd[k] = fwd[k - 1] + fb[k - 1][i] - bw[k - 1][i] + hop_f[k - 1]
        bwd[k] = bwd[k - 1] + bw[k - 1][i] + hop_b[k - 1]
    for k in range(S - 2, -1, -1):
        down[k] = down[k + 1] + fb[k + 1][rep[k + 1]] + hop_f[k] + hop_b[k]
    return fwd, bwd, down, hop_f, hop_b


def _queued(stages, routes, fb, k: int, i: int, at: int) -> float:
    """How long replica ``i`` of stage ``k``'s first (``at=0``) or last (``at=-1``) microbatch waits downstream
    behind the same-numbered microbatches of the stage's other replicas, sent at the same time and lower."""
    x = routes[k][i][at]
    rivals = [ids[at] for ids in routes[k] if ids[at] < x]
    if not rivals:
        return 0.0
    wait = 0.0
    for j in range(k + 1, len(routes)):
        owner = owners(stages[j].microbatches)
        ahead = sum(owner[m][0] == owner[x][0] for m in rivals)
        wait = max(wait, ahead * fb[j][owner[x][0]])
    return wait


def _own_floor(routes, fb, p: _Paths) -> list[float]:
    """Per stage, the earliest its last backward can end: each replica's first microbatch arrives, then the
    replica runs all its passes (a stage the drain leaves early still has them to run)."""
    return [max(p.fwd[ids[0]][k] + p.late_f[ids[0]][k] + len(ids) * t for ids, t in zip(rs, fb[k]))
            for k, rs in enumerate(routes)]


def _stage_resources(problem: Problem, stages, routes, fb, bw, p: _Paths, verify_load: dict[str, float],
                     periods, traffic: _Traffic, backlog: Backlog):
    """Per stage replica: (busy, the path outside it, name)."""
    S, M = len(stages), len(p.fwd)
    busy: list[tuple[float, float, str]] = []
    throttled = [any(period > t for (_, period), t in zip(periods[k], fb[k])) for k in range(S)]
    for k, st in enumerate(stages):
        for i, (dev, ids, t, b) in enumerate(zip(st.devices, routes[k], fb[k], bw[k])):
            m, first, last = len(ids), ids[0], ids[-1]
            trip = max(p.down[x][k] for x in ids)
            n, period = periods[k][i]
            # Idle while its first gradient makes the round trip (its warm-up forwards fill part of it) and
            # while its last one does (its backwards still in flight fill part of that).
            trips = (p.down[first][k] + _queued(stages, routes, fb, k, i, 0), p.down[last][k])
            f = t - b
            if n >= m:  # every microbatch in flight at once: one wait, after the forwards or before the backwards
                # (never less than its own passes: a last stage without round trips runs them back to back)
                idle = max(m * f + trips[1] + b, f + trips[0] + m * b, m * t) - m * t
            elif period > t:  # throttled: n chains of pass, round trip, pass; the last chain starts passes late
                idle = (math.ceil(m / n) * n - m) * period + ((m - 1) % n) * t  # a chain: n periods
                if any(throttled[k + 1:]):  # a throttled stage downstream spreads the chains over the period:
                    idle = max(idle, trip + t - period)  # the last forward ends the busy time, its trip follows
            else:
                idle = max(0.0, trips[0] - (n - 1) * f, _verdict_stall(traffic, k, i, f, n, trips[0])) \
                    + max(0.0, trips[1] - (n - 1) * b)
            idle += backlog.consumer_ms.get((k, i), 0.0) + backlog.stream_ms
            outside = p.fwd[first][k] + p.late_f[first][k] + idle + p.bwd[last][k] + p.late_b[last][k]
            work = m * period + M * verify_load.get(dev, 0.0)
            busy.append((work, outside, f"stage {k} on {dev}"))
    return busy


def _verdict_stall(traffic: _Traffic, k: int, i: int, f: float, n: int, trip: float) -> float:
    """How long replica ``i`` of stage ``k`` stalls in its warm-up on verdicts whose copies queue on a link slower
    than its forwards: it passes each result on only after its input's verdict, and the copies reach the
    verifier one per ``w`` (that link's wire time per message), so each warm-up forward that the first
    gradient's return (``f + trip``) does not cut short waits ``w - f`` longer than the one before."""
    links = traffic.copied_in.get((k, i))
    if not links:
        return 0.0
    w = max(traffic.wire[pair] / traffic.messages[pair] for pair in links)
    if w <= f:
        return 0.0
    forwards = min(n, 1 + math.floor((f + trip) / w))
    return (forwards - 1) * (w - f)


def _message_resources(stages, traffic: _Traffic, p: _Paths, verify_load: dict[str, float], backlog: Backlog,
                       stage_ms: float):
    """(busy, the path outside it, name) of every verifier-only device and directed link. Before the first
    and after the last message of boundary k's activations (gradients) the path runs elsewhere; one busy
    with several kinds waits the least lead and the least trail. A link waits out a verifier's halt less
    what its senders queued on it by then (``stage_ms``: the busiest stage replica's work)."""
    first, last, M = 0, len(p.fwd) - 1, len(p.fwd)

    def lead(kind: tuple[int, str]) -> float:
        k, direction = kind
        if direction == "act":  # the first microbatch leaves stage k
            return p.fwd[first][k + 1] - p.hop_f[first][k]
        return p.fwd[first][k + 1] + p.down[first][k] - p.hop_f[first][k] - p.hop_b[first][k]  # ... and k + 1

    def trail(kind: tuple[int, str]) -> float:
        k, direction = kind
        if direction == "act":  # the last microbatch's round trip from k + 1, then its backward from k
            return p.down[last][k] - p.hop_f[last][k] - p.hop_b[last][k] + p.bwd[last][k + 1]
        return p.bwd[last][k + 1] - p.hop_b[last][k]

    def outside(kinds: set[tuple[int, str]]) -> float:
        return min(map(lead, kinds)) + min(map(trail, kinds))

    on_stage = {d for st in stages for d in st.devices}
    out = [(M * load, outside(traffic.checks[dev]), f"verifier {dev}")
           for dev, load in verify_load.items() if dev not in on_stage]
    # The pace the pipeline could keep without the links into the verifiers: a link slower than that has its
    # senders' messages queued on it, which carry it through a verifier's halt.
    pace = max([ms for (_, dst), ms in traffic.wire.items() if dst not in traffic.checks] + [stage_ms])

    def halted(pair: tuple[str, str], ms: float) -> float:
        queued = max(0.0, backlog.stream_at_ms - min(map(lead, traffic.kinds[pair]))) * max(0.0, 1.0 - pace / ms)
        return max(0.0, backlog.stream_ms - queued)

    out += [(ms, outside(traffic.kinds[pair]) + halted(pair, ms), f"link {pair[0]}->{pair[1]}")
            for pair, ms in traffic.wire.items()]
    return out


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


def _check_queues(problem: Problem, stages, verifiers, p: _Paths, bw) -> list[tuple[float, float, str]]:
    """(when its last check's consequences end, 0, name) of every device checking a replicated stage's
    boundary: its checks queue in the order their inputs arrive, which differs by route (a twin's microbatch
    may reach it only after a slower route's verdicts), so the stream, not the device's own path, can pace it."""
    S, M = len(stages), len(p.fwd)
    owner = [owners(st.microbatches) for st in stages]
    groups: dict[tuple[int, ...], list[int]] = {}
    for x in range(M):
        groups.setdefault(tuple(owner[k][x][0] for k in range(S)), []).append(x)
    jobs: dict[str, list[tuple[float, float, float]]] = {}
    for v in verifiers:
        k = v.boundary
        if len(stages[k].devices) == 1 and len(stages[k + 1].devices) == 1:
            continue
        nbytes = problem.wire_bytes(stages[k].last_block, stages[k].out_codec)
        check = problem.verify_ms(problem.raw_bytes(stages[k].last_block), problem.class_of(v.device))
        for rep, ids in groups.items():
            x, i, j = ids[0], rep[k], rep[k + 1]
            a, b = stages[k].devices[i], stages[k + 1].devices[j]
            for direction in v.directions:
                if direction == "act":
                    sender, consumer, leave = a, b, p.fwd[x][k + 1] - p.hop_f[x][k]
                    trail = p.down[x][k + 1] + bw[k + 1][j] + p.bwd[x][k + 1]
                else:
                    sender, consumer = b, a
                    leave = p.fwd[x][k + 1] + p.down[x][k] - p.hop_f[x][k] - p.hop_b[x][k]
                    trail = bw[k][i] + p.bwd[x][k]
                if not v.covers(sender):  # another verifier of the boundary checks this replica
                    continue
                copy = comm.transfer_ms(nbytes, problem.link(sender, v.device)) if sender != v.device else 0.0
                verdict = problem.link(v.device, consumer).latency_ms if consumer != v.device else 0.0
                jobs.setdefault(v.device, []).append((leave + copy, len(ids) * check, verdict + trail))
    out = []
    for dev, queue in jobs.items():
        clock = end = 0.0
        for arrival, work, trail in sorted(queue):
            clock = max(clock, arrival) + work
            end = max(end, clock + trail)
        out.append((end, 0.0, f"checks on {dev}"))
    return out


def _backlog(problem: Problem, stages, verifiers, routes, fb, bw, p: _Paths, periods, traffic: _Traffic,
             verify_load: dict[str, float]) -> Backlog:
    """The stalls of verdicts queued behind their stage-replica verifier's own activations (1F1B; GPipe sends
    every activation before any verdict on a gradient): each verifier's checks measured as a share of the
    busiest resource's work, the least the step can be."""
    if problem.schedule == "gpipe" or not verifiers:
        return Backlog(consumer_ms={})
    M = len(p.fwd)
    floor = max([len(routes[k][i]) * periods[k][i][1] + M * verify_load.get(dev, 0.0)
                 for k, st in enumerate(stages) for i, dev in enumerate(st.devices)] + list(traffic.wire.values()))
    share = {dev: M * load / floor for dev, load in verify_load.items()}
    limits = [tuple(n for n, _ in row) for row in periods]
    return verdict_backlog(problem, stages, verifiers, routes, fb, bw, p.fwd, p.down, limits, traffic.wait, share)


def _delay_first_backwards(problem: Problem, stages, verifiers, routes, fb, bw, p: _Paths, limits,
                           backlog: Backlog) -> Backlog:
    """A replica whose warm-up verdicts queue behind its downstream verifier's gradients (``first_backward_delay``)
    idles that much longer, and its first microbatch's round trip from every stage upstream grows as much."""
    delays = first_backward_delay(problem, stages, verifiers, routes, fb, bw, p.fwd, p.down, p.hop_f, limits)
    if not delays:
        return backlog
    consumer = dict(backlog.consumer_ms)
    for (c, j), delay in delays.items():
        consumer[(c, j)] = consumer.get((c, j), 0.0) + delay
        x = routes[c][j][0]
        p.down[x] = [d + delay if k < c else d for k, d in enumerate(p.down[x])]  # a copy: routes share rows
    return Backlog(consumer_ms=consumer, stream_ms=backlog.stream_ms, stream_at_ms=backlog.stream_at_ms)


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


def _steppers(problem: Problem, stages, verifiers) -> dict[str, tuple[StepperPart, ...]]:
    """Auditor device -> its copies' stepper's queue at the step's start (``audit_price.stepper_parts``)."""
    costs = []
    for k, st in enumerate(stages):
        site = audit_site(problem, stages, verifiers, k) if st.audit_every else None
        if site is not None:
            costs.append((k, site.auditor, audit_cost(problem, st, site, st.audit_every, sum(st.microbatches),
                                                      upstream=stages[k - 1], downstream=_after(stages, k))))
    return stepper_parts(costs)


def _through(background: dict[str, tuple[StepperPart, ...]],
             stepped: dict[str, float]) -> dict[tuple[str, int], tuple[float, float]]:
    """(auditor device, stage) -> when its stepper is through the stage's recompute and its copy's step
    (``audit_price.Stepper.through_ms``), from when it was through its queue (``stepped``, the replay's)."""
    return {(d, k): ends for d, done in stepped.items() for k, ends in through_from_done(background[d], done).items()}


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


def _add_signing_ms(problem: Problem, stages, verifiers, fb) -> None:
    """Each forward grows by the signing or the signature check an audit from signed inputs adds there."""
    for (k, dev), ms in signing_ms(problem, stages, verifiers).items():
        i = stages[k].devices.index(dev)
        fb[k][i] += ms


def _audit_checks(problem: Problem, stages, verifiers) -> dict[tuple[str, int, str], float]:
    """(auditor, boundary, B) -> what each of its checks of the gradients an audited stage sends upstream adds: the
    recompute of that microbatch's expected share (``AuditCost.during_step``, ``simulate._audit_checks``)."""
    out: dict[tuple[str, int, str], float] = {}
    for k, st in enumerate(stages):
        site = audit_site(problem, stages, verifiers, k) if st.audit_every else None
        if site is not None and site.grads:
            M = sum(st.microbatches)
            out[(site.auditor, k - 1, "B")] = audit_cost(problem, st, site, st.audit_every, M).recompute_ms / M
    return out


def _with_audits(problem: Problem, stages, verifiers, verify_load: dict[str, float]) -> dict[str, float]:
    """``verify_load`` with the recomputes an auditor runs among its checks (``AuditCost.during_step``), per
    microbatch of the step."""
    out = dict(verify_load)
    for k, st in enumerate(stages):
        site = audit_site(problem, stages, verifiers, k) if st.audit_every else None
        if site is not None and site.grads:
            M = sum(st.microbatches)
            out[site.auditor] = out.get(site.auditor, 0.0) + audit_cost(problem, st, site, st.audit_every, M).recompute_ms / M
    return out


def _audits_end_ms(problem: Problem, stages, verifiers, traffic: _Traffic, ends: list[float], sent: list[float],
                   p: _Paths, stepping: list[float], through: dict[tuple[str, int], tuple[float, float]],
                   ran: dict[str, float]) -> float:
    """When the last audited stage's auditor has recomputed its audited microbatches and heard the applied
    gradient (``cost_models.audit``; its copy steps off the step's path), sent from ``stepping`` (the replicas'
    optimizer steps' starts): after the replicas' optimizer steps, its own program and, where the inputs come
    copied, the upstream stage's ranks' ends and the copies' transfers (0: nothing audited). The stages are
    audited in order, each device's part in one after its part in the last (``runtime.rank.audits.end_step``), the
    gradients' receives posted as the auditor's program ended; a deferred one waits for its own parts of its
    auditor's stepper (and those queued before them: ``through``, by auditor and stage,
    ``audit_price.Stepper.through_ms``), never a later stage's."""
    out, clock, posted = 0.0, {}, {}

    def done(device: str) -> float:
        if device not in clock:
            clock[device] = posted[device] = _program_end_ms(problem, stages, traffic, ends, sent, p, device, ran)
        return clock[device]

    for k, st in enumerate(stages):
        site = audit_site(problem, stages, verifiers, k) if st.audit_every else None
        if site is None:
            continue
        cost = audit_cost(problem, st, site, st.audit_every, sum(st.microbatches), upstream=stages[k - 1],
                          downstream=_after(stages, k))
        # copied: the upstream ranks' copies, then the downstream ranks' of the gradients they sent (``grads_from``)
        senders = [d for d in (*site.copied_from, *site.grads_from) if d != site.auditor]
        free, upstream = done(site.auditor), max(map(done, senders), default=0.0)
        inputs_in = cost.inputs_in_ms(auditor_free_ms=free, upstream_done_ms=upstream, gradient_sent_ms=stepping[k],
                                      posted_ms=posted[site.auditor])
        for d in senders:   # a copy's send returns once received
            clock[d] = inputs_in
        # its stepper runs beside the programs (``_priced``'s background), not alone: the audit waits for this
        # stage's parts of it, and the auditor's next audit starts from there
        clock[site.auditor] = cost.end_ms(auditor_free_ms=free, replicas_done_ms=ends[k], upstream_done_ms=upstream,
                                          gradient_sent_ms=stepping[k], posted_ms=posted[site.auditor],
                                          stepper_ms=through.get((site.auditor, k), (0.0, 0.0)))
        out = max(out, clock[site.auditor])
    return out


def _after(stages, k: int):
    """The stage after ``k`` (None: ``k`` is the last), whose devices copy an auditor gradients (``grads_from``)."""
    return stages[k + 1] if k + 1 < len(stages) else None


def _program_end_ms(problem: Problem, stages, traffic: _Traffic, ends: list[float], sent: list[float], p: _Paths,
                    device: str, ran: dict[str, float]) -> float:
    """When ``device``'s program ends: its stage's optimizer step, else its last check: as the programs ran
    (``ran``), or from the closed forms, a gradient's by the time its consumer hears the verdict on the last one
    (the last microbatch's forwards all came before); with none, an activation's, conservatively after its
    sender's last backward."""
    on = [ends[k] for k, st in enumerate(stages) if device in st.devices]
    if on:
        return max(on)
    if device in ran:
        return ran[device]
    last, cls = len(p.fwd) - 1, problem.class_of(device)
    checks = traffic.checks.get(device, set())
    grads = [sent[b + 1] + p.hop_b[last][b] for b, d in checks if d == "grad"]
    return max(grads) if grads else max((sent[b] + problem.verify_ms(problem.raw_bytes(stages[b].last_block), cls)
                                         for b, _ in checks), default=0.0)
