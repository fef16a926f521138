"""The greedy verifier assignment every search and baseline shares: allowed sites, cheapest first."""
from __future__ import annotations

from planner.solver.objective import Placement, evaluate, required_directions
from planner.solver.problem import Problem
from planner.solver.solution import StagePlacement, VerifierPlacement


def verifier_sites(problem: Problem, stages: tuple[StagePlacement, ...], boundary: int,
                   need: tuple[str, ...]) -> tuple[str, ...]:
    """Devices allowed to check ``boundary`` (in the solver's search space), cheapest-first order not implied.

    The ends of the boundary, the first and the last stage (single-replica
    stages only), and CPU verifier hosts; each trusted, outside the checked
    senders' trust domain, and allowed by the policy's placement.
    """
    S, pol = len(stages), problem.policy
    senders = (stages[boundary].devices if "act" in need else ()) + \
        (stages[boundary + 1].devices if "grad" in need else ())
    domains = {problem.classes[problem.class_of(d)].domain for d in senders} - {None}
    out: list[str] = []
    if pol.verifier_placement in ("any", "stage"):
        for k in dict.fromkeys((boundary, boundary + 1, 0, S - 1)):
            if len(stages[k].devices) == 1:
                out.append(stages[k].devices[0])
    if pol.verifier_placement in ("any", "cpu"):
        out.extend(d for c in problem.classes if c.verifier_host for d in c.device_ids)
    ok = []
    for d in dict.fromkeys(out):
        c = problem.classes[problem.class_of(d)]
        if c.trusted and (c.domain is None or c.domain not in domains):
            ok.append(d)
    return tuple(ok)


def assign_verifiers(problem: Problem, stages: tuple[StagePlacement, ...],
                     num_microbatches: int) -> tuple[VerifierPlacement, ...] | None:
    """Greedy: each checked boundary, in order, takes the site that raises the step time least.

    Returns None when some boundary has no allowed site left.
    """
    base = evaluate(problem, Placement(stages=stages, verifiers=(), num_microbatches=num_microbatches))
    t = list(base.stage_ms)
    stage_of = {d: k for k, st in enumerate(stages) for d in st.devices}
    load: dict[str, float] = {}
    count: dict[str, int] = {}
    cap = problem.policy.max_boundaries_per_verifier
    M, chosen = num_microbatches, []
    for b in range(len(stages) - 1):
        need = required_directions(problem, stages, b)
        if not need:
            continue
        nbytes = problem.boundary_bytes(stages[b].last_block)
        best: tuple[float, str, dict[int, float], float] | None = None
        sites = verifier_sites(problem, stages, b, need)
        prev = chosen[-1].device if chosen and chosen[-1].boundary == b - 1 else None
        if prev in sites:  # on a tie keep the previous boundary's verifier: its link test sees both sides
            sites = (prev, *(v for v in sites if v != prev))
        for v in sites:
            if cap is not None and count.get(v, 0) >= cap:
                continue
            add: dict[int, float] = {}
            vcost = len(need) * problem.verify_ms(nbytes, problem.class_of(v))
            if v in stage_of:
                add[stage_of[v]] = add.get(stage_of[v], 0.0) + vcost
            for direction, src, dst in (("act", b, b + 1), ("grad", b + 1, b)):
                if direction in need and stages[dst].devices != (v,):
                    for dev, m in zip(stages[src].devices, stages[src].microbatches):
                        if dev != v:
                            add[src] = add.get(src, 0.0) + m / M * problem.transfer_ms(nbytes, dev, v)
            new_load = load.get(v, 0.0) + (vcost if v not in stage_of else 0.0)
            new_t = {k: t[k] + dt for k, dt in add.items()}
            peak = max([max(t)] + list(new_t.values()) + [new_load] + list(load.values()))
            score = sum(add.values()) + (M - 1) * peak
            if best is None or score < best[0] - 1e-12:
                best = (score, v, new_t, new_load)
        if best is None:
            return None
        _, v, new_t, new_load = best
        for k, val in new_t.items():
            t[k] = val
        if v not in stage_of:
            load[v] = new_load
        count[v] = count.get(v, 0) + 1
        chosen.append(VerifierPlacement(boundary=b, device=v, directions=need))
    return tuple(chosen)
