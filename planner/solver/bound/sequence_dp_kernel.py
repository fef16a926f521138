"""The inner loops of ``sequence_dp.SequenceDP.run``, compiled with numba.

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

The cap is exact (``sequence_dp``): the ends up to the last one that fits at the
pair's largest send form a range (one sparse-table query); beyond it, up to
the last one that could fit at the smallest send, ``_capped_min`` searches
by halving over sparse tables of the ends' keys. Passing the smallest sends
as the largest gives the loose test (every end up to the latter).
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


@njit(cache=True, inline="always")
def _capped_min(SP, c, r, n, s, hi, sure, cap_h, bwd, cp_s, KMIN, KMAX, LOG2, stack):
    """min of ``SP[., c, r, n, e]`` over the ends ``s <= e <= hi`` whose stage fits the cap,
    ``KEY[c, n, e] = cp[c, e + 1] + FWD[c, n, e] <= room = cap / h - bwd + cp[c, s]``.

    The sends vary with the boundary, so beyond ``sure`` (where every end fits, even at the largest send)
    the ends that fit are not a range: the rest is searched by halving, a half skipped when its
    minimum cannot improve, or no end in it fits (``KMIN``), and taken whole when every end fits (``KMAX``).
    """
    m = INF
    top = min(sure, hi)
    if top >= s:
        lv = LOG2[top - s + 1]
        m = min(SP[lv, c, r, n, s], SP[lv, c, r, n, top - (1 << lv) + 1])
    else:
        top = s - 1
    if top >= hi:
        return m
    room = cap_h - bwd + cp_s
    stack[0, 0], stack[0, 1] = top + 1, hi
    depth = 1
    while depth > 0:
        depth -= 1
        a, b = stack[depth, 0], stack[depth, 1]
        lv = LOG2[b - a + 1]
        b2 = b - (1 << lv) + 1
        v = min(SP[lv, c, r, n, a], SP[lv, c, r, n, b2])
        if v >= m or min(KMIN[lv, c, n, a], KMIN[lv, c, n, b2]) > room:
            continue
        if max(KMAX[lv, c, n, a], KMAX[lv, c, n, b2]) <= room:
            m = v
            continue
        mid = (a + b) >> 1
        lv = LOG2[mid - a + 1]
        left = min(SP[lv, c, r, n, a], SP[lv, c, r, n, mid - (1 << lv) + 1])
        if left > v:  # the minimum is in the right half: search it first (the left one is searched after)
            stack[depth, 0], stack[depth, 1] = a, mid
            stack[depth + 1, 0], stack[depth + 1, 1] = mid + 1, b
        else:
            stack[depth, 0], stack[depth, 1] = mid + 1, b
            stack[depth + 1, 0], stack[depth + 1, 1] = a, mid
        depth += 2
    return m


@njit(cache=True)
def key_tables(cp, FWD, KMIN, KMAX):
    """Sparse tables of min and max of ``KEY[c, n, e] = cp[c, e + 1] + FWD[c, n, e]`` over ends (``inf`` past
    ``L - 2``): they depend on the problem alone."""
    LOG, C = KMIN.shape[0], KMIN.shape[1]
    L = cp.shape[1] - 1
    for c in range(C):
        for n in range(C):
            for e in range(KMIN.shape[3]):
                k = cp[c, e + 1] + FWD[c, n, e] if e < L - 1 else INF
                KMIN[0, c, n, e] = KMAX[0, c, n, e] = k
            for lv in range(1, LOG):
                half = 1 << (lv - 1)
                for e in range(KMIN.shape[3] - half):
                    KMIN[lv, c, n, e] = min(KMIN[lv - 1, c, n, e], KMIN[lv - 1, c, n, e + half])
                    KMAX[lv, c, n, e] = max(KMAX[lv - 1, c, n, e], KMAX[lv - 1, c, n, e + half])


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
def _exact_layer(layer, cap, price, H, valid, cp, KMIN, KMAX, stack, HI, HS, BWD, EHI, LASTOK, trusted, ends_trusted, SPa, LOG2,
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
            cap_h = cap / h
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
                        bwd = 0.0 if s == 0 else BWD[c, qi, s]
                        m = _capped_min(SPa, c, r, n, s, hi, HS[c, r, n, s, qi], cap_h, bwd, cp[c, s], KMIN,
                                        KMAX, LOG2, stack)
                        v = base_p + m + h * bwd
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
def _push(SP, H, valid, cp, FWD, V, s, LV):
    """Add ``e = s - 1`` to a sparse table over a layer that refers to itself (``V`` = that layer), on the
    levels the queries of each (class, replicas) read (``LV``: its longest stage under the cap)."""
    C, R = H.shape
    e = s - 1
    for c in range(C):
        for r in range(R):
            for n in range(C):
                SP[0, c, r, n, e] = H[c, r] * (cp[c, s] + FWD[c, n, e]) + V[s, c, n] if valid[c, r] else INF
                for lv in range(1, LV[c, r] + 1):
                    SP[lv, c, r, n, e] = min(SP[lv - 1, c, r, n, e], SP[lv - 1, c, r, n, e + (1 << (lv - 1))])


@njit(cache=True)
def time_limits(cap, H, valid, cp, FWD_MIN, FWD_MAX, BWD, HI, HS, LV, LOG2):
    """HI[c, r, n, s, q]: the last end block of a stage from ``s`` whose time can stay <= cap at the
    smallest send; HS: the last end up to which every end fits, even at the largest (the same in every
    layer, so computed once per DP); LV[c, r]: sparse-table levels its queries need."""
    C, R = H.shape
    L = cp.shape[1] - 1
    for c in range(C):
        for r in range(R):
            longest = 0
            h = H[c, r]
            for n in range(C):
                fm, fx = FWD_MIN[c, n], FWD_MAX[c, n]
                for s in range(L):
                    for qi in range(C):
                        bwd = 0.0 if s == 0 else BWD[c, qi, s]
                        if fm == INF or bwd == INF or not valid[c, r]:
                            HI[c, r, n, s, qi] = HS[c, r, n, s, qi] = -1
                            continue
                        hi = _last_fit(cp[c], cp[c, s] + cap / h - bwd - fm)
                        HI[c, r, n, s, qi] = hi
                        HS[c, r, n, s, qi] = hi if fx == fm else _last_fit(cp[c], cp[c, s] + cap / h - bwd - fx)
                        longest = max(longest, min(hi, L - 2) - s + 1)
            LV[c, r] = LOG2[longest] if longest > 0 else 0


@njit(cache=True)
def _state(s, qi, c, layer, cap, price, H, valid, cp, KMIN, KMAX, stack, HI, HS, BWD, EHI, LASTOK, trusted, ends_trusted,
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
            sure, cap_h = HS[c, r, n, s, qi], cap / h
            if use_a:
                v = base + _capped_min(SPa, c, r, n, s, hi, sure, cap_h, bwd, cp[c, s], KMIN, KMAX, LOG2, stack)
                if v < best:
                    best, bk, br, bn, bh = v, 2, r, n, hi
            if use_b:
                v = base + _capped_min(SPb, c, r, n, s, hi, sure, cap_h, bwd, cp[c, s], KMIN, KMAX, LOG2, stack)
                if v < best:
                    best, bk, br, bn, bh = v, 3, r, n, hi
    return best, bk, br, bn, bh


@njit(cache=True, nogil=True)  # nogil: other threads (CP-SAT's callbacks, a caller's) run meanwhile
def sequence_dp(cap, price, H, valid, cp, FWD, FWD_MIN, FWD_MAX, KMIN, KMAX, BWD, EHI, LASTOK, trusted,
                ends_trusted, lump, SPa, SPb, HI, HS, LV, limits_ready, V, V0, kind, pick_r, pick_n, pick_hi):
    """Fill every layer's ``V[layer, s, q, c]``, the first stage's ``V0[layer, c]`` and the choices.

    ``EHI[c, r, layer, s]``: last end block that fits in memory (and the all-reduce cap) in that layer;
    ``lump``: the last layer means "this many stages or more"; ``limits_ready``: ``HI`` and ``LV`` already
    hold :func:`time_limits` at this cap (they depend on nothing else, and the prices change far more
    often than the caps).
    """
    C = H.shape[0]
    L = cp.shape[1] - 1
    J = V.shape[0]
    stack = np.empty((2 * KMIN.shape[0] + 2, 2), np.int64)  # _capped_min's halves still to search
    LOG2 = np.zeros(L + 2, np.int64)  # floor(log2(length)) of a query range
    for k in range(2, L + 2):
        LOG2[k] = LOG2[k // 2] + 1
    if not limits_ready:
        time_limits(cap, H, valid, cp, FWD_MIN, FWD_MAX, BWD, HI, HS, LV, LOG2)
    for layer in range(J):
        if layer > 0:
            _fill_q(SPa, H, valid, cp, FWD, V[layer - 1], LV)
        if not (lump and layer == J - 1):
            _exact_layer(layer, cap, price, H, valid, cp, KMIN, KMAX, stack, HI, HS, BWD, EHI, LASTOK, trusted, ends_trusted, SPa, LOG2,
                         V[layer], V0, kind, pick_r, pick_n, pick_hi)
            continue
        # The lumped layer refers to itself: fill it from the right, growing its own table as it goes.
        for s in range(L - 1, -1, -1):
            nq = 1 if s == 0 else C
            for qi in range(nq):
                for c in range(C):
                    got = _state(s, qi, c, layer, cap, price, H, valid, cp, KMIN, KMAX, stack, HI, HS, BWD, EHI, LASTOK, trusted,
                                 ends_trusted, layer == 0, SPa, layer > 0, SPb, True, LOG2)
                    if s == 0:
                        V0[layer, c] = got[0]
                    else:
                        V[layer, s, qi, c] = got[0]
                    kind[layer, s, qi, c], pick_r[layer, s, qi, c] = got[1], got[2]
                    pick_n[layer, s, qi, c], pick_hi[layer, s, qi, c] = got[3], got[4]
            if s >= 1:
                _push(SPb, H, valid, cp, FWD, V[layer], s, LV)


def warm() -> None:
    """Compile (or load from numba's cache) the kernels on a tiny instance, outside a solve's clock."""
    C, R, L, J, LOG = 1, 1, 2, 1, 2
    f = np.float64
    sequence_dp(1.0, np.zeros((C, R), f), np.ones((C, R), f), np.ones((C, R), np.bool_),
                np.array([[0.0, 1.0, 2.0]]), np.zeros((C, C, L - 1), f), np.zeros((C, C), f), np.zeros((C, C), f),
                np.zeros((LOG, C, C, L + 4), f), np.zeros((LOG, C, C, L + 4), f), np.zeros((C, C, L), f), np.ones((C, R, J, L), np.int64), np.ones((C, R, L), np.bool_),
                np.ones(C, np.bool_), True, False, np.full((LOG, C, R, C, L + 4), INF),
                np.full((LOG, C, R, C, L + 4), INF), np.zeros((C, R, C, L, C), np.int64),
                np.zeros((C, R, C, L, C), np.int64), np.zeros((C, R), np.int64), False,
                np.full((J, L + 1, C, C), INF), np.full((J, C), INF),
                *(np.zeros((J, L, C, C), np.int64) for _ in range(4)))
