"""Verdicts queued behind the verifier's own activations: a stage replica that also verifies sends its verdicts
to a consumer over the link its own activations take there, one message on the wire at a time, in the order sent.

A trusted stage-``k`` replica ``V`` verifying the gradients into stage ``k + 1`` runs its warm-up forwards faster
than its link to a stage-``k + 1`` replica ``C`` carries their outputs (a 4.8 ms forward, 33.5 ms on a 1 Gb/s
wire), so the verdict on ``C``'s first gradient waits until that backlog is on the wire: ``C`` passes its
gradient on only then, beyond the wait for the next activation it needs anyway (which the verdict follows).
When that gradient is the one ``V``'s own first backward needs, ``V``'s program halts there, and every check
queued behind it in program order (every boundary ``V`` watches) waits as long: the whole checked pipeline
stalls (gpt-1.3b, 4 stages x 4 replicas, verifier on a stage-0 A100: 201 ms), less what ``V`` would still have
been busy with by then (its warm-up, its share of the checks). Measured on 36 small pools of that shape
(tests/unit/test_verdict_backlog.py's, 2-4x more compute, 2-8 MB boundaries, 16-32 microbatches): 16 of 36
outside 5% of their simulation before (12 of them 13-18% under), 8 after: three 5.2-7.3% under, one newly
5.5% over, four over by 6-10% as before (``V``'s own stage paces them).

During its warm-up ``V`` checks its twins' copies as they arrive, before its own next forward when they are in
first (the compiler's order: at equal times a check first), which spaces its own forwards out.

The mirror image (``first_backward_delay``): verdicts queued behind the verifier's own gradients. A
stage-``c + 1`` replica ``V`` that checks the activations into a stage-``c`` replica ``C`` sends its verdicts to
``C`` over the link its own gradients take there. ``C`` passes a warm-up forward's result on, and runs its next
forward, only after the verdict on its input; a copy that reaches ``V`` during its first backward is checked
after it, and its verdict follows that backward's gradient onto the wire (157 ms on a slow inter-region link), so
``C``'s last warm-up forward, and with it its first backward and every upstream stage's, starts late (issue 36:
a random 4-stage cluster, verifier on the last stage: 113 ms, the step priced 3.1% under its simulation before).
"""
from __future__ import annotations

from dataclasses import dataclass

from cost_models import comm
from planner.solver.problem import Problem
from planner.solver.routing import owners


@dataclass(frozen=True, slots=True)
class Backlog:
    """Per consumer replica ``(stage, replica)``: how long it stalls on a verdict queued behind the verifier's
    activations; ``stream_ms``: the longest stall of a verifier's own program (all its checks behind it), which
    begins at ``stream_at_ms`` (when the gradient its own backward waits for would have come)."""

    consumer_ms: dict[tuple[int, int], float]
    stream_ms: float = 0.0
    stream_at_ms: float = 0.0


def verdict_backlog(problem: Problem, stages, verifiers, routes, fb, bw, fwd, down, limits,
                    wait: dict[tuple[int, str, str], float], check_share: dict[str, float]) -> Backlog:
    """The stalls of verdicts sent behind their verifier's own warm-up activations (module docstring);
    ``fwd``/``down``: the microbatches' forward paths and round trips (``program_paths._Paths``);
    ``check_share``: per verifier, the share of the step its checks keep it busy."""
    consumer: dict[tuple[int, int], float] = {}
    stream, at = 0.0, 0.0
    for v in verifiers:
        b, k = v.boundary, v.boundary - 1
        if "grad" not in v.directions or k < 0 or v.device not in stages[k].devices:
            continue
        i = stages[k].devices.index(v.device)
        issued = _warmup_forwards(problem, stages, verifiers, routes, fb, bw, fwd, limits, k, i)
        nbytes = problem.wire_bytes(stages[k].last_block, stages[k].out_codec)
        owner_next, owner_here = owners(stages[b].microbatches), owners(stages[k].microbatches)
        for j, dev in enumerate(stages[b].devices):
            if dev == v.device or not v.covers(dev):  # another verifier of the boundary checks this replica
                continue
            x = routes[b][j][0]
            ready = fwd[x][b] + fb[b][j] + down[x][b] + max(0.0, wait.get((b, "grad", dev), 0.0))
            stall = _stall(problem.link(v.device, dev), nbytes, [at for y, at in issued if owner_next[y][0] == j],
                           ready, ready - bw[b][j])
            if stall <= 0.0:
                continue
            consumer[(b, j)] = max(consumer.get((b, j), 0.0), stall)
            if owner_here[x][0] != i:
                continue
            # V's own backward of it waits for it: its program halts, unless V, busy with its warm-up forwards
            # and the checks come in by then, would only reach that backward later anyway.
            due = ready + comm.transfer_ms(nbytes, problem.link(dev, v.device))
            busy_until = issued[-1][1] + check_share.get(v.device, 0.0) * due if issued else 0.0
            halt = stall - max(0.0, busy_until - due)
            if halt > stream:
                stream, at = halt, due
    return Backlog(consumer_ms=consumer, stream_ms=stream, stream_at_ms=at)


def _stall(link, nbytes: float, sent: list[float], ready: float, checked: float) -> float:
    """How much later than it otherwise would a consumer goes on after its first backward (done at ``ready``)
    when the verdict on its gradient, sent about when that gradient reached it (``checked``), follows on the
    link the verifier's activations sent before it (at ``sent``, one on the wire at a time): it would have
    waited anyway for the first of them not in by ``ready``, which the verdict follows."""
    w = 1e3 * nbytes / link.bytes_per_s
    free, arrivals, ahead = 0.0, [], 0.0
    for at in sorted(sent):
        free = max(free, at) + w
        arrivals.append(free + link.latency_ms)
        if at <= checked:
            ahead = free + link.latency_ms
    waiting = next((a for a in arrivals if a > ready), ready)
    return ahead - waiting


def _warmup_forwards(problem: Problem, stages, verifiers, routes, fb, bw, fwd, limits, k: int, i: int
                     ) -> list[tuple[int, float]]:
    """(microbatch, when its output leaves) of replica ``i`` of stage ``k``'s warm-up forwards, run first come
    first served with the checks of its twins' outputs it verifies (a check first at equal times)."""
    dev = stages[k].devices[i]
    ids = routes[k][i][:limits[k][i]]
    mine = next((v for v in verifiers if v.boundary == k and v.device == dev and "act" in v.directions), None)
    check = problem.verify_ms(problem.raw_bytes(stages[k].last_block), problem.class_of(dev)) if mine else 0.0
    own = check if mine is not None and mine.covers(dev) else 0.0
    copies = []
    if mine is not None and k + 1 < len(stages):
        nbytes = problem.wire_bytes(stages[k].last_block, stages[k].out_codec)
        for j, twin in enumerate(stages[k].devices):
            if twin == dev or not mine.covers(twin):
                continue
            transfer = comm.transfer_ms(nbytes, problem.link(twin, dev))
            copies += [fwd[x][k] + fb[k][j] - bw[k][j] + transfer for x in routes[k][j][:limits[k][j]]]
    copies.sort()
    f = fb[k][i] - bw[k][i]
    clock, c, out = fwd[ids[0]][k] if ids else 0.0, 0, []
    for x in ids:
        start = max(clock, fwd[x][k])
        while c < len(copies) and copies[c] <= start:  # checks already in go first
            start = max(start, copies[c]) + check
            c += 1
        clock = start + f
        out.append((x, clock))
        clock += own  # it scores its own output after sending it
    return out


def first_backward_delay(problem: Problem, stages, verifiers, routes, fb, bw, fwd, down, hop_f, limits
                         ) -> dict[tuple[int, int], float]:
    """Per consumer replica ``(stage, replica)``: how much later its first backward starts when the verdicts on its
    warm-up inputs queue behind its downstream verifier's gradients (module docstring); ``fwd``/``down``/``hop_f``:
    the microbatches' forward paths, round trips and activation hops (``program_paths._Paths``)."""
    S = len(stages)
    if problem.schedule == "gpipe":  # every forward runs before any gradient is sent
        return {}
    owner = [owners(st.microbatches) for st in stages]
    forward = [[t - b for t, b in zip(row_t, row_b)] for row_t, row_b in zip(fb, bw)]
    out: dict[tuple[int, int], float] = {}

    def arrive(x: int, k: int) -> float:
        """When microbatch ``x``'s input reaches stage ``k``: its path, behind the upstream replicas' earlier
        forwards."""
        held = max((owner[j][x][1] * forward[j][owner[j][x][0]] for j in range(k)), default=0.0)
        return fwd[x][k] + held

    for v in verifiers:
        c = v.boundary + 1
        if "act" not in v.directions or c + 1 >= S or v.device not in stages[c + 1].devices:
            continue
        iv = stages[c + 1].devices.index(v.device)
        vids = routes[c + 1][iv]
        if not vids:
            continue
        first = vids[0]
        g0 = arrive(first, c + 1) + fb[c + 1][iv] + down[first][c + 1]
        sent_at = {x: g0 + pos * fb[c + 1][iv] for pos, x in enumerate(vids)}  # V's gradients, one per pass
        grad_bytes = problem.wire_bytes(stages[c].last_block, stages[c].out_codec)
        act_bytes = problem.wire_bytes(stages[c - 1].last_block, stages[c - 1].out_codec)
        check = problem.verify_ms(problem.raw_bytes(stages[c - 1].last_block), problem.class_of(v.device))
        for j, dev in enumerate(stages[c].devices):
            grads = sorted(sent_at[x] for x in routes[c][j] if owner[c + 1][x][0] == iv)
            if dev == v.device or not grads:
                continue
            link = problem.link(v.device, dev)
            verdict = _verdict_behind(link.latency_ms, 1e3 * grad_bytes / link.bytes_per_s, grads, bw[c + 1][iv])
            ids = routes[c][j]
            plain = queued = 0.0
            for x in ids[:limits[c][j]]:
                sender = stages[c - 1].devices[owner[c - 1][x][0]]
                copy = comm.transfer_ms(act_bytes, problem.link(sender, v.device)) if sender != v.device else 0.0
                plain = max(plain, arrive(x, c)) + forward[c][j]
                queued = max(queued, arrive(x, c)) + forward[c][j]
                if v.covers(sender):  # its verdict comes from V, behind V's gradients
                    queued = max(queued, verdict(arrive(x, c) - hop_f[x][c - 1] + copy + check))
            ready = arrive(ids[0], c) + forward[c][j] + down[ids[0]][c]  # its first gradient's return
            delay = max(queued, ready) - max(plain, ready)
            if delay > 0.0:
                out[(c, j)] = max(out.get((c, j), 0.0), delay)
    return out


def _verdict_behind(latency_ms: float, wire_ms: float, grads: list[float], b: float):
    """When a verdict checked at ``checked`` reaches the consumer behind the verifier's gradients (sent at
    ``grads``, each after a ``b`` ms backward during which checks wait, each ``wire_ms`` on the wire): checked
    during a backward or while its gradient is on the wire, after that gradient; otherwise 0 (priced elsewhere)."""

    def arrival(checked: float) -> float:
        return next((g + wire_ms + latency_ms for g in grads if g - b <= checked < g + wire_ms), 0.0)
    return arrival
