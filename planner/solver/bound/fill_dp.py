"""The fill bound's feasibility test (``_Test``): whether a step of ``B`` admits a partition, and the least ``B``
it cannot rule out (bisected); ``bound.fill``'s docstring states the bound.

**Stage 0's round trip.** In a plan of ``S`` stages stage 0's first gradient comes back over every crossing of the
route, at least ``last(S - 1)`` each way (``hops_ms`` ``to_last``), not one: where the DP (counting stages) lets a
plan of ``S`` stages through, it runs again with stage 0's rows at that round trip and only those plans ending
(``_Test.feasible``; each such run charged ``RERUN_COST`` of a test). SWARM-like: a T4 holding the embedding and six layers has
room for 18 of its 32 microbatches and its gradients cross four volunteers' links each way: 7,622.3 -> 7,688.2 ms.
**Routes before the last stage.** Where the ends must be trusted and every island holding a trusted stage device
holds two or more, a route's devices before the last stage's make one crossing inside an island fewer than
``hops`` allows (``replicas.spare``): the last stage's device is trusted, so its island has at most one device
less on the route before it. A stage before the last pays these ``before`` hops on its path; the last, ``last``:
where one island ``H`` holds every trusted stage device, a route of more than ``|H|`` stages starts and ends in
``H`` and leaves it, one crossing fewer inside (``hops_ms`` ``to_last``).
"""
from __future__ import annotations

import numpy as np

from planner.solver.bound import fill_rows
from planner.solver.bound.fill_groups import _Group, _Shared
from planner.solver.bound.fill_linked import LINKED, _LinkedDP
from planner.solver.bound.fill_rows import _island_lines, _mixed_lines, _per, _Rows
from planner.solver.problem import Problem

# Relative width the bisection stops at (the bound is its infeasible end: valid whatever the width).
REL_TOL = 1e-5
# Rounds of raising a stage's devices by its all-reduce at the ring size they make (each round's count is valid).
ROUNDS = 8
# Rings no island holds whole pay a link between islands (``_island_lines``); off: the bound without them (tests).
ISLANDS = True
# Stage 0's round trip crosses to the last stage and back (``_Test.feasible``, per count of stages); off: one crossing
# each way, as every other stage's (tests).
STAGE0_TRIP = True


class _Test(_LinkedDP):
    """Whether a step of ``B`` admits a partition (module docstring). The DP's state: blocks covered, devices of
    group ``a`` (``tracked``) used, and ``z``: the stages so far (``track="stages"``: the path before a
    stage pays ``2 hops(z)``) or the blocks so far on stages of group ``b`` alone (``track="slow"``: their passes
    on the path are ``b``'s, at least the ``z`` least excesses over the least pass of the blocks before).

    What a test reads of each stage ``j..i-1`` and state ``z`` that no ``B`` changes (its groups' pass times and
    memory fit, device caps, optimizer steps, all-reduce floors per ring size) is tabled once (``_Rows``); a
    test is then a few vector operations over every (stage, state, count) at once, and the DP over the blocks."""

    def __init__(self, problem: Problem, stage: list[int], fast: _Group, slow: _Group, track: str,
                 shared: _Shared | None = None, *, linked: bool = True, full_act: np.ndarray | None = None) -> None:
        """``full_act``: where ``problem`` is a recomputing problem's relaxation (``bound_problem``), the activations
        a stage without recomputation holds (its stages may be either: ``_nb`` takes the better)."""
        L, M = problem.num_blocks, problem.num_microbatches
        self.L, self.M, self.track = L, M, track
        self.tests = 0   # feasibility tests run (their work charged to the plan's budget)
        self.linked = 0  # of them, with replica states (``_feasible_linked``: charged ``LINKED_COST`` plain ones)
        self.reruns = 0  # DPs run again per stage count (stage 0's round trip: charged ``RERUN_COST`` of a test)
        self.a, self.b = self.tracked(fast, slow, track)
        pol = problem.policy
        self.ends = pol.enabled and pol.trusted_endpoints
        need = problem.param_count.astype(float) * problem.state_bytes_per_param + problem.act_bytes
        self.need = np.concatenate([[0.0], np.cumsum(need)])
        # a stage's state and one microbatch's activations, apart (``_Rows.slots``)
        self.state = np.concatenate([[0.0], np.cumsum(problem.param_count.astype(float) * problem.state_bytes_per_param)])
        self.act = np.concatenate([[0.0], np.cumsum(problem.act_bytes.astype(float))])
        self.mixed_recompute = full_act is not None
        self.act_full = self.act if full_act is None else np.concatenate([[0.0], np.cumsum(full_act.astype(float))])
        self.params = np.concatenate([[0.0], np.cumsum(problem.param_count.astype(float))]) \
            * problem.grad_bytes_per_param
        least = np.minimum(fast.path, slow.path)
        self.U = np.concatenate([[0.0], np.cumsum(least)])
        # Stage 0's optimizer step follows the pipeline (``step >= pipe + optim_0``): blocks 0..i-1 for stage 0
        # itself, the least of any stage 0 for the others.
        shared = _Shared.of(problem, stage) if shared is None else shared
        self.opt0 = np.min([shared.optim[c][0] for c in stage], axis=0)
        self.opt_any = float(self.opt0[1:].min())
        # A stage before the last crosses only boundaries among the devices before the last stage's
        # (``shared.before``); the last stage's path, from stage 0 to it (``shared.last``).
        j = np.arange(L + 1)[:, None]
        if track == "stages":
            self.extra, self.extra_last = (np.where(j > 0, 2 * h[None, :L + 1], 0.0)
                                           for h in (shared.before, shared.last))
        else:  # the z least excesses of the slow group's passes among blocks 0..j-1
            excess = np.full((L + 1, L + 1), np.inf)
            for e in range(L + 1):
                excess[e, :e + 1] = np.concatenate([[0.0], np.cumsum(np.sort(slow.path[:e] - least[:e]))])
            self.extra, self.extra_last = (excess + np.where(j > 0, 2 * h[1], 0.0) for h in (shared.before, shared.last))
        self.ring, self.middle_ring = shared.ring, shared.middle_ring
        # A stage's all-reduce and optimizer step follow its own passes, which start once its first microbatch's
        # forward is in: blocks 0..j-1 forward at their least and the hops before it, one way.
        bwd = problem.time_ms * (2.0 / 3.0) if problem.bwd_ms is None else problem.bwd_ms
        self.F = np.concatenate([[0.0], np.cumsum((problem.time_ms - bwd)[:, stage].min(axis=1))])
        self.Bw = np.concatenate([[0.0], np.cumsum(bwd[:, stage].min(axis=1))])
        self.before, self.hop = shared.before, float(shared.hops[1]) if L >= 1 else 0.0
        self.last = shared.last
        self.arrive, self.arrive_last = (np.where(j > 0, h[None, :L + 1] if track == "stages" else h[1], 0.0)
                                         for h in (shared.before, shared.last))
        # Two single-device stages in a row (``_feasible_linked``): every activation on one link (``route``).
        self.route = shared.route if linked and track == "stages" and L > 2 else None
        self.rest = None if self.route is None else self.U[L] + np.concatenate([[np.inf], shared.before[:L]]) \
            + np.concatenate([shared.last[1:], [np.inf]]) + shared.hops[1] + self.route[1] + self.opt_any
        self.optim = [np.min([shared.optim[c] for c in g.classes], axis=0) if g.classes
                      else np.zeros((L + 1, L + 1)) for g in (self.a, self.b)]
        self.mixed = _mixed_lines(problem, stage, self.a, self.b, len(shared.ring.none))
        self.islands = _island_lines(problem, stage, self.a, self.b, len(shared.ring.none)) if ISLANDS else ()
        self.rows = _Rows.of(self)
        self._pair_i = np.repeat(np.arange(1, L + 1), np.arange(1, L + 1))  # each stage's end
        self._ar_rest = self._after_link() if self.route is not None else None

    @staticmethod
    def tracked(fast: _Group, slow: _Group, track: str) -> tuple[_Group, _Group]:
        """(group ``a``, whose devices the DP counts, group ``b``): ``a`` the fast one where the slow path is
        tracked (a stage of ``b`` alone is one without ``a``'s devices), else the smaller (none for one kind)."""
        if not slow.count:
            return _Group(np.zeros_like(fast.prefix), np.full(len(fast.path), np.inf), 0.0, 0, 0), fast
        return (fast, slow) if track == "slow" or fast.count <= slow.count else (slow, fast)

    def least_ms(self, floor_ms: float, cap_ms: float | None = None, rel_tol: float = REL_TOL) -> float:
        """The least ``B`` this test cannot rule out, less a hair (``floor_ms`` where it rules out none above); with
        ``cap_ms`` above ``floor_ms``, no more than it, less a hair: the cap tried first (where it is ruled out, so
        is every ``B`` below it), then the floor, then the bracket between them halved."""
        lo = floor_ms
        if cap_ms is not None and cap_ms > floor_ms:
            if not self.feasible(cap_ms):
                return cap_ms * (1 - 1e-9)
            if self.feasible(lo):
                return floor_ms
            hi = cap_ms
        else:
            if self.feasible(lo):
                return floor_ms
            hi = max(2 * lo, float(self.U[-1]) + 1.0)
            while not self.feasible(hi):
                if hi > 1e12:
                    return floor_ms
                lo, hi = hi, 2 * hi
        while hi - lo > rel_tol * hi:
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if self.feasible(mid) else (mid, hi)
        return lo * (1 - 1e-9)

    def feasible(self, B: float) -> bool:
        """Whether some partition meets ``B`` with the pool's devices: blocks in order, per state the fewest
        devices of group ``b``."""
        self.tests += 1
        linked = self.route is not None and np.any(self.M * self.route[0] + self.rest[1:self.L] > B)
        if linked:
            self.linked += 1  # a link may bind: the DP with replica states
            nb = self._linked_rows(B)
            ends = self._run_linked(nb)
        else:
            fewest = self._fewest(B)  # (stages, Z, NA + 1), stage j..i-1 at i (i - 1) / 2 + j
            ends = self._run(fewest)
        ok = ends <= self.b.count  # (..., Z): per count of stages (or slow blocks) at the end
        if self.track != "stages" or not STAGE0_TRIP or not fill_rows.ROUND_TRIP or not ok.any():
            return bool(ok.any())
        # An S-stage plan's stage 0 waits its first gradient's round trip over S - 1 crossings each way: the DP again
        # with stage 0's rows at that trip, its plans of S stages (each count the first DP let through, fewest first)
        for S in np.flatnonzero(ok.reshape(-1, ok.shape[-1]).any(axis=0)):
            if S < 2:
                return True  # one stage: no round trip
            self.reruns += 1
            first = self._first(B, int(S))
            if linked:
                self._put_first(nb, self._first_by_r)
                if (self._run_linked(nb)[..., S] <= self.b.count).any():
                    return True
            else:
                fewest[self.rows.firsts, 0] = first
                if (self._run(fewest)[..., S] <= self.b.count).any():
                    return True
        return False

    def _run(self, fewest: np.ndarray) -> np.ndarray:
        """The DP of ``feasible`` over the stages' fewest devices of group ``b`` (``_fewest``): per count ``x`` of
        group ``a``'s devices and end state, the fewest of ``b``'s covering every block."""
        L, NA, Z = self.L, self.a.count, self.L + 1
        best = np.full((L + 1, NA + 1, Z), np.inf)
        best[0, 0, 0] = 0.0
        reached = np.zeros(L + 1, dtype=bool)
        reached[0] = True
        alone = self.track == "slow" and self.b.count > 0  # y = 0: a stage of group b alone
        for i in range(1, L + 1):
            js = np.flatnonzero(reached[:i])
            if not len(js):
                continue
            nb = fewest[i * (i - 1) // 2 + js, :i]  # (J, z, NA + 1): states z <= j < i, the others unreached
            came = best[js, :, :i]
            every = (came[:, :, :, None] + nb[:, None, :, :]).min(axis=0)  # (x, z, y): to x + y
            for y in range(1 if alone else 0, NA + 1):
                if self.track == "stages":
                    np.minimum(best[i, y:, 1:i + 1], every[:NA + 1 - y, :, y], out=best[i, y:, 1:i + 1])
                else:
                    np.minimum(best[i, y:, :i], every[:NA + 1 - y, :, y], out=best[i, y:, :i])
            if alone:  # its blocks join the slow path: state z to z + i - j
                cand = came + nb[:, None, :, 0]
                z = np.arange(Z)[None, :] - (i - js)[:, None]
                padded = np.concatenate([cand, np.full(cand.shape[:2] + (1,), np.inf)], axis=2)
                at = np.broadcast_to(np.where((z >= 0) & (z < i), z, i)[:, None, :], cand.shape[:2] + (Z,))
                np.minimum(best[i], np.take_along_axis(padded, at, axis=2).min(axis=0), out=best[i])
            reached[i] = np.isfinite(best[i]).any()
        return best[L]

    def _fewest(self, B: float) -> np.ndarray:
        """Per stage ``j..i-1``, state ``z`` and count ``y`` of group ``a``'s devices on it, the fewest of group
        ``b``'s devices that run its ``M`` microbatches within ``B`` (inf: none will do; states no DP reaches:
        inf)."""
        rows, Y, n = self.rows, self.a.count + 1, self.rows.inner
        slack = B - rows.U[:n] - rows.extra[:n] - self.opt_any
        y = np.arange(Y)[None, :]
        nb = self._after_passes(B, slack, self._nb(np.arange(n), slack, slack, y))
        w = np.where(np.isfinite(nb), nb, 0).astype(int)
        nb = np.where(rows.floor(rows.pair[:n, None], y, w) <= B, nb, np.inf)  # r = 0, 1: no all-reduce (0)
        out = np.full((self.L * (self.L + 1) // 2 * (self.L + 1), Y), np.inf)
        out[rows.cell[:n]] = nb
        out = out.reshape(-1, self.L + 1, Y)
        out[rows.firsts, 0] = self._first(B)
        return out

    def _nb(self, at: np.ndarray, slack_a: np.ndarray, slack_b: np.ndarray, y: np.ndarray,
            trip: np.ndarray | None = None) -> np.ndarray:
        """Per row of ``rows`` (``at``; their slacks per group, one per row or per row and count ``y``), the fewest
        of group ``b``'s devices whose passes fit (the all-reduce aside; inf: none will do); ``trip``: the round
        trip after each (default the rows')."""
        rows, M = self.rows, self.M
        trip = rows.trip[at] if trip is None else trip
        per_a = _per(rows.t_a[at], rows.pos_a[at], rows.fits_a[at], slack_a, M, rows.f_a[at], rows.b_a[at], trip,
                     rows.slots_a[at])
        pb = _per(rows.t_b[at], rows.pos_b[at], rows.fits_b[at], slack_b, M, rows.f_b[at], rows.b_b[at], trip,
                  rows.slots_b[at])
        if self.mixed_recompute:  # or the stage recomputes: each backward runs its forward again, activations apart
            per_a = np.maximum(per_a, _per(rows.t_a[at] + rows.f_a[at], rows.pos_a[at], rows.fits_a[at], slack_a, M,
                                           rows.f_a[at], rows.b_a[at] + rows.f_a[at], trip, rows.slots_ra[at]))
            pb = np.maximum(pb, _per(rows.t_b[at] + rows.f_b[at], rows.pos_b[at], rows.fits_b[at], slack_b, M,
                                     rows.f_b[at], rows.b_b[at] + rows.f_b[at], trip, rows.slots_rb[at]))
        if per_a.ndim < y.ndim:
            per_a, pb = per_a[..., None], pb[..., None]
        short = np.maximum(M - y * per_a, 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            nb = np.where(short == 0, 0.0, np.where(pb > 0, np.ceil(short / np.maximum(pb, 1)), np.inf))
        cap_a, cap_b = rows.cap_a[at], rows.cap_b[at]
        if cap_a.ndim < nb.ndim:
            cap_a, cap_b = cap_a[..., None], cap_b[..., None]
        return np.where((y <= cap_a) & (nb <= cap_b), nb, np.inf)

    def _end_cap(self, g: _Group, js: np.ndarray, i: np.ndarray) -> np.ndarray:
        """Devices of ``g`` an end stage may hold: its trusted ones, less one where the other end is another stage
        and only ``g`` has trusted devices (that end holds one of them)."""
        other = self.b if g is self.a else self.a
        return np.where((js == 0) & (i == self.L), g.trusted, g.trusted - (other.trusted == 0 and g.trusted > 0))

    def _first(self, B: float, stages: int | None = None) -> np.ndarray:
        """Stage 0 over blocks ``0..i-1`` (per ``i``): per count ``y`` of group ``a``'s devices, the fewest of group
        ``b``'s. Its last backward ends the pipeline, and its all-reduce and optimizer step follow (``step >= pipe
        + AR_0 + optim_0``): each replica's passes fit ``B`` less both, the all-reduce that of the ``r``
        replicas used (``r`` up to the first whose slack is negative: the floors rise with ``r``). ``stages``: in a
        plan of that many stages its microbatches' round trip after it crosses to the last stage and back, at least
        ``last(stages - 1)`` each way (``hops_ms`` ``to_last``: every crossing of the route), beside every block
        after it forward and back (else one crossing each way, as every stage's)."""
        rows, Y = self.rows, self.a.count + 1
        top = rows.top
        y = np.arange(Y)
        r = np.arange(1, top + 1)[None, :, None]
        # r replicas, y of group a and r - y of b (``_Rows.floor``: where it holds both, its ring crosses islands)
        floor = rows.floor(rows.firsts[:, None, None], y[None, None, :], np.maximum(r - y[None, None, :], 0))
        slack = B - self.opt0[1:, None, None] - floor  # (L, r = 1..top, Y)
        valid = np.logical_and.accumulate(slack >= 0, axis=1)
        at = np.broadcast_to(rows.first_rows[:, None, None], slack.shape)
        trip = None
        if stages is not None:
            i = np.arange(1, self.L + 1)
            trip = np.where(i < self.L, self.U[self.L] - self.U[i] + 2 * max(self.hop, float(self.last[stages - 1])),
                            0.0)
            trip = np.broadcast_to(trip[:, None, None], slack.shape)
        nb = self._nb(at, slack, slack, y[None, None, :], trip)  # (L, top, Y)
        ok = valid & (y + nb <= r) & (r - y <= rows.cap_b[rows.first_rows][:, None, None])
        by_r = np.where(ok, r - y, np.inf)
        if by_r.shape[1] < LINKED + 1:  # r past the largest ring: none
            by_r = np.concatenate([by_r, np.full((by_r.shape[0], LINKED + 1 - by_r.shape[1], Y), np.inf)], axis=1)
        self._first_by_r = by_r  # per replica count r = 1..: for ``_feasible_linked``
        return by_r.min(axis=1)

    def _after_passes(self, B: float, slack: np.ndarray, nb: np.ndarray) -> np.ndarray:
        """``nb`` raised where each replica's passes, after its first microbatch's arrival, and then the stage's
        all-reduce and optimizer step must fit ``B`` too (``step >= arrival + m t + AR_k + optim_k``). The ring's
        size is not known: ``y + nb`` is at most it, so its floor at that size is at most the plan's, and the
        fewest devices under it a count the plan's is no less than, and so on to a fixed point (or ``ROUNDS``).
        Each entry's rounds are its own: an entry a round left alone is at its fixed point, one raised to inf
        too, and only the others go on."""
        rows, Y = self.rows, nb.shape[1]
        room = B - rows.F - rows.arrive
        nb = nb.copy()
        live = np.flatnonzero(np.isfinite(nb))
        at, y = np.divmod(live, Y)
        flat = nb.reshape(-1)
        cur = flat[live]
        for _ in range(ROUNDS):
            if not len(live):
                break
            floor = rows.floor(rows.pair[at], y, cur.astype(int))  # ``_Rows.floor``: at y of a, cur of b
            slacks = [np.minimum(slack[at], room[at] - opt[at] - floor) for opt in (rows.opt_a, rows.opt_b)]
            raised = np.maximum(self._nb(at, slacks[0], slacks[1], y), cur)
            moved = raised != cur
            flat[live[moved]] = raised[moved]
            keep = moved & np.isfinite(raised)
            live, at, y, cur = live[keep], at[keep], y[keep], raised[keep]
        return nb
