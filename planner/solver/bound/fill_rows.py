"""A fill test's per-stage tables, none of which depend on ``B`` (``_Rows``), the microbatches one device of a
stage runs within its budget (``_per``) and the lines of rings that cross islands (``_mixed_lines``,
``_island_lines``); ``bound.fill``'s docstring states the bound, and these terms of it are proved here.

**The round trip after a stage.** A replica's passes start no sooner than its first input (``A``), and a
microbatch's backward there needs its forward there and then its round trip after the stage: every block after
it forward and back (at least ``U(L) - U(i)``) and, where a stage follows, a crossing each way (``hops(1)`` each:
a route's devices are distinct). One device runs one pass at a time, so with ``m`` microbatches, forward ``f`` and
backward ``b`` (its group's least) and that round trip ``D``, its last backward ends no sooner than ``A + m f + D +
b`` (the last forward to end, then its round trip and backward) nor ``A + f + D + m b`` (no backward before the
first forward's round trip), as well as ``A + m t``: each replica's count is also at most what these fit in the
budget ``m t`` had (``_per``), whatever follows it. Binds where ``D`` outweighs ``(m - 1)`` forwards: few
microbatches a replica, a long or slow chain after it (random wide-area pools: up to +30%).
**Rings of both groups.** Where some partition of the pool into islands (``islands.partitions``) has each island
holding one group's classes only (A100 hosts and V100 hosts), a stage with devices of both groups has two
replicas in different islands, so its ring uses a link between islands: its all-reduce is at least ``Rings``'
line for the fastest and quickest such link (``_mixed_lines``), where the DP knows it holds both (``y`` of group
``a`` and at least one of ``b``: the fixed point's count, an exact count, stage 0's ``r - y``); else the ring's
floor as before (Sailor-like: 646.9 -> 661.3 ms).
**Rings no island holds.** At any partition into islands, a stage of ``y`` devices of group ``a`` and ``w`` of
``b`` that no island holds together (``islands.spans``: more A100s than a host of four; more V100s than a zone has
beside its A100s) has replicas in two islands, so its ring uses a link between them: its all-reduce is at least
that link's line (``_island_lines``), read at the same counts as the mixed rings (the fixed point's, an exact
count, stage 0's ``r - y``; both lines rise with ``y`` and ``w``, so a count no more than the plan's gives a
floor no more than its). Sailor-like: 661.3 -> 678.4 ms (a stage of eight A100s no longer rings at NVLink speed).
**In flight.** A device holds at most the microbatches its memory has room for in flight (``_per``: the
compiler places a forward only below that), so its first backward waits ``f + trip`` with ``n`` forwards at most
run, and its last forward leaves ``n`` backwards at most: ``f + trip + m b + (m - n) f`` and ``m f + (m - n) b +
trip + b`` fit its budget too. A recomputing problem's stage may hold every activation at the plain times or only
its blocks' inputs at the recomputing ones: each device's count is the better of the two.
**Slot cycles.** Each microbatch holds its slot from its forward's start to its backward's end, at least ``f + trip
+ b``, and all of it within the budget: ``n`` slots cycle at most ``floor(budget / (f + trip + b))`` times each
(``_per``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from planner.solver.bound.fill_groups import _Group
from planner.solver.bound.islands import COMPRESSED_ALLREDUCE, partitions, spans
from planner.solver.bound.replicas import Rings
from planner.solver.problem import Problem

# A device's passes within the round trip after its stage (``_per``); off: the bound without that term (tests).
ROUND_TRIP = True
# A device holds at most the microbatches its memory has room for in flight (``_per``); off: no such cap (tests).
IN_FLIGHT = True
# Each of those slots cycles through a forward, the round trip and a backward (``_per``); off: not counted (tests).
SLOT_CYCLES = True


class _TestView(Protocol):
    """What ``_Rows.of`` reads of a test (``fill_dp._Test`` is one): its sizes, groups, per-block prefix sums, path
    tables per stage start and state, rings and ring lines, and its end stages' device caps."""

    L: int
    track: str
    ends: bool
    a: _Group
    b: _Group
    need: np.ndarray
    state: np.ndarray
    act: np.ndarray
    act_full: np.ndarray
    params: np.ndarray
    U: np.ndarray
    F: np.ndarray
    hop: float
    extra: np.ndarray
    extra_last: np.ndarray
    arrive: np.ndarray
    arrive_last: np.ndarray
    optim: list[np.ndarray]
    ring: Rings
    middle_ring: Rings
    mixed: tuple[np.ndarray, np.ndarray]
    islands: tuple

    def _end_cap(self, g: _Group, js: np.ndarray, i: np.ndarray) -> np.ndarray: ...


def _mixed_lines(problem: Problem, stage: list[int], a: _Group, b: _Group, R: int) -> tuple[np.ndarray, np.ndarray]:
    """Per ring size ``r < R``, the all-reduce of a stage holding devices of both groups, as lines ``alpha_r P +
    beta_r`` (``(R, lines)``; ``-inf``: no line): at a partition into islands each of one group's classes only,
    two of its replicas sit in different islands, so its ring uses a link between islands, no faster than their
    fastest nor quicker than their quickest (``Rings``' line for that link)."""
    own = [set(a.classes), set(b.classes)]
    links = [] if problem.compress in COMPRESSED_ALLREDUCE or not a.classes or not b.classes else \
        [isl.between for _, isl in partitions(problem, stage)
         if all(any(set(I) <= g for g in own) for I in isl.members)]
    alpha, beta = np.zeros((R, max(len(links), 1))), np.full((R, max(len(links), 1)), -np.inf)
    for i, lk in enumerate(links):
        for r in range(2, R):
            alpha[r, i], beta[r, i] = 2 * (r - 1) / r * 1e3 / lk.bytes_per_s, 2 * (r - 1) * lk.latency_ms
    return alpha, beta


def _island_lines(problem: Problem, stage: list[int], a: _Group, b: _Group, R: int
                  ) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]:
    """Per partition into islands (``islands.spans``): which stages of ``y`` devices of group ``a`` and ``w`` of
    ``b`` no island holds whole (``(a.count + 1, b.count + 1)``), and per ring size ``r < R`` the line ``alpha_r P +
    beta_r`` of its link between islands (``Rings``' for that link): such a stage has replicas in two islands, so
    its ring uses a link between them, no faster than their fastest nor quicker than their quickest (Sailor-like:
    eight A100s on a stage span two hosts of four, a stage of the zone of four A100s and more of their V100s than
    it has spans the zones). Where every island holds one group only, a stage of both is ``_mixed_lines``'."""
    if problem.compress in COMPRESSED_ALLREDUCE:
        return ()
    own = [set(a.classes), set(b.classes)]
    out = []
    for span, isl in spans(problem, stage, own[0], own[1], a.count + 1, b.count + 1):
        if all(any(set(I) <= g for g in own) for I in isl.members):
            span = span.copy()
            span[1:, 1:] = False  # both groups: the mixed rings' line
        if not span.any():
            continue
        r = np.arange(R)
        lk = isl.between
        alpha = np.where(r >= 2, 2 * (r - 1) / np.maximum(r, 1) * 1e3 / lk.bytes_per_s, 0.0)
        beta = np.where(r >= 2, 2 * (r - 1) * lk.latency_ms, 0.0)
        out.append((span, alpha, beta))
    return tuple(out)


def _per(t: np.ndarray, pos: np.ndarray, fits: np.ndarray, slack: np.ndarray, M: int, f: np.ndarray,
         b: np.ndarray, trip: np.ndarray, slots: np.ndarray | None = None) -> np.ndarray:
    """Microbatches one device runs of a stage of pass ``t`` (``pos``: ``t > 0``; else 1) within ``slack`` (0: none
    fit it, or its blocks do not fit the device: ``fits``): ``m t``, and with its forward ``f``, backward ``b`` and
    the round trip after it ``trip`` (``_Rows``), ``m f + trip + b`` and ``f + trip + m b``, all within ``slack``.

    **In flight.** With room for ``n`` microbatches' activations (``slots``), a device holds at most ``n`` in flight
    (``in_flight.limit``: ``max(least, min(need, cap))``, and a valid plan fits the schedule's least, so at most the
    memory's cap). The compiler places a forward only while fewer than ``n`` are in flight (from its forward's
    start to its backward's), and the device runs its program in that order: before its first backward starts,
    no sooner than ``f + trip`` after its first input, it ran ``n`` forwards at most, and all ``m`` backwards and
    the other ``m - n`` forwards follow; when its last forward starts, ``n`` backwards at most are still to run,
    and ``trip + b`` follow that forward's end. So ``f + trip + m b + (m - n) f`` and ``m f + (m - n) b + trip +
    b`` fit ``slack`` too where ``m > n`` (SWARM-like: a T4 holding the embedding and six layers has room for 18 of
    its 32 microbatches, and its first gradient comes back over four volunteers' links each way).

    **Slot cycles.** A microbatch holds its slot from its forward's start to its backward's end: its forward, then
    its round trip, then its backward, at least ``c = f + trip + b``, all within ``slack`` (the device's passes
    run there). At most ``n`` such intervals overlap at any time, so they split into ``n`` chains of disjoint ones
    (interval graphs are perfect: as many colours as the largest overlap), each of at most ``floor(slack / c)``:
    ``m <= n floor(slack / c)``. Stronger than the two above where the round trip outweighs the passes (SWARM-like
    at 8 microbatches of 4 samples: 12,879 -> 13,317 ms)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        per = np.where(pos, np.floor(slack / t), M)
        per = np.where(f > 0, np.minimum(per, np.floor((slack - trip - b) / f)), per)
        per = np.where(b > 0, np.minimum(per, np.floor((slack - trip - f) / b)), per)
        if slots is not None:
            fb = np.where(f + b > 0, f + b, 1.0)
            held = np.minimum(np.floor((slack - f - trip + slots * f) / fb), np.floor((slack - trip - b + slots * b) / fb))
            per = np.where((f + b > 0) & np.isfinite(slots), np.minimum(per, np.maximum(slots, held)), per)
            cycle = f + trip + b
            if SLOT_CYCLES:
                cycles = slots * np.floor(slack / np.where(cycle > 0, cycle, 1.0))
                per = np.where((cycle > 0) & np.isfinite(slots), np.minimum(per, cycles), per)
    return np.where(fits & (slack >= 0), np.clip(per, 0, M), 0)


@dataclass(frozen=True, slots=True, eq=False)
class _Rows:
    """A test's per-stage tables, none of which depend on ``B``: one row per stage ``j..i-1`` (``j >= 1``) and
    state ``z`` a DP can be in at ``j`` (``z <= j``; at least 1 where it counts stages), and per stage (``pair``:
    ``i (i - 1) / 2 + j``) its all-reduce floor per ring size (``r`` past the largest ring at the largest's)."""

    pair: np.ndarray
    cell: np.ndarray   # the row's (pair, z) in the test's output, flattened
    U: np.ndarray
    extra: np.ndarray
    F: np.ndarray
    arrive: np.ndarray
    t_a: np.ndarray    # pass times (1 where none: ``pos_*`` false)
    pos_a: np.ndarray
    fits_a: np.ndarray
    t_b: np.ndarray
    pos_b: np.ndarray
    fits_b: np.ndarray
    cap_a: np.ndarray
    cap_b: np.ndarray
    opt_a: np.ndarray
    opt_b: np.ndarray
    f_a: np.ndarray    # the stage's least forward and backward per group (``_per``; 0 where none)
    b_a: np.ndarray
    f_b: np.ndarray
    b_b: np.ndarray
    slots_a: np.ndarray  # microbatches in flight a device of the group has room for (``_per``; inf: no cap)
    slots_b: np.ndarray
    slots_ra: np.ndarray  # the same recomputing (activations: each block's input; ``_Test.mixed_recompute``)
    slots_rb: np.ndarray
    trip: np.ndarray   # the least round trip after the stage (``_per``): its blocks after, and a crossing each way
    inner: int         # rows of stages after stage 0 (the first ``inner``; then stage 0's, per i)
    floors: np.ndarray  # (pairs, r = 0..top)
    mixed_floors: np.ndarray  # the same where the stage holds devices of both groups (``_mixed_lines``)
    top: int
    firsts: np.ndarray  # the pairs of stage 0 (j = 0), per i = 1..L
    first_rows: np.ndarray  # their rows among these (appended after the others, z = 0)
    nbytes: np.ndarray  # per stage, its gradient bytes
    islands: tuple  # ``_island_lines``: per partition, the counts no island holds whole and its line

    @staticmethod
    def of(test: _TestView) -> _Rows:
        L = test.L
        i = np.repeat(np.arange(1, L + 1), np.arange(1, L + 1))
        j = np.arange(len(i)) - i * (i - 1) // 2
        pair = np.arange(len(i))
        z0 = 1 if test.track == "stages" else 0  # counting stages, a stage after stage 0 has one before it
        states = j[j > 0] + 1 - z0
        inner = np.repeat(pair[j > 0], states)
        z = z0 + np.arange(len(inner)) - np.repeat(np.cumsum(states) - states, states)
        firsts = pair[j == 0]
        rp = np.concatenate([inner, firsts])  # every row's pair: the inner stages', then stage 0's
        rz = np.concatenate([z, np.zeros(len(firsts), dtype=int)])
        ri, rj = i[rp], j[rp]
        end = ((rj == 0) | (ri == L)) if test.ends else np.zeros(len(rp), dtype=bool)

        def group(g: _Group) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
            t = g.prefix[ri] - g.prefix[rj]
            cap = np.where(end, test._end_cap(g, rj, ri), g.count)
            return np.where(t > 0, t, 1.0), t > 0, test.need[ri] - test.need[rj] <= g.mem, cap

        t_a, pos_a, fits_a, cap_a = group(test.a)
        t_b, pos_b, fits_b, cap_b = group(test.b)

        def slots(g: _Group, acts: np.ndarray) -> np.ndarray:
            """Microbatches in flight a device of ``g`` has room for beside the stage's state (``in_flight.memory_cap``
            no more: its buffers and verifier state aside, the group's largest memory), of ``acts`` (prefix sums)."""
            act = acts[ri] - acts[rj]
            room = g.mem - (test.state[ri] - test.state[rj])
            with np.errstate(divide="ignore", invalid="ignore"):
                n = np.where(act > 0, np.floor(room / np.where(act > 0, act, 1.0)), np.inf)
            return n if IN_FLIGHT else np.full(len(rp), np.inf)

        def passes(g: _Group) -> tuple[np.ndarray, np.ndarray]:
            if g.fwd is None or not g.count:
                return np.zeros(len(rp)), np.zeros(len(rp))
            return g.fwd[ri] - g.fwd[rj], g.bwd[ri] - g.bwd[rj]

        (f_a, b_a), (f_b, b_b) = passes(test.a), passes(test.b)
        trip = test.U[L] - test.U[ri] + np.where(ri < L, 2 * test.hop, 0.0) if ROUND_TRIP else np.zeros(len(rp))
        top = len(test.ring.none) - 1
        sizes = np.arange(top + 1)
        pend = ((j == 0) | (i == L)) if test.ends else np.zeros(len(pair), dtype=bool)
        params = test.params[i] - test.params[j]
        floors = np.empty((len(pair), top + 1))
        for ring, rows in ((test.ring, pend), (test.middle_ring, ~pend)):
            n = int(rows.sum())
            floors[rows] = ring.floor(np.repeat(params[rows], top + 1), np.tile(sizes, n)).reshape(n, top + 1)
        alpha, beta = test.mixed

        def mixed(nbytes: np.ndarray, r: np.ndarray) -> np.ndarray:
            lines = (alpha[r] * nbytes[:, None] + beta[r]).max(axis=1)
            return np.where((r >= 2) & (nbytes > 0), lines, 0.0)

        mixed_floors = np.maximum(floors, mixed(np.repeat(params, top + 1), np.tile(sizes, len(pair))).reshape(
            len(pair), top + 1))
        last = ri == L
        extra = np.where(last, test.extra_last[rj, rz], test.extra[rj, rz])
        arrive = np.where(last, np.broadcast_to(test.arrive_last, (L + 1, L + 1))[rj, rz],
                          np.broadcast_to(test.arrive, (L + 1, L + 1))[rj, rz])
        return _Rows(pair=rp, cell=rp * (L + 1) + rz, U=test.U[rj], extra=extra, F=test.F[rj],
                     arrive=arrive, t_a=t_a, pos_a=pos_a,
                     fits_a=fits_a, t_b=t_b, pos_b=pos_b, fits_b=fits_b, cap_a=cap_a, cap_b=cap_b, opt_a=test.optim[0][rj, ri],
                     opt_b=test.optim[1][rj, ri], f_a=f_a, b_a=b_a, f_b=f_b, b_b=b_b,
                     slots_a=slots(test.a, test.act_full), slots_b=slots(test.b, test.act_full),
                     slots_ra=slots(test.a, test.act), slots_rb=slots(test.b, test.act), trip=trip, inner=len(inner), floors=floors, mixed_floors=mixed_floors, top=top, firsts=firsts,
                     first_rows=np.arange(len(inner), len(rp)), nbytes=params,
                     islands=test.islands)

    def floor(self, pair: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
        """The all-reduce floor of stage ``pair`` (index arrays, broadcast) on ``y`` devices of group ``a`` and ``w``
        of ``b``, a ring of ``y + w`` (past the largest ring, at the largest's: the floors rise with it): ``Rings``',
        the mixed rings' where it holds both groups (``_mixed_lines``), and the line of a partition's link between
        islands where no island of it holds the stage whole (``_island_lines``)."""
        r = np.minimum(y + w, self.top)
        out = np.where((y >= 1) & (w >= 1), self.mixed_floors[pair, r], self.floors[pair, r])
        nbytes = self.nbytes[pair]
        for span, alpha, beta in self.islands:
            cross = span[np.minimum(y, span.shape[0] - 1), np.minimum(w, span.shape[1] - 1)] & (r >= 2) & (nbytes > 0)
            out = np.where(cross, np.maximum(out, alpha[r] * nbytes + beta[r]), out)
        return out
