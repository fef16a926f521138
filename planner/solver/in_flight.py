"""In-flight limits of stage replicas, and the period a limit below the round trip throttles a replica to.

A replica of a 1F1B stage holds at most ``n`` microbatches between its forward
and its backward: the schedule's least (``planner.schedules.max_in_flight``),
raised as far as its memory (and the placement's own limit, where it carries
one) allows to ``1 + QUEUEING * D / t``, what covers the round trip ``D``
downstream of it with room for queueing (``t``: its forward + backward).
Below that it is **throttled**: each of its ``n`` slots cycles through pass,
round trip, pass, so by Little's law

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

**Lock step.** A downstream replica busy nearly all of the throttled period
has no idle time to absorb a phase offset: in steady state the arrivals lock
to its rhythm at a fixed offset, and a pass that meets one in progress meets
it every round and waits the whole of it, not half. So a replica at
utilisation ``rho`` at the period charges ``1 + rho ** LOCK_POWER`` times the
random-phase wait, scaled down for a replica that runs few rounds of its
window (the lock forms over the first rounds; the first meets an empty
pipeline). ``W`` is then no longer quadratic but still grows as the period
falls: bisected. Figures: benchmarks/README.md (2026-12-03, night) and
``benchmarks/throttled_windows.py``.
"""
from __future__ import annotations

import math
from collections import Counter

from cost_models import memory
from planner.solver.problem import Problem
from planner.solver.routing import owners
from planner.solver.solution import StagePlacement

# A microbatch's round trip downstream also waits in busy ranks' queues: allow this many times the bare
# trip's worth of microbatches in flight where memory has room.
QUEUEING = 2.0
# A downstream replica at utilisation rho charges 1 + rho ** LOCK_POWER times the random-phase wait: only a
# nearly saturated one locks in step (8 fitted on forced-window random placements; 4 to 12 score alike).
LOCK_POWER = 8
# The lock is full after this many rounds of the window (the first meets an empty pipeline downstream).
LOCK_ROUNDS = 2
# Halvings of the bracket of the throttled period (at most 0.4 of it wide): 2**-12 of it is below 0.01%.
BISECTIONS = 12


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


def _terms(stages, fb, bw, k: int, ids) -> list[tuple[float, float]]:
    """Per downstream replica that microbatches ``ids`` of one replica of stage ``k`` visit: (``a``, its busy
    ms per step). At random phases they wait ``sum(a) / period`` ms on average (see the module docstring)."""
    S, M = len(stages), sum(stages[0].microbatches)
    out = []
    # Not the last stage: it runs each backward right after its forward, one visit, and periodic arrivals at a
    # replica visited once per trip do not wait (D/D/1); the others see forwards and backwards.
    for j in range(k + 1, S - 1):
        owner, shares = owners(stages[j].microbatches), stages[j].microbatches
        for i, visits in Counter(owner[x][0] for x in ids).items():
            f, b = fb[j][i] - bw[j][i], bw[j][i]
            # Busy with others' backwards (len(ids) / M) * share * b / period of the time, when the forward
            # waits half a backward; the same for the backward behind others' forwards.
            out.append((visits * shares[i] / M * (b * b + f * f) / 2 / M, shares[i] * fb[j][i]))
    return out


def _lock(m: int, n: int) -> float:
    """How far the lock has formed for a replica running ``m`` microbatches, ``n`` in flight (0 to 1)."""
    # The lock forms over the first rounds of the window: a replica running few rounds keeps random phases.
    return max(0.0, 1 - LOCK_ROUNDS * n / m)


def interference(terms, m: int, n: int, period: float) -> float:
    """``c`` (ms^2): a replica running ``m`` microbatches, ``n`` in flight, one per ``period`` ms, waits
    ``c / period`` ms per round trip behind other microbatches' passes downstream (``terms``: ``_terms``)."""
    lock = _lock(m, n)
    return sum(a * (1 + lock * min(1.0, busy / (m * period)) ** LOCK_POWER) for a, busy in terms)


def limit(problem: Problem, stages, k: int, i: int, ids, fb, bw, down, verifier_state: dict[str, int]
          ) -> tuple[int, float]:
    """(in-flight limit, period per microbatch) of replica ``i`` of stage ``k``, running microbatches ``ids``
    (``down[x][k]``: microbatch ``x``'s bare round trip downstream of stage ``k``)."""
    st, t, m = stages[k], fb[k][i], len(ids)
    trip = max(down[x][k] for x in ids)
    least = memory.in_flight_microbatches(problem.schedule, len(stages), k, m)
    need = m if problem.schedule == "gpipe" or t <= 0 else min(m, 1 + math.ceil(QUEUEING * trip / t))
    cap = memory_cap(problem, st, st.devices[i], verifier_state.get(st.devices[i], 0))
    if st.in_flight:  # a placement that carries its limits (a plan's) runs with them at most
        cap = min(cap, st.in_flight[i])
    n = max(least, min(need, cap))
    if n >= need:
        return n, t
    chain = t + sum(down[x][k] for x in ids) / m  # the slots cycle through all its microbatches' trips
    terms = _terms(stages, fb, bw, k, ids)
    if n * t >= chain + interference(terms, m, n, t) / t:  # its slots cover the trips and their waits
        return n, t
    plain, lock = sum(a for a, _ in terms), _lock(m, n)
    # n P = chain + c(P) / P rises with P, and c lies between the random-phase wait and 1 + lock times it: bisect.
    lo, hi = (max(t, (chain + math.sqrt(chain * chain + 4 * n * c)) / (2 * n)) for c in (plain, (1 + lock) * plain))
    for _ in range(BISECTIONS if lock > 0 else 0):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if n * mid < chain + interference(terms, m, n, mid) / mid else (lo, mid)
    return n, hi
