"""Why no plan exists, in terms the user knows: gigabytes, devices, trust domains, policy options.

:func:`precheck` catches the impossibilities visible from totals before any
search (cheap, always run). :func:`explain_infeasible` is called when the
search proved there is no plan: it re-solves relaxed problems (no trusted
endpoints, no verification) to find which requirement is to blame.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from planner.errors import InfeasiblePlanError
from planner.solver.problem import Problem

GB = 1e9


def _gb(nbytes: float) -> str:
    return f"{nbytes / GB:.1f} GB"


def _stage_classes(problem: Problem) -> list:
    return [c for c in problem.classes if c.stage_capable]


def precheck(problem: Problem) -> None:
    """Raise :class:`InfeasiblePlanError` for a problem no placement can satisfy, judged from totals."""
    stage = _stage_classes(problem)
    if not stage:
        raise InfeasiblePlanError("the cluster has no device that can run a stage",
                                  found="only CPU verifier hosts", fix="add a worker host with a GPU or CPU")
    L, pol = problem.num_blocks, problem.policy
    static = problem.range_params(0, L - 1) * problem.state_bytes_per_param
    usable = sum(c.mem_bytes * c.count for c in stage)
    if static > usable:
        raise InfeasiblePlanError(
            f"the model needs {_gb(static)} for weights, gradients and optimizer state; "
            f"the cluster's usable memory is {_gb(usable)}",
            fix="add devices, or plan with --optimizer sgd (8 fewer bytes per parameter)")
    biggest = max(c.mem_bytes for c in stage)
    for l in range(L):
        need = (problem.range_params(l, l) * problem.state_bytes_per_param + problem.range_act_bytes(l, l)
                + problem.buffer_bytes(l, l))
        if need > biggest:
            raise InfeasiblePlanError(
                f"block {problem.block_names[l]!r} alone needs {_gb(need)}; the largest device has {_gb(biggest)}",
                fix="use a finer block granularity, a smaller microbatch, or larger devices")
    if pol.enabled and pol.trusted_endpoints:
        _precheck_endpoints(problem, stage)


def _precheck_endpoints(problem: Problem, stage: list) -> None:
    trusted = [c for c in stage if c.trusted]
    if not trusted:
        raise InfeasiblePlanError(
            "the policy requires trusted first and last stages but no trusted device exists",
            found=f"{sum(c.count for c in stage)} untrusted devices",
            fix="mark a host `trusted: true`, or relax the policy (trusted_endpoints=False)")
    L = problem.num_blocks
    if sum(c.count for c in trusted) == 1:
        only = trusted[0]
        whole = (problem.range_params(0, L - 1) * problem.state_bytes_per_param + problem.range_act_bytes(0, L - 1)
                 + problem.buffer_bytes(0, L - 1))
        if whole > only.mem_bytes:
            raise InfeasiblePlanError(
                f"the policy requires trusted first and last stages, on two devices, but the cluster has one "
                f"trusted device ({only.device_ids[0]}, {only.spec.name}) and the whole model ({_gb(whole)}) does "
                f"not fit on it ({_gb(only.mem_bytes)})",
                fix="add a trusted device, or relax the policy (trusted_endpoints=False)")
    room = max(c.mem_bytes for c in trusted)
    for label, block in (("first", 0), ("last", L - 1)):
        need = (problem.range_params(block, block) * problem.state_bytes_per_param
                + problem.range_act_bytes(block, block) + problem.buffer_bytes(block, block))
        if need > room:
            raise InfeasiblePlanError(
                f"the policy requires a trusted {label} stage but no trusted device has room for it: "
                f"block {problem.block_names[block]!r} needs {_gb(need)}, the largest trusted device has "
                f"{_gb(room)}", fix="add a larger trusted device, or relax the policy (trusted_endpoints=False)")


Feasible = Callable[[Problem], bool]


def explain_infeasible(problem: Problem, feasible: Feasible) -> InfeasiblePlanError:
    """The error to raise for a problem proven infeasible; ``feasible`` re-solves a relaxed problem."""
    pol = problem.policy
    stage = _stage_classes(problem)
    # Relax one requirement at a time. A trust domain with no verifier outside it is the most
    # specific finding, so it wins when dropping verification alone also yields a plan.
    ends_ok = pol.enabled and pol.trusted_endpoints and feasible(
        dataclasses.replace(problem, policy=dataclasses.replace(pol, trusted_endpoints=False)))
    verify_ok = pol.enabled and feasible(dataclasses.replace(problem, policy=dataclasses.replace(pol, enabled=False)))
    if verify_ok:
        error = _verification_error(problem, stage)
        if not ends_ok or error.what.startswith("no verifier outside"):
            return error
    if ends_ok:
        trusted = [c for c in stage if c.trusted]
        names = ", ".join(f"{c.count}x {c.spec.name}" for c in trusted)
        return InfeasiblePlanError(
            "the policy requires trusted first and last stages but no trusted device has room for them",
            found=f"trusted devices: {names or 'none'}",
            fix="add trusted memory, plan with --optimizer sgd / --dtype bf16, or relax trusted_endpoints")
    return _memory_error(problem, stage)


def _memory_error(problem: Problem, stage: list) -> InfeasiblePlanError:
    """Memory is what rules every plan out: say whether the total, one block, or the split is short."""
    L, M = problem.num_blocks, problem.num_microbatches
    static = problem.range_params(0, L - 1) * problem.state_bytes_per_param
    acts = problem.range_act_bytes(0, L - 1)
    usable = sum(c.mem_bytes * c.count for c in stage)
    largest = max(c.mem_bytes for c in stage)
    block_need = [int(problem.param_count[l]) * problem.state_bytes_per_param + int(problem.act_bytes[l])
                  for l in range(L)]
    worst = max(range(L), key=block_need.__getitem__)
    if block_need[worst] > largest:
        return InfeasiblePlanError(
            f"block {problem.block_names[worst]} alone needs {_gb(block_need[worst])} (weights, gradients, "
            f"optimizer state and one microbatch of activations); the largest device has {_gb(largest)}",
            fix="use larger devices, smaller microbatches, --dtype bf16/fp16 or --optimizer sgd")
    devices = sum(c.count for c in stage)
    in_flight = M if problem.schedule == "gpipe" else min(M, devices, L)
    total = f"{_gb(static)} of weights, gradients and optimizer state and {_gb(acts)} of activations per microbatch"
    if static + acts > usable:
        return InfeasiblePlanError(f"no placement fits in memory: the model needs {total}; the cluster's usable "
                                   f"memory is {_gb(usable)}",
                                   fix="add devices, use smaller microbatches, --dtype bf16/fp16, or --optimizer sgd")
    return InfeasiblePlanError(
        f"no placement fits in memory: the model needs {total}, which fits in the cluster's {_gb(usable)} in "
        f"total but not split into stages: under {problem.schedule} a stage holds the activations of up to "
        f"{in_flight} microbatches in flight ({_gb(acts * in_flight)} for the whole model), and every stage "
        f"must fit on one device (at most {_gb(largest)})",
        fix="use smaller microbatches or shorter sequences (1F1B instead of GPipe), more or larger devices, "
            "--dtype bf16/fp16 (half the activation bytes), or --optimizer sgd")


def _verification_error(problem: Problem, stage: list) -> InfeasiblePlanError:
    pol = problem.policy
    sites = [c for c in problem.classes if c.trusted and (
        (c.verifier_host and pol.verifier_placement in ("any", "cpu"))
        or (c.stage_capable and pol.verifier_placement in ("any", "stage")))]
    for c in stage:
        if c.trusted:
            continue
        outside = [s for s in sites if s.domain is None or s.domain != c.domain]
        if not outside:
            domain = c.domain or f"of {c.spec.name} devices"
            return InfeasiblePlanError(
                f"no verifier outside trust domain {domain}",
                found=f"verifier placement {pol.verifier_placement!r} allows no trusted device outside it",
                fix="add a trusted device or a CPU verifier host in another domain, or change verifier_placement")
    cap = pol.max_boundaries_per_verifier
    detail = f" (at most {cap} boundaries per verifier)" if cap is not None else ""
    return InfeasiblePlanError(
        f"the untrusted devices' boundaries cannot all be checked{detail}",
        found=f"{len(sites)} kinds of trusted verifier sites under placement {pol.verifier_placement!r}",
        fix="add trusted devices or CPU verifier hosts, raise max_boundaries_per_verifier, or change "
            "verifier_placement")
