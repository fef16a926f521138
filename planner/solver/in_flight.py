"""In-flight limits of stage replicas, and the period a limit below the round trip throttles a replica to.

A replica of a 1F1B stage holds at most ``n`` microbatches between its forward
and its backward: the schedule's least (``planner.schedules.max_in_flight``),
raised as far as its memory allows to ``1 + QUEUEING * D / t``, what covers
the round trip ``D`` downstream of it with room for queueing (``t``: its
forward + backward). Below that it is **throttled**: each of its ``n`` slots
cycles through pass, round trip, pass, so by Little's law

    ``n * period = t + D + W``

with ``D`` the mean round trip of its microbatches and ``W`` the mean wait
they meet downstream behind other microbatches' passes. Its forward reaches
each downstream replica at a random phase of that replica's rhythm: the
replica is busy with other microbatches' backwards a fraction ``rate x b`` of
the time, the rate set by ``period``, and the forward then waits half a
backward; its backward meets their forwards alike. So ``W = c / period``, a
quadratic in ``period``. No queue beyond the pass in progress: the arrivals
are nearly periodic. And no wait at the last stage, which runs each backward
right after its forward: a replica visited once per trip with periodic
arrivals is a D/D/1 queue; the waits come where forwards going down meet
backwards coming back.

llama-7b, fp32, 2048 tokens on 40 consumer GPUs (``benchmarks/mixed_7b.py``):
stage 16, 4 in flight, ran one microbatch per 340 ms in simulation (the first
microbatch of each 4 waited a whole backward at stage 17); priced 299 ms with
no wait, 325 with this. Counting the last stage's passes too gave 345 there
but over-priced random placements with forced windows (up to +28%); a closed
queueing network with deterministic residuals (mean value analysis) gave 394.
"""
from __future__ import annotations

import math

from cost_models import memory
from planner.solver.problem import Problem
from planner.solver.routing import owners
from planner.solver.solution import StagePlacement

# A microbatch's round trip downstream also waits in busy ranks' queues: allow this many times the bare
# trip's worth of microbatches in flight where memory has room.
QUEUEING = 2.0


def memory_cap(problem: Problem, st: StagePlacement, dev: str, vstate: int) -> int:
    """The most microbatches' activations replica ``dev`` of ``st`` can hold beside its static memory."""
    problem = problem.tables(st.recompute)
    act = problem.range_act_bytes(st.first_block, st.last_block)
    static = (problem.range_params(st.first_block, st.last_block) * problem.state_bytes_per_param
              + problem.buffer_bytes(st.first_block, st.last_block) + vstate)
    room = problem.classes[problem.class_of(dev)].mem_bytes - static
    if act <= 0:
        return 1 << 30
    return max(0, room // act)


def interference(stages, fb, bw, k: int, ids) -> float:
    """``c`` (ms^2): microbatches ``ids`` of one replica of stage ``k``, run one per ``period`` ms, wait
    ``c / period`` ms on average downstream behind other microbatches' passes (see the module docstring)."""
    S, M, c = len(stages), sum(stages[0].microbatches), 0.0
    owner = [owners(st.microbatches) for st in stages]
    for x in ids:
        # Not the last stage: it runs each backward right after its forward, one visit, and periodic arrivals
        # at a replica visited once per trip do not wait (D/D/1); the others see forwards and backwards.
        for j in range(k + 1, S - 1):
            i = owner[j][x][0]
            f, b = fb[j][i] - bw[j][i], bw[j][i]
            # Busy with others' backwards (len(ids) / M) * share * b / period of the time, when the forward
            # waits half a backward; the same for the backward behind others' forwards.
            c += stages[j].microbatches[i] / M * (b * b + f * f) / 2
    return c / M


def limit(problem: Problem, stages, k: int, i: int, ids, fb, bw, down, verifier_state: dict[str, int]
          ) -> tuple[int, float]:
    """(in-flight limit, period per microbatch) of replica ``i`` of stage ``k``, running microbatches ``ids``
    (``down[x][k]``: microbatch ``x``'s bare round trip downstream of stage ``k``)."""
    st, t, m = stages[k], fb[k][i], len(ids)
    trip = max(down[x][k] for x in ids)
    least = memory.in_flight_microbatches(problem.schedule, len(stages), k, m)
    need = m if problem.schedule == "gpipe" or t <= 0 else min(m, 1 + math.ceil(QUEUEING * trip / t))
    n = max(least, min(need, memory_cap(problem, st, st.devices[i], verifier_state.get(st.devices[i], 0))))
    if n >= need:
        return n, t
    chain = t + sum(down[x][k] for x in ids) / m  # the slots cycle through all its microbatches' trips
    c = interference(stages, fb, bw, k, ids)
    return n, max(t, (chain + math.sqrt(chain * chain + 4 * n * c)) / (2 * n))  # n P = chain + c / P
