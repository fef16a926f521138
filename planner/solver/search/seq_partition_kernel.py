"""The two DPs of ``seq_partition.partition_min_step``, compiled with numba.

Stage ``k`` of a fixed group sequence covering blocks ``s..e`` costs

* ``tau = H[k] (CP[k, e+1] - CP[k, s] + FWD[k, e] + BWD[k, s])`` per microbatch,
* ``MP[k, e+1] - MP[k, s] + INB[s] + OUTB[k, e]`` bytes (must be ``<= MEMCAP[k]``),
* an all-reduce of ``AR0[k] + AR1[k] * params`` ms when it holds parameters
  (``AR0 = AR1 = 0``: not replicated).

Compute, parameters and the memory prefix only grow with ``e`` and the
sends are never negative, so a scan over ``e`` stops at the first end whose
compute, memory or all-reduce alone breaks a cap: no stage-length table is
needed, and the DPs cost stages x blocks x (typical stage length).
"""
from __future__ import annotations

import numpy as np
from numba import njit

INF = np.inf


@njit(cache=True)
def _ar(AR0, AR1, PP, k, s, e):
    params = PP[e + 1] - PP[s]
    if params <= 0.0 or (AR0[k] == 0.0 and AR1[k] == 0.0):
        return 0.0
    return AR0[k] + AR1[k] * params


@njit(cache=True, nogil=True)  # nogil: other threads (CP-SAT's callbacks, a caller's) run meanwhile
def min_bottleneck(H, CP, FWD, BWD, MP, INB, OUTB, MEMCAP, AR0, AR1, PP, ar_cap):
    """The smallest largest ``tau`` over partitions whose stages fit and all-reduce ``<= ar_cap`` (inf: none)."""
    S, L = CP.shape[0], CP.shape[1] - 1
    nxt = np.full(L + 1, INF)
    nxt[L] = -INF  # after the last stage: nothing
    for k in range(S - 1, -1, -1):
        row = np.full(L + 1, INF)
        for s in range(L):
            best = INF
            for e in range(s, L):
                comp = H[k] * (CP[k, e + 1] - CP[k, s])
                if comp >= best or MP[k, e + 1] - MP[k, s] + INB[s] > MEMCAP[k] \
                        or _ar(AR0, AR1, PP, k, s, e) > ar_cap:
                    break
                if MP[k, e + 1] - MP[k, s] + INB[s] + OUTB[k, e] > MEMCAP[k]:
                    continue
                tau = comp + H[k] * (FWD[k, e] + BWD[k, s])
                v = max(tau, nxt[e + 1])
                if v < best:
                    best = v
            row[s] = best
        nxt = row
    return nxt[0]


@njit(cache=True, nogil=True)
def min_sum(H, CP, FWD, BWD, MP, INB, OUTB, MEMCAP, AR0, AR1, PP, t_cap, ar_cap, choice):
    """The smallest sum of ``tau`` with every stage ``<= t_cap`` and all-reduce ``<= ar_cap`` (inf: none);
    ``choice[k, s]`` receives the end block of stage ``k`` starting at ``s``."""
    S, L = CP.shape[0], CP.shape[1] - 1
    nxt = np.full(L + 1, INF)
    nxt[L] = 0.0
    for k in range(S - 1, -1, -1):
        row = np.full(L + 1, INF)
        for s in range(L):
            best, arg = INF, -1
            for e in range(s, L):
                comp = H[k] * (CP[k, e + 1] - CP[k, s])
                if comp > t_cap or MP[k, e + 1] - MP[k, s] + INB[s] > MEMCAP[k] \
                        or _ar(AR0, AR1, PP, k, s, e) > ar_cap:
                    break
                if MP[k, e + 1] - MP[k, s] + INB[s] + OUTB[k, e] > MEMCAP[k]:
                    continue
                tau = comp + H[k] * (FWD[k, e] + BWD[k, s])
                if tau > t_cap:
                    continue
                v = tau + nxt[e + 1]
                if v < best:
                    best, arg = v, e
            row[s] = best
            choice[k, s] = arg
        nxt = row
    return nxt[0]


def warm() -> None:
    """Compile (or load from numba's cache) the kernels on a tiny instance, outside a solve's clock."""
    S, L = 1, 2
    z = np.zeros((S, L))
    args = (np.ones(S), np.array([[0.0, 1.0, 2.0]]), z, z, np.zeros((S, L + 1)), np.zeros(L), z,
            np.ones(S), np.zeros(S), np.zeros(S), np.zeros(L + 1))
    min_bottleneck(*args, INF)
    min_sum(*args, INF, INF, np.zeros((S, L), np.int64))
