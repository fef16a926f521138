"""Each microbatch's trip over its route (``planner.solver.program_cost``): its forward path to a stage, its round
trip downstream of it, its backward from it through stage 0, its hops with their verdict waits, and how long the
replicas before it hold it behind their own passes."""
from __future__ import annotations

from dataclasses import dataclass

from cost_models import comm
from planner.solver.problem import Problem
from planner.solver.routing import owners


@dataclass(slots=True)
class _Paths:
    """Per microbatch ``m`` on its route (one replica per stage): ``fwd[m][k]`` its forward path to stage
    ``k``, ``bwd[m][k]`` its backward path from stage ``k`` through stage 0, ``down[m][k]`` its round trip
    downstream of stage ``k``; ``late_f[m][k]`` / ``late_b[m][k]`` how long upstream replicas hold it behind
    their own earlier forwards / later backwards; ``hop_f[m][k]`` / ``hop_b[m][k]`` its activation's /
    gradient's transfer across boundary ``k`` with the verdict wait there."""

    fwd: list[list[float]]
    bwd: list[list[float]]
    down: list[list[float]]
    late_f: dict[int, list[float]]   # only for the first microbatch of some replica
    late_b: dict[int, list[float]]   # only for the last microbatch of some replica
    hop_f: list[list[float]]
    hop_b: list[list[float]]


def _paths(problem: Problem, stages, routes, fb, bw, wait) -> _Paths:
    S, M = len(stages), sum(stages[0].microbatches)
    owner = [owners(st.microbatches) for st in stages]
    # Microbatches on the same replicas share their paths (without replicas, all of them do): compute each
    # route once; only the queueing behind a replica's other microbatches depends on the microbatch.
    hops: dict[tuple[int, int, int], float] = {}
    by_route: dict[tuple[int, ...], tuple[list[float], ...]] = {}
    out = _Paths(fwd=[None] * M, bwd=[None] * M, down=[None] * M, late_f={}, late_b={}, hop_f=[None] * M,
                 hop_b=[None] * M)
    for m in range(M):
        rep = tuple(owner[k][m][0] for k in range(S))
        shared = by_route.get(rep)
        if shared is None:
            shared = by_route[rep] = _route_paths(problem, stages, rep, fb, bw, wait, hops)
        out.fwd[m], out.bwd[m], out.down[m], out.hop_f[m], out.hop_b[m] = shared
    # Queueing is read only for a replica's first microbatch (forwards) and its last (backwards).
    for m in {ids[0] for rs in routes for ids in rs}:
        out.late_f[m] = _late(S, [pos * (fb[k][i] - bw[k][i]) for k, (i, pos) in enumerate(own[m] for own in owner)])
    for m in {ids[-1] for rs in routes for ids in rs}:
        out.late_b[m] = _late(S, [(stages[k].microbatches[i] - 1 - pos) * bw[k][i]
                                  for k, (i, pos) in enumerate(own[m] for own in owner)])
    return out


def _late(S: int, held: list[float]) -> list[float]:
    """Per stage k, the longest hold of any stage before it (``held[j]``: stage j's)."""
    out = [0.0] * S
    for k in range(1, S):
        out[k] = max(out[k - 1], held[k - 1])
    return out


def _route_paths(problem: Problem, stages, rep: tuple[int, ...], fb, bw, wait,
                 hops: dict[tuple[int, int, int], float]) -> tuple[list[float], ...]:
    """``fwd``, ``bwd``, ``down``, ``hop_f``, ``hop_b`` of a microbatch routed through replicas ``rep``
    (shared between the microbatches on that route: read only)."""
    S = len(stages)
    fwd, bwd, down, hop_f, hop_b = ([0.0] * S for _ in range(5))
    for k in range(S - 1):
        a, b = stages[k].devices[rep[k]], stages[k + 1].devices[rep[k + 1]]
        ms = hops.get((k, rep[k], rep[k + 1]))
        if ms is None:
            nbytes = problem.wire_bytes(stages[k].last_block, stages[k].out_codec)
            ms = hops[k, rep[k], rep[k + 1]] = comm.transfer_ms(nbytes, problem.link(a, b))
        hop_f[k] = ms + wait.get((k, "act", b), 0.0)
        hop_b[k] = ms + wait.get((k, "grad", a), 0.0)
    for k in range(1, S):
        i = rep[k - 1]
        fwd[k] = fwd[k - 1] + fb[k - 1][i] - bw[k - 1][i] + hop_f[k - 1]
        bwd[k] = bwd[k - 1] + bw[k - 1][i] + hop_b[k - 1]
    for k in range(S - 2, -1, -1):
        down[k] = down[k + 1] + fb[k + 1][rep[k + 1]] + hop_f[k] + hop_b[k]
    return fwd, bwd, down, hop_f, hop_b


def _queued(stages, routes, fb, k: int, i: int, at: int) -> float:
    """How long replica ``i`` of stage ``k``'s first (``at=0``) or last (``at=-1``) microbatch waits downstream
    behind the same-numbered microbatches of the stage's other replicas, sent at the same time and lower."""
    x = routes[k][i][at]
    rivals = [ids[at] for ids in routes[k] if ids[at] < x]
    if not rivals:
        return 0.0
    wait = 0.0
    for j in range(k + 1, len(routes)):
        owner = owners(stages[j].microbatches)
        ahead = sum(owner[m][0] == owner[x][0] for m in rivals)
        wait = max(wait, ahead * fb[j][owner[x][0]])
    return wait


def _own_floor(routes, fb, p: _Paths) -> list[float]:
    """Per stage, the earliest its last backward can end: each replica's first microbatch arrives, then the
    replica runs all its passes (a stage the drain leaves early still has them to run)."""
    return [max(p.fwd[ids[0]][k] + p.late_f[ids[0]][k] + len(ids) * t for ids, t in zip(rs, fb[k]))
            for k, rs in enumerate(routes)]
