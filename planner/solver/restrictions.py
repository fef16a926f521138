"""The natural restrictions of a pool: sub-clusters a planner should also plan, so that more devices never give
a slower plan than fewer (the free search over a large pool can miss what a search over a part of it finds).

Each restriction drops whole hosts (device ids stay those of the full cluster, so its plan runs there): the
trusted hosts alone; the trusted hosts with the untrusted hosts of the fastest two device types together,
and of each type (fastest first); the pool without each region that holds no trusted host. CPU verifier hosts stay in
all but one: the pool without its CPU verifier hosts (a verifier host more is only more options).

A small pool (at most ``DROP_EACH_UP_TO`` untrusted worker and verifier hosts: ``droppable``) is planned instead as
its sub-pools by ``planner.api.plan_chain``, recursively, as those smaller pools' own calls (issue 36).
"""
from __future__ import annotations

from dataclasses import dataclass

from cost_models.cluster import ClusterSpec, Host

TRUSTED_ONLY = "trusted hosts only"
MAX_RESTRICTIONS = 7  # each costs a solve: the likeliest come first (trusted only, no verifier hosts, by device type)
# The trusted hosts alone (the smallest part, inside every other) are searched with at least this much work
# (nominal s): a search sizes its steps by its budget (the sequence DP's look, CP-SAT's turn), so a sliver of a
# short limit skips the steps that find their best plan, and so small a part stops far short of it (issue 36,
# seed 14: their replicated plan needs a 0.4 s budget and spends 0.09 s). The other parts share evenly.
PART_MIN_S = 0.5
# A pool with at most this many untrusted worker and CPU verifier hosts is planned as well without each of them, in
# turn (``droppable``; ``planner.api``): its 2 ** n sub-pools, each with ``SUB_POOL_SHARE`` of the limit.
DROP_EACH_UP_TO = 3
# a sub-pool's share of the limit: all 2 ** DROP_EACH_UP_TO of them fit in it
SUB_POOL_SHARE = 1 / 2 ** DROP_EACH_UP_TO


@dataclass(frozen=True, slots=True)
class Restriction:
    """A named part of a pool: ``cluster`` is the full one less ``dropped`` hosts."""

    name: str
    cluster: ClusterSpec
    dropped: frozenset[str]


def part_budget_s(part: Restriction, share_s: float, parts: int, pool_s: float) -> float:
    """Nominal seconds of work for ``part``, one of ``parts`` restrictions sharing ``share_s``: an even share, the
    trusted hosts alone raised to ``PART_MIN_S`` but never past ``pool_s``, the whole pool's search."""
    even = share_s / max(parts, 1)
    return max(even, min(PART_MIN_S, pool_s)) if part.name == TRUSTED_ONLY else even


def _speed(host: Host) -> float:
    """A host's fastest device's float32 peak (FLOP/s): orders the device types."""
    return max((dict(d.spec.peak_flops).get("float32", 0.0) for d in host.devices), default=0.0)


def _type(host: Host) -> str:
    return "+".join(sorted({d.type for d in host.devices}))


def restrictions(cluster: ClusterSpec) -> tuple[Restriction, ...]:
    """Up to ``MAX_RESTRICTIONS`` distinct proper parts of ``cluster`` that keep a trusted stage device."""
    workers = [h for h in cluster.hosts if h.role == "worker" and h.devices]
    trusted = {h.name for h in workers if h.trusted}
    untrusted = [h for h in workers if not h.trusted]
    if not trusted or not untrusted:
        return ()
    checkers = frozenset(h.name for h in cluster.hosts if h.role == "verifier")
    by_type: dict[str, list[Host]] = {}
    for h in sorted(untrusted, key=lambda h: (-_speed(h), _type(h))):
        by_type.setdefault(_type(h), []).append(h)
    kinds = list(by_type)
    keep_sets: list[tuple[str, set[str]]] = [(TRUSTED_ONLY, set(trusted))]
    if len(kinds) > 2:
        keep_sets.append((f"trusted + {kinds[0]} + {kinds[1]}",
                          trusted | {h.name for t in kinds[:2] for h in by_type[t]}))
    keep_sets += [(f"trusted + {t}", trusted | {h.name for h in by_type[t]}) for t in kinds]
    home = {h.region for h in workers if h.trusted}
    for region in dict.fromkeys(h.region for h in untrusted):
        if region not in home:
            keep_sets.append((f"without region {region}", {h.name for h in workers if h.region != region}))
    everyone = {h.name for h in workers}
    out, seen = [], set()
    for name, keep in keep_sets:
        key = frozenset(keep)
        if key in seen or key == everyone:
            continue
        seen.add(key)
        dropped = frozenset(everyone - keep)
        out.append(Restriction(name=name, cluster=cluster.without_hosts(set(dropped)), dropped=dropped))
        if len(out) == MAX_RESTRICTIONS - 1:
            break
    if checkers:  # second: the one part that keeps every stage device
        out.insert(1, Restriction(name="without CPU verifier hosts", cluster=cluster.without_hosts(set(checkers)),
                                  dropped=checkers))
    return tuple(out)


def droppable(cluster: ClusterSpec) -> tuple[str, ...]:
    """The hosts a small pool is also planned without, one at a time: its untrusted worker hosts and its verifier
    hosts, when they are at most ``DROP_EACH_UP_TO`` (else none); a worker host only beside another worker host
    with devices (a smaller pool keeps one)."""
    several = sum(h.role == "worker" and bool(h.devices) for h in cluster.hosts) > 1
    names = tuple(h.name for h in cluster.hosts
                  if (h.role == "worker" and h.devices and not h.trusted) or h.role == "verifier")
    if len(names) > DROP_EACH_UP_TO:
        return ()
    return tuple(n for n in names if several or cluster.host(n).role == "verifier")
