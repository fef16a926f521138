"""The fill test's DP with replica states (``_LinkedDP``, a part of ``fill_dp._Test``), where every boundary
into a stage before the last may be a link between islands; ``bound.fill``'s docstring states the bound.

**Links between one-device stages.** Where no crossing before the last stage's can stay inside an island at some
partition (``replicas.slow_route``: one-GPU hosts; a trusted host of two between volunteers), every boundary into
a stage before the last is a link between islands, at least ``w`` ms of wire per (smallest) message. A stage at
depth ``z`` with ``r`` replicas after one of ``p`` receives the ``M`` activations over at most ``p r`` device pairs,
so one pair is busy ``ceil(M / (p r)) w``: it sends no sooner than the first microbatch's forward through blocks
``0..j-1`` and ``z - 1`` crossings, and after its last message the microbatch still waits its latency, runs the
blocks after ``j`` forward and every block backward (``U(L)`` with the blocks before), crosses at least once more
forward and back over its whole route (``S - 1 >= z + 1`` crossings from the last stage: ``last(z + 1)``), and
stage 0's optimizer step follows: ``step >= U(L) + before(z - 1) + ceil(M / (p r)) w + lat + hops(1) + last(z +
1) + optim``. A replicated stage's all-reduce waits for that microbatch too: after the message it runs every
block from the stage forward and back to it, crosses at least once each way, then the all-reduce over ``r`` and
the stage's optimizer step (``_after_link``). The DP then also holds the replica count of the stage so far (1 to ``LINKED``, or more), each stage of exactly ``c``
replicas checked with its all-reduce over ``c`` (``_exact``), and ``p r`` at least what the link needs
(``_feasible_linked``): four one-GPU hosts on 0.1 Gb/s with large boundaries, 19.5 -> 45.4 s, the best plan 45.4.
"""
from __future__ import annotations

import numpy as np

# Replica counts a stage's state holds exactly where boundaries are links between islands (``_feasible_linked``;
# more is one state).
LINKED = 3


class _LinkedDP:
    """The replica-state DP of ``fill_dp._Test`` (which runs it from ``feasible``): it reads the test's rows
    (``_Rows``), route, sizes and tables (``_fewest``, ``_nb``, ``_first``'s per replica count)."""

    def _linked_rows(self, B: float) -> list[list[np.ndarray]]:
        """The tables of ``feasible``'s DP (``_run_linked``; per replica state the previous stage left, per replica
        count of the stage) where every boundary into a stage before the last is a link between islands (``route``:
        ``w`` ms of wire per message, its latency): the DP's states also hold the replicas of the stage so far
        (1 to ``LINKED``, or more). A stage at depth ``z`` (not the last) with ``r`` replicas after one of ``p``
        gets every activation over at most ``p r`` device pairs, one of them busy ``ceil(M / (p r)) w``: its first
        message is sent no sooner than the first microbatch's forward through the stages before (``before(z -
        1)`` hops), and its last one's microbatch then still crosses it (latency), the blocks after it forward and
        every block backward, a hop forward and its whole route back (``last(S - 1) >= last(z + 1)``),
        and stage 0's optimizer step follows (``rest``): ``p r`` is at least the least with ``ceil(M / (p r)) w +
        rest(z) <= B``. A plan's stage of exactly ``r`` replicas (``y`` of group ``a``) has ``r - y`` of group
        ``b``, at least the fewest (``_fewest``); of more than ``LINKED``, more than ``LINKED - y``: each state's
        count is so no more than the plan's, and the DP no stricter than the plans."""
        L, NA, M, K = self.L, self.a.count, self.M, LINKED + 1
        exact = self._exact(B)  # per replica count: (stages, Z, NA + 1); stage 0's by ``_first`` (through _fewest)
        by_r = self._first_by_r  # stage 0: (L, r = 1..top + more, Y)
        y = np.arange(NA + 1)[None, None, :]
        with np.errstate(divide="ignore", invalid="ignore"):
            per = np.floor((B - self.rest) / self.route[0])
            pairs = np.where(per >= 1, np.ceil(M / np.maximum(per, 1)), np.inf)[None, :, None]  # (Z,): the link's
        before_last = (self._pair_i < L)[:, None, None]
        nb = []
        for p in range(1, K + 1):  # the state the previous stage left (K: more than LINKED, or none)
            if p == K:
                row = [e.copy() for e in exact]
            else:
                row = [np.where(before_last & (p * c < pairs), np.inf, e) for c, e in enumerate(exact[:-1], 1)]
                row.append(np.where(before_last, np.maximum(exact[-1], np.ceil(pairs / p) - y), exact[-1]))
                for c in range(2, K + 1):  # a replicated stage's all-reduce after the busiest pair into it
                    most = c if c < K else max(self.rows.top, K)
                    late = self._ar_rest[c - 2] + np.ceil(M / (p * most)) * self.route[0] > B
                    row[c - 1] = np.where(before_last & late[:, :, None], np.inf, row[c - 1])
            for out in row:
                out[self.rows.firsts] = np.inf
            nb.append(row)
        self._put_first(nb, by_r)
        return nb

    def _put_first(self, nb: list[list[np.ndarray]], by_r: np.ndarray) -> None:
        """Stage 0's rows (``_first``'s per replica count) into ``_linked_rows``' tables: it follows no stage."""
        K = LINKED + 1
        for c in range(1, K + 1):
            nb[K - 1][c - 1][self.rows.firsts, 0] = by_r[:, c - 1] if c < K else by_r[:, K - 1:].min(axis=1)

    def _run_linked(self, nb: list[list[np.ndarray]]) -> np.ndarray:
        """The DP of ``_linked_rows``' tables: per replica state, count of group ``a``'s devices and count of
        stages at the end, the fewest of group ``b``'s covering every block."""
        L, NA, Z, K = self.L, self.a.count, self.L + 1, LINKED + 1
        best = np.full((L + 1, K, NA + 1, Z), np.inf)
        best[0, K - 1, 0, 0] = 0.0
        reached = np.zeros(L + 1, dtype=bool)
        reached[0] = True
        for i in range(1, L + 1):
            js = np.flatnonzero(reached[:i])
            if not len(js):
                continue
            at = i * (i - 1) // 2 + js
            for was in range(K):
                came = best[js, was, :, :i]
                if not np.isfinite(came).any():
                    continue
                for now in range(K):
                    every = (came[:, :, :, None] + nb[was][now][at, :i][:, None, :, :]).min(axis=0)
                    for yy in range(NA + 1):
                        np.minimum(best[i, now, yy:, 1:i + 1], every[:NA + 1 - yy, :, yy],
                                   out=best[i, now, yy:, 1:i + 1])
            reached[i] = np.isfinite(best[i]).any()
        return best[L]

    def _after_link(self) -> list[np.ndarray]:
        """Per replica count ``c = 2..LINKED + 1`` (index ``c - 2``; the last: more), per stage after stage 0 and
        state (``(stages, Z)``, inf where none), what follows a message into it (``_feasible_linked``) up to its
        all-reduce's end: the blocks before it forward and the crossings before it, then (after the message) its
        latency, every block from it forward and back to it, a crossing each way, its all-reduce over ``c`` and
        its optimizer step."""
        rows, n, L = self.rows, self.rows.inner, self.L
        pair = rows.pair[:n]
        i = self._pair_i[pair]
        j = pair - i * (i - 1) // 2
        z = rows.cell[:n] % (L + 1)
        base = self.F[L] + self.Bw[L] - self.Bw[j] + self.before[np.maximum(z - 1, 0)] + self.route[1] \
            + 2 * self.hop + np.minimum(rows.opt_a[:n], rows.opt_b[:n])
        out = []
        for c in range(2, LINKED + 2):
            full = np.full(L * (L + 1) // 2 * (L + 1), np.inf)
            if c <= rows.top:
                full[rows.cell[:n]] = base + rows.floors[pair, c]
            out.append(full.reshape(-1, L + 1))
        return out

    def _exact(self, B: float) -> list[np.ndarray]:
        """Per replica count ``c = 1..LINKED`` (and one more: more than ``LINKED``), per stage after stage 0, state
        and count ``y`` of group ``a``'s devices, group ``b``'s devices a stage of exactly ``c`` replicas has where
        its passes, all-reduce over ``c`` and optimizer step fit ``B`` (as ``_after_passes`` at ring size ``c``;
        inf: not); of more, the fewest of group ``b`` whose passes fit beside the all-reduce over ``LINKED + 1``,
        no more than any larger ring's (the floors rise with the ring)."""
        rows, Y, n, K = self.rows, self.a.count + 1, self.rows.inner, LINKED + 1
        fewest = self._fewest(B)[rows.pair[:n], np.asarray(rows.cell[:n] % (self.L + 1))]  # any ring's fixed point
        at = np.arange(n)
        y = np.arange(Y)[None, :]
        slack = B - rows.U[:n] - rows.extra[:n] - self.opt_any
        room = B - rows.F[:n] - rows.arrive[:n]
        out = []
        for c in range(1, K + 1):
            if c > rows.top:
                out.append(np.full((self.L * (self.L + 1) // 2, self.L + 1, Y), np.inf))
                continue
            # y of a, c - y or, past LINKED, at least K - y of b (the floors rise with both)
            floor = rows.floor(rows.pair[:n, None], y, np.maximum(c - y, 0))
            slacks = [np.minimum(slack[:, None], room[:, None] - opt[:n, None] - floor)
                      for opt in (rows.opt_a, rows.opt_b)]
            nb = np.maximum(self._nb(np.broadcast_to(at[:, None], floor.shape), slacks[0], slacks[1], y), fewest)
            if c < K:
                nb = np.where((nb <= c - y) & (c - y <= rows.cap_b[:n, None]) & (floor <= B), c - y, np.inf)
            else:
                nb = np.maximum(nb, K - y)
                nb = np.where((nb <= rows.cap_b[:n, None]) & (floor <= B), nb, np.inf)
            full = np.full((self.L * (self.L + 1) // 2 * (self.L + 1), Y), np.inf)
            full[rows.cell[:n]] = nb
            out.append(full.reshape(-1, self.L + 1, Y))
        return out
