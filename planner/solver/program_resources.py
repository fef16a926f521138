"""The closed forms' resources (``planner.solver.program_cost``): each stage replica, verifier-only device, directed
link and checking device busy for its share of the step, with the path outside it, and the stalls of verdicts
queued behind a verifier's own traffic (``verdict_backlog``). They name the resource that paces the pipeline."""
from __future__ import annotations

import math

from cost_models import comm
from planner.solver.problem import Problem
from planner.solver.program_paths import _Paths, _queued
from planner.solver.program_traffic import _Traffic
from planner.solver.routing import owners
from planner.solver.verdict_backlog import (
    Backlog,
    first_backward_delay,
    verdict_backlog,
)


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
