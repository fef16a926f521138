"""The inner loops of ``lagrange.SequenceDP.run``, compiled with numba.

The bound needs thousands of DPs; interpreted numpy spent most of its time
in call overhead, which these kernels remove (the caller builds the tables).

The DP runs in *layers* ``j`` = the number of stages from this one to the
end: under 1F1B a stage holds ``min(share, j)`` microbatches of activations,
so memory is exact per layer. Layer ``j`` depends only on layer ``j - 1``,
so each layer is a range-minimum over a sparse table built once:
``Q[c, r, n, e] = H[c, r] (cp[c, e + 1] + FWD[c, n, e]) + V[j - 1][e + 1, c, n]``
for a stage on class ``c`` with replica option ``r`` ending at block ``e``,
followed by a stage on class ``n``. The last layer may be *lumped*
("``j`` or more stages", memory at ``j`` in flight, a valid floor): it refers
to itself, so it is filled from the right with a sparse table updated as the
DP moves left.
"""
from __future__ import annotations

import numpy as np
from numba import njit

INF = np.inf


@njit(cache=True)
def _last_fit(cp_row, value):
    """The last end block ``e`` with ``cp_row[e + 1] <= value`` (``searchsorted(side="right") - 2``)."""
    lo, hi = 0, cp_row.shape[0]
    while lo < hi:
        mid = (lo + hi) // 2
        if cp_row[mid] <= value:
            lo = mid + 1
        else:
            hi = mid
    return lo - 2


@njit(cache=True)
def _fill_q(SP, H, valid, cp, FWD, Vnext, LV):
    """SP[0] = Q of the layer whose next stages are ``Vnext``, then the sparse levels each (c, r) needs."""
    C, R = H.shape
    L = cp.shape[1] - 1
    for c in range(C):
        for r in range(R):
            if not valid[c, r]:
                continue
            for n in range(C):
                for e in range(L - 1):
                    SP[0, c, r, n, e] = H[c, r] * (cp[c, e + 1] + FWD[c, n, e]) + Vnext[e + 1, c, n]
                for lv in range(1, LV[c, r] + 1):  # entries from L - 1 on stay infinite (set at allocation)
                    half = 1 << (lv - 1)
                    for e in range(L - 1):
                        SP[lv, c, r, n, e] = min(SP[lv - 1, c, r, n, e], SP[lv - 1, c, r, n, e + half])


@njit(cache=True)
def _exact_layer(layer, cap, price, H, valid, cp, HI, BWD, EHI, LASTOK, trusted, ends_trusted, SPa, LOG2,
                 Vout, V0, kind, pick_r, pick_n, pick_hi):
    """One exact layer, looping (class, replicas, next class) outermost so the table is read in order."""
    C, R = H.shape
    L = cp.shape[1] - 1
    for s in range(L):
        for qi in range(C):
            for c in range(C):
                Vout[s, qi, c] = INF
                kind[layer, s, qi, c] = 0
    for c in range(C):
        V0[layer, c] = INF
    for c in range(C):
        for r in range(R):
            if not valid[c, r]:
                continue
            h = H[c, r]
            for s in range(L):
                nq = 1 if s == 0 else C
                if s == 0 and ends_trusted and not trusted[c]:
                    continue
                base_p = price[c, r] - h * cp[c, s]
                if layer == 0:  # the last stage
                    if not LASTOK[c, r, s] or (ends_trusted and not trusted[c]):
                        continue
                    for qi in range(nq):
                        bwd = 0.0 if s == 0 else BWD[c, qi, s]
                        tau = h * (cp[c, L] - cp[c, s] + bwd)
                        v = tau + price[c, r]
                        if tau > cap or v >= (V0[layer, c] if s == 0 else Vout[s, qi, c]):
                            continue
                        if s == 0:
                            V0[layer, c] = v
                        else:
                            Vout[s, qi, c] = v
                        kind[layer, s, qi, c], pick_r[layer, s, qi, c] = 1, r
                    continue
                if s > L - 2:
                    continue
                lim = min(EHI[c, r, layer, s], L - 2)
                if lim < s:
                    continue
                for n in range(C):
                    for qi in range(nq):
                        hi = min(HI[c, r, n, s, qi], lim)
                        if hi < s:
                            continue
                        lv = LOG2[hi - s + 1]
                        m = min(SPa[lv, c, r, n, s], SPa[lv, c, r, n, hi - (1 << lv) + 1])
                        v = base_p + m + (0.0 if s == 0 else h * BWD[c, qi, s])
                        if s == 0:
                            if v < V0[layer, c]:
                                V0[layer, c] = v
                                kind[layer, s, qi, c], pick_r[layer, s, qi, c] = 2, r
                                pick_n[layer, s, qi, c], pick_hi[layer, s, qi, c] = n, hi
                        elif v < Vout[s, qi, c]:
                            Vout[s, qi, c] = v
                            kind[layer, s, qi, c], pick_r[layer, s, qi, c] = 2, r
                            pick_n[layer, s, qi, c], pick_hi[layer, s, qi, c] = n, hi


@njit(cache=True)
def _push(SP, H, valid, cp, FWD, V, s):
    """Add ``e = s - 1`` to a sparse table over a layer that refers to itself (``V`` = that layer)."""
    C, R = H.shape
    LOG = SP.shape[0]
    e = s - 1
    for c in range(C):
        for r in range(R):
            for n in range(C):
                SP[0, c, r, n, e] = H[c, r] * (cp[c, s] + FWD[c, n, e]) + V[s, c, n] if valid[c, r] else INF
                for lv in range(1, LOG):
                    SP[lv, c, r, n, e] = min(SP[lv - 1, c, r, n, e], SP[lv - 1, c, r, n, e + (1 << (lv - 1))])


@njit(cache=True)
def time_limits(cap, H, valid, cp, FWD_MIN, BWD, HI, LV, LOG2):
    """HI[c, r, n, s, q]: the last end block of a stage from ``s`` whose time can stay <= cap (the same
    in every layer, so computed once per DP); LV[c, r]: sparse-table levels its queries need."""
    C, R = H.shape
    L = cp.shape[1] - 1
    for c in range(C):
        for r in range(R):
            longest = 0
            h = H[c, r]
            for n in range(C):
                fm = FWD_MIN[c, n]
                for s in range(L):
                    for qi in range(C):
                        bwd = 0.0 if s == 0 else BWD[c, qi, s]
                        if fm == INF or bwd == INF or not valid[c, r]:
                            HI[c, r, n, s, qi] = -1
                            continue
                        hi = _last_fit(cp[c], cp[c, s] + cap / h - bwd - fm)
                        HI[c, r, n, s, qi] = hi
                        longest = max(longest, min(hi, L - 2) - s + 1)
            LV[c, r] = LOG2[longest] if longest > 0 else 0


@njit(cache=True)
def _state(s, qi, c, layer, cap, price, H, valid, cp, HI, BWD, EHI, LASTOK, trusted, ends_trusted,
           allow_last, SPa, use_a, SPb, use_b, LOG2):
    """Best option of state (s, previous class qi, class c): (cost, kind, r, n, hi).

    kind 1: the last stage; 2: a stage then the table ``SPa``; 3: then ``SPb``.
    """
    C, R = H.shape
    L = cp.shape[1] - 1
    best, bk, br, bn, bh = INF, 0, -1, -1, -1
    bwd = 0.0 if s == 0 else BWD[c, qi, s]
    if bwd == INF or (s == 0 and ends_trusted and not trusted[c]):
        return best, bk, br, bn, bh
    for r in range(R):
        if not valid[c, r]:
            continue
        h = H[c, r]
        if allow_last and LASTOK[c, r, s] and (trusted[c] or not ends_trusted):
            tau = h * (cp[c, L] - cp[c, s] + bwd)
            if tau <= cap and tau + price[c, r] < best:
                best, bk, br = tau + price[c, r], 1, r
        if s > L - 2 or not (use_a or use_b):
            continue
        lim = min(EHI[c, r, layer, s], L - 2)
        base = price[c, r] + h * (bwd - cp[c, s])
        for n in range(C):
            hi = min(HI[c, r, n, s, qi], lim)
            if hi < s:
                continue
            lv = LOG2[hi - s + 1]
            right = hi - (1 << lv) + 1
            if use_a:
                v = base + min(SPa[lv, c, r, n, s], SPa[lv, c, r, n, right])
                if v < best:
                    best, bk, br, bn, bh = v, 2, r, n, hi
            if use_b:
                v = base + min(SPb[lv, c, r, n, s], SPb[lv, c, r, n, right])
                if v < best:
                    best, bk, br, bn, bh = v, 3, r, n, hi
    return best, bk, br, bn, bh


@njit(cache=True, nogil=True)  # nogil: relaxed plans are priced on another thread meanwhile (``pricer``)
def sequence_dp(cap, price, H, valid, cp, FWD, FWD_MIN, BWD, EHI, LASTOK, trusted, ends_trusted, lump,
                SPa, SPb, HI, LV, limits_ready, V, V0, kind, pick_r, pick_n, pick_hi):
    """Fill every layer's ``V[layer, s, q, c]``, the first stage's ``V0[layer, c]`` and the choices.

    ``EHI[c, r, layer, s]``: last end block that fits in memory (and the all-reduce cap) in that layer;
    ``lump``: the last layer means "this many stages or more"; ``limits_ready``: ``HI`` and ``LV`` already
    hold :func:`time_limits` at this cap (they depend on nothing else, and the prices change far more
    often than the caps).
    """
    C = H.shape[0]
    L = cp.shape[1] - 1
    J = V.shape[0]
    LOG2 = np.zeros(L + 2, np.int64)  # floor(log2(length)) of a query range
    for k in range(2, L + 2):
        LOG2[k] = LOG2[k // 2] + 1
    if not limits_ready:
        time_limits(cap, H, valid, cp, FWD_MIN, BWD, HI, LV, LOG2)
    for layer in range(J):
        if layer > 0:
            _fill_q(SPa, H, valid, cp, FWD, V[layer - 1], LV)
        if not (lump and layer == J - 1):
            _exact_layer(layer, cap, price, H, valid, cp, HI, BWD, EHI, LASTOK, trusted, ends_trusted, SPa, LOG2,
                         V[layer], V0, kind, pick_r, pick_n, pick_hi)
            continue
        # The lumped layer refers to itself: fill it from the right, growing its own table as it goes.
        for s in range(L - 1, -1, -1):
            nq = 1 if s == 0 else C
            for qi in range(nq):
                for c in range(C):
                    got = _state(s, qi, c, layer, cap, price, H, valid, cp, HI, BWD, EHI, LASTOK, trusted,
                                 ends_trusted, layer == 0, SPa, layer > 0, SPb, True, LOG2)
                    if s == 0:
                        V0[layer, c] = got[0]
                    else:
                        V[layer, s, qi, c] = got[0]
                    kind[layer, s, qi, c], pick_r[layer, s, qi, c] = got[1], got[2]
                    pick_n[layer, s, qi, c], pick_hi[layer, s, qi, c] = got[3], got[4]
            if s >= 1:
                _push(SPb, H, valid, cp, FWD, V[layer], s)


def warm() -> None:
    """Compile (or load from numba's cache) the kernels on a tiny instance, outside a solve's clock."""
    C, R, L, J, LOG = 1, 1, 2, 1, 2
    f = np.float64
    sequence_dp(1.0, np.zeros((C, R), f), np.ones((C, R), f), np.ones((C, R), np.bool_),
                np.array([[0.0, 1.0, 2.0]]), np.zeros((C, C, L - 1), f), np.zeros((C, C), f),
                np.zeros((C, C, L), f), np.ones((C, R, J, L), np.int64), np.ones((C, R, L), np.bool_),
                np.ones(C, np.bool_), True, False, np.full((LOG, C, R, C, L + 4), INF),
                np.full((LOG, C, R, C, L + 4), INF), np.zeros((C, R, C, L, C), np.int64),
                np.zeros((C, R), np.int64), False,
                np.full((J, L + 1, C, C), INF), np.full((J, C), INF),
                *(np.zeros((J, L, C, C), np.int64) for _ in range(4)))
