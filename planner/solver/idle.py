"""Why a plan leaves devices idle: one line per kind of idle device (type, trust, region), for the report.

For a representative device of each kind the reasons are tried in order:
it cannot hold the smallest stage (memory); no stage of the plan may take it
as a replica, each stage's rule named (trust: an end stage; verification: no
verifier site for the stage with it, its verifiers placed again; memory with
the stage's state); or, joining
any stage as one more replica, the compiled programs would cost more: the
best such step is given with what paces it (a link of the device's, its own
stage's speed, a verifier's checks, or the all-reduce it joins).
"""
from __future__ import annotations

import dataclasses

from planner.solver.objective import (
    Placement,
    evaluate,
    even_split,
    price_program,
    stage_memory_bytes,
    violations,
)
from planner.solver.problem import Problem
from planner.solver.verifiers import assign_verifiers


def _kinds(problem: Problem, placement: Placement) -> dict[tuple, list[str]]:
    used = {d for st in placement.stages for d in st.devices}
    kinds: dict[tuple, list[str]] = {}
    for c in problem.classes:
        if not c.stage_capable:
            continue
        region = c.name.split("@")[-1]
        for d in c.device_ids:
            if d not in used:
                kinds.setdefault((c.spec.name, c.trusted, region), []).append(d)
    return kinds


def _with_replica(placement: Placement, k: int, device: str) -> Placement:
    st = placement.stages[k]
    M = placement.num_microbatches
    grown = dataclasses.replace(st, devices=st.devices + (device,), microbatches=even_split(M, len(st.devices) + 1),
                                in_flight=())
    return dataclasses.replace(placement, stages=placement.stages[:k] + (grown,) + placement.stages[k + 1:])


def _reverified(problem: Problem, placement: Placement) -> Placement | None:
    """``placement`` with its verifiers placed again for its stages (None: some boundary has no site)."""
    verifiers = assign_verifiers(problem, placement.stages, placement.num_microbatches)
    return None if verifiers is None else dataclasses.replace(placement, verifiers=verifiers)


def _why_not(problem: Problem, placement: Placement, k: int, device: str, grown: Placement | None) -> str:
    """The rule that keeps ``device`` out of stage ``k`` as one more replica: trust, verifier sites or memory."""
    cls, pol, last = problem.classes[problem.class_of(device)], problem.policy, placement.num_stages - 1
    if pol.enabled and pol.trusted_endpoints and not cls.trusted and k in (0, last):
        return "trust: the end stages take trusted devices only"
    if grown is None:
        return (f"verification: no trusted verifier outside its trust domain can check stage {k} with it (verifiers "
                "sit on the trusted devices of the stages at a boundary, of the first or last stage, or on CPU verifier "
                "hosts)")
    broken = violations(problem, grown)
    if any("memory" in v for v in broken):
        return f"memory: stage {k} with its state does not fit it"
    return broken[0] if broken else "no rule"


PRICED_TRIES = 24  # programs priced in all (each is a plan of the whole cluster): the stages tried per kind


def idle_reasons(problem: Problem, placement: Placement, step_ms: float) -> tuple[str, ...]:
    """One line per kind of idle device (see the module docstring)."""
    out = []
    kinds = _kinds(problem, placement)
    per_kind = max(1, PRICED_TRIES // max(1, len(kinds)))
    for (name, trusted, region), devices in kinds.items():
        d = devices[0]
        cls = problem.classes[problem.class_of(d)]
        head = f"idle: {len(devices)} x {name} ({'trusted' if trusted else 'untrusted'}, {region})"
        smallest = min(stage_memory_bytes(problem, st, placement.num_stages, 1) for st in placement.stages)
        if smallest > cls.mem_bytes:
            out.append(f"{head}: memory, the smallest stage needs {smallest / 1e9:.1f} GB, it has "
                       f"{cls.mem_bytes / 1e9:.1f} GB usable")
            continue
        ks = [k for k in range(placement.num_stages) if len(placement.stages[k].devices) < placement.num_microbatches]
        tries = [_reverified(problem, _with_replica(placement, k, d)) for k in ks]
        valid = [p for p in tries if p is not None and not violations(problem, p)]
        if not valid:
            why = "; ".join(dict.fromkeys(_why_not(problem, placement, k, d, p) for k, p in zip(ks, tries))) \
                or "every stage already runs a replica per microbatch"
            out.append(f"{head}: no stage can take it as a replica ({why})")
            continue
        # the stages whose closed form it helps most are tried first
        valid.sort(key=lambda p: evaluate(problem, p).step_ms)
        best, grown = min(((price_program(problem, p), p) for p in valid[:per_kind]), key=lambda x: x[0].step_ms)
        tried = "any stage" if len(valid) <= per_kind else \
            "the likeliest stage" if per_kind == 1 else f"the {per_kind} likeliest stages"
        out.append(f"{head}: as one more replica of {tried} the step would be {best.step_ms:.1f} ms, not "
                   f"{step_ms:.1f} ({_binding(problem, placement, grown, best, d)})")
    return tuple(out)


def _binding(problem: Problem, placement: Placement, grown: Placement, cost, device: str) -> str:
    """What paces the plan with ``device`` in it: its links, its speed, the checks, or the all-reduce it joins."""
    name = cost.bottleneck
    if name.startswith("link") and device in name:
        return f"links: {name} paces the step"
    if name.startswith("stage") and name.endswith(f"on {device}"):
        return f"speed: its {name.split(' on ')[0]} paces the step"
    if name.startswith(("verifier", "checks")):
        return f"verification: {name} paces the step"
    before = price_program(problem, placement)
    if cost.step_ms - cost.pipe_ms > before.step_ms - before.pipe_ms + 1e-9:
        return (f"links: the all-reduce it joins adds {cost.step_ms - cost.pipe_ms:.1f} ms after the pipeline "
                f"({before.step_ms - before.pipe_ms:.1f} without it)")
    return f"{name} paces the step"
