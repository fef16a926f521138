"""Several verifiers for one boundary: its senders (a replicated stage's replicas) split over the allowed sites.

On a pool of many untrusted replicas and few trusted verifier sites, one verifier per boundary checks every
replica's tensors and its load can pace the step. :func:`split_shared` splits such a boundary's senders over
the sites allowed to check it (``verifiers.verifier_sites``), greedily, each sender to the site that would be
least busy with it (longest check first); each site's verifier then watches only its senders
(``VerifierPlacement.senders``) and gets only their copies. A split is kept only where the compiled programs
price faster (``objective.price_program``), beside no audited stage; one that costs link tests (a stage's input and output then sit on
different verifiers for some replicas) must be faster by more than the policy's ``link_test_cost`` share.

:func:`place_on_programs` is the searches' descent on the same price: a boundary's verifier moved whole to another
allowed site, or its senders split (:func:`split_boundary`), by the same rules. The greedy placement
(``verifiers.assign_verifiers``) scores sites by the closed form, whose stage times count every send as busy time:
on a pool of slow links a trusted stage device's checks then seem free wherever they go, and on a tie the greedy
keeps a boundary on the previous one's verifier (the swarm-t4 case, 7/5/5/5/4 blocks on five T4s: 13,369 ms with
three boundaries on one trusted T4, 8,515 ms with them spread over both).
"""
from __future__ import annotations

import dataclasses

from planner.solver.link_tests import lost_link_tests
from planner.solver.objective import (
    Placement,
    checked_share,
    price_program,
    required_directions,
    violations,
)
from planner.solver.problem import Problem
from planner.solver.search.budget import Work, placement_units
from planner.solver.solution import VerifierPlacement
from planner.solver.verifiers import verifier_sites

# Of a boundary's allowed sites, the least busy this many are tried as its verifier's new site (a 176-device pool
# allows 20 or more per boundary: each try is a pricing).
SITES_TRIED = 3


def split_shared(problem: Problem, placement: Placement) -> Placement:
    """``placement`` with the boundaries whose senders pay to split over several verifiers split (module
    docstring), the busiest verifier's boundary first; ``placement`` itself where none pays."""
    best, best_ms = placement, price_program(problem, placement).step_ms
    lost = len(lost_link_tests(problem, placement))
    for b in sorted(_splittable(problem, placement), key=lambda b: -_check_ms(problem, placement, b)):
        cand = split_boundary(problem, best, b)
        if cand is None or violations(problem, cand):
            continue
        ms, cand_lost = price_program(problem, cand).step_ms, len(lost_link_tests(problem, cand))
        worth = 1 + (problem.policy.link_test_cost if cand_lost > lost else 0.0)
        if ms * worth < best_ms * (1 - 1e-9):
            best, best_ms, lost = cand, ms, cand_lost
    return best


def place_on_programs(problem: Problem, placement: Placement, *,
                      within: Work | None = None) -> tuple[Placement, float]:
    """``placement`` with its verifiers moved and split while the programs price faster (the module docstring's
    rules, best move first), and that price; each pricing charged to ``within`` (the descent stops once it passes)."""
    best, best_ms = placement, price_program(problem, placement).step_ms
    lost = len(lost_link_tests(problem, placement))
    improved = True
    while improved and not (within is not None and within.passed()):
        improved = False
        step: tuple[float, Placement, int] | None = None
        for cand in verifier_moves(problem, best):
            if within is not None:
                if within.passed():
                    break
                within.charge(placement_units(cand))
            if violations(problem, cand):
                continue
            ms, cand_lost = price_program(problem, cand).step_ms, len(lost_link_tests(problem, cand))
            worth = ms * (1 + (problem.policy.link_test_cost if cand_lost > lost else 0.0))
            if worth < best_ms * (1 - 1e-9) and (step is None or worth < step[0]):
                step = (worth, cand, cand_lost)
        if step is not None:
            best, lost, improved = step[1], step[2], True
            best_ms = price_program(problem, best).step_ms
    return best, best_ms


def verifier_moves(problem: Problem, placement: Placement):
    """Each boundary's sole verifier (watching every sender) moved whole to one of the ``SITES_TRIED`` least busy
    other sites allowed there (within the policy's cap), or its senders split (:func:`split_boundary`, where
    :func:`_splittable`)."""
    stages, cap = placement.stages, problem.policy.max_boundaries_per_verifier
    splittable = set(_splittable(problem, placement))
    for b in range(placement.num_stages - 1):
        group = [v for v in placement.verifiers if v.boundary == b]
        if len(group) > 1:  # a split boundary merged back on one of its sites: no split kept that one prices under
            yield from _merged(placement, group)
            continue
        if len(group) != 1 or group[0].senders:
            continue
        v = group[0]
        taken = {}
        for x in placement.verifiers:
            taken.setdefault(x.device, set()).add(x.boundary)
        others = [d for d in verifier_sites(problem, stages, b, required_directions(problem, stages, b))
                  if d != v.device and (cap is None or len(taken.get(d, ())) < cap)]
        at = placement.verifiers.index(v)
        tried = sorted(others, key=lambda d: _busy_ms(problem, placement, d, v))[:SITES_TRIED]
        for d in tried:
            moved = dataclasses.replace(v, device=d)
            yield dataclasses.replace(placement, verifiers=placement.verifiers[:at] + (moved,)
                                      + placement.verifiers[at + 1:])
        if b in splittable:
            split = split_boundary(problem, placement, b)
            if split is not None:
                yield split
            for d in tried:  # by side: one site checks the activations' senders, the other the gradients'
                yield from _by_side(placement, v, d)


def _by_side(placement: Placement, v: VerifierPlacement, other: str):
    """``placement`` with ``v``'s boundary split by side between its site and ``other``, both ways round: the
    stage before's devices (they send the activations) to one, the stage after's (the gradients) to the other.
    On swarm-t4's 8/6/7/5 blocks on four T4s, the act side on the last stage's T4 and the grad side on the first's
    prices 10,031.5 ms, against 11,962.5 unsplit; the least-busy split (``split_boundary``) puts both on one."""
    before, after = placement.stages[v.boundary].devices, placement.stages[v.boundary + 1].devices
    if "act" not in v.directions or "grad" not in v.directions or set(before) & set(after):
        return
    at = placement.verifiers.index(v)
    for first, second in ((v.device, other), (other, v.device)):
        split = (dataclasses.replace(v, device=first, senders=before), dataclasses.replace(v, device=second,
                                                                                            senders=after))
        yield dataclasses.replace(placement, verifiers=placement.verifiers[:at] + split + placement.verifiers[at + 1:])


def _merged(placement: Placement, group: list[VerifierPlacement]):
    """``placement`` with the verifiers of one boundary (``group``) merged into one watching every sender, on each
    of their sites in turn."""
    at = placement.verifiers.index(group[0])
    rest = [v for v in placement.verifiers if v not in group]
    directions = tuple(d for d in ("act", "grad") if any(d in v.directions for v in group))
    watch = tuple(d for d in ("act", "grad") if all(d in v.watch_only for v in group if d in v.directions)
                  and any(d in v.directions for v in group))
    for v in group:
        one = dataclasses.replace(v, directions=directions, watch_only=watch, senders=())
        yield dataclasses.replace(placement, verifiers=tuple(rest[:at]) + (one,) + tuple(rest[at:]))


def _splittable(problem: Problem, placement: Placement) -> list[int]:
    """The boundaries checked by one verifier watching every one of two senders or more, next to no audited
    stage (an auditor checks its stage's outputs whole: ``audit_price.audit_where``)."""
    out = []
    for b in range(placement.num_stages - 1):
        group = [v for v in placement.verifiers if v.boundary == b]
        audited = placement.stages[b].audit_every or placement.stages[b + 1].audit_every
        if len(group) == 1 and not group[0].senders and len(_senders(placement, group[0])) >= 2 \
                and required_directions(problem, placement.stages, b) and not audited:
            out.append(b)
    return out


def _senders(placement: Placement, v: VerifierPlacement) -> tuple[str, ...]:
    st = placement.stages
    return (st[v.boundary].devices if "act" in v.directions else ()) + \
        (st[v.boundary + 1].devices if "grad" in v.directions else ())


def _check_ms(problem: Problem, placement: Placement, b: int) -> float:
    """Per step, the checks of boundary ``b``'s verifiers."""
    return sum(placement.num_microbatches * checked_share(placement, v) * _verify_ms(problem, placement, v.boundary,
                                                                                      v.device)
               for v in placement.verifiers if v.boundary == b)


def _verify_ms(problem: Problem, placement: Placement, b: int, site: str) -> float:
    return problem.verify_ms(problem.raw_bytes(placement.stages[b].last_block), problem.class_of(site))


def _busy_ms(problem: Problem, placement: Placement, site: str, but: VerifierPlacement) -> float:
    """Per step, what ``site`` runs besides ``but``: its stage's passes and its other checks."""
    M, busy = placement.num_microbatches, 0.0
    for st in placement.stages:
        for dev, m in zip(st.devices, st.microbatches):
            if dev == site:
                busy += m * problem.tables(st.recompute).range_time_ms(st.first_block, st.last_block,
                                                                       problem.class_of(dev))
    for v in placement.verifiers:
        if v.device == site and v is not but:
            busy += M * checked_share(placement, v) * _verify_ms(problem, placement, v.boundary, site)
    return busy


def split_boundary(problem: Problem, placement: Placement, b: int) -> Placement | None:
    """``placement`` with boundary ``b``'s senders over its allowed sites, each to the least busy (None: one
    site would take them all, or no other site is allowed)."""
    (v,) = [x for x in placement.verifiers if x.boundary == b]
    stages = placement.stages
    allowed = verifier_sites(problem, stages, b, required_directions(problem, stages, b))
    cap = problem.policy.max_boundaries_per_verifier
    taken = {d: len({x.boundary for x in placement.verifiers if x.device == d}) for d in allowed}
    sites = [v.device] + [d for d in allowed if d != v.device and (cap is None or taken[d] < cap)]
    if len(sites) < 2:
        return None
    busy = {d: _busy_ms(problem, placement, d, v) for d in sites}
    share = {}   # sender -> its microbatches a step, summed over the directions it sends checked tensors in
    for direction, st in (("act", stages[b]), ("grad", stages[b + 1])):
        if direction in v.directions:
            for dev, m in zip(st.devices, st.microbatches):
                share[dev] = share.get(dev, 0) + m
    assigned: dict[str, list[str]] = {d: [] for d in sites}
    for sender in sorted(share, key=lambda s: -share[s]):   # longest check first; ties keep the current site
        site = min(sites, key=lambda d: busy[d] + share[sender] * _verify_ms(problem, placement, b, d))
        busy[site] += share[sender] * _verify_ms(problem, placement, b, site)
        assigned[site].append(sender)
    used = [d for d in sites if assigned[d]]
    if len(used) < 2:
        return None
    order = {s: i for i, s in enumerate(share)}
    split = tuple(dataclasses.replace(v, device=d, senders=tuple(sorted(assigned[d], key=order.__getitem__)))
                  for d in used)
    at = placement.verifiers.index(v)
    return dataclasses.replace(placement, verifiers=placement.verifiers[:at] + split + placement.verifiers[at + 1:])
