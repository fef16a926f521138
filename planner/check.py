"""An independent check of a Solution: memory on every device and verification coverage.

Written against the cost models and the cluster, not against the solver: it
imports only the solver's value types (``solution.py``, ``policy.py``) and
recomputes memory with ``cost_models.memory.stage_memory`` plus the verifier
state (an EMA reference and the received copy per checked boundary direction,
as the simulator counts it). Trust is read from the cluster's devices (their
``trusted`` flag and ``trust`` domain), not from the solver's device classes.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from cost_models import memory
from cost_models.cluster import ClusterSpec
from cost_models.training import TrainingConfig
from planner.errors import InvalidInputError
from planner.ir import BlockChain, dtype_bytes
from planner.solver.policy import VerificationPolicy
from planner.solver.solution import Solution

VERIFIER_COPIES = 2  # EMA reference + received copy, per boundary and direction


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceMemory:
    device: str
    used_bytes: int
    usable_bytes: int

    @property
    def fits(self) -> bool:
        return self.used_bytes <= self.usable_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckReport:
    """``problems`` is empty for a valid solution."""

    problems: tuple[str, ...]
    memory: tuple[DeviceMemory, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


def _boundary_bytes(chain: BlockChain, config: TrainingConfig, last_block: int) -> float:
    traced = memory.trace_dtype(chain)
    scale = (config.microbatch_size / chain.microbatch_size) * dtype_bytes(config.dtype) / dtype_bytes(traced)
    return chain.blocks[last_block].out_bytes * scale


def _structure(solution: Solution, chain: BlockChain, cluster: ClusterSpec, config: TrainingConfig) -> list[str]:
    out: list[str] = []
    if solution.num_microbatches != config.num_microbatches:
        out.append(f"solution has {solution.num_microbatches} microbatches, config {config.num_microbatches}")
    if solution.stages[0].first_block != 0 or solution.stages[-1].last_block != len(chain.blocks) - 1:
        out.append("stages do not cover every block")
    seen: set[str] = set()
    stage_hosts = {h.name for h in cluster.hosts if h.role == "worker"}
    for st in solution.stages:
        for d in st.devices:
            dev = cluster.device(d)
            if d in seen:
                out.append(f"device {d} runs more than one stage")
            if dev.host not in stage_hosts:
                out.append(f"device {d} is on a verifier-only host but runs stage {st.index}")
            seen.add(d)
    return out


def _memory(solution: Solution, chain: BlockChain, cluster: ClusterSpec,
            config: TrainingConfig) -> dict[str, int]:
    S = len(solution.stages)
    used: dict[str, int] = {}
    for st in solution.stages:
        limits = st.in_flight or tuple(memory.in_flight_microbatches(config.schedule, S, st.index, m)
                                       for m in st.microbatches)
        for d, in_flight in zip(st.devices, limits):
            br = memory.stage_memory(chain, st.first_block, st.last_block, config, in_flight,
                                     recompute=bool(st.recompute))
            used[d] = used.get(d, 0) + br.total_bytes
    for v in solution.verifiers:
        nbytes = _boundary_bytes(chain, config, solution.stages[v.boundary].last_block)
        used[v.device] = used.get(v.device, 0) + round(VERIFIER_COPIES * nbytes * len(v.directions))
    return used


def _coverage(solution: Solution, cluster: ClusterSpec, policy: VerificationPolicy) -> list[str]:
    return trust_problems(tuple(st.devices for st in solution.stages), solution.verifiers, cluster, policy)


def trust_problems(stage_devices: tuple[tuple[str, ...], ...], verifiers: Sequence[Any], cluster: ClusterSpec,
                   policy: VerificationPolicy) -> list[str]:
    """What breaks the trust policy: untrusted endpoints, boundaries an untrusted device sends on without
    a trusted verifier outside its domain. ``verifiers``: anything with boundary, device and directions
    (and ``watch_only``)."""
    out: list[str] = []
    stages = [SimpleNamespace(index=k, devices=devs) for k, devs in enumerate(stage_devices)]
    if policy.enabled and policy.trusted_endpoints:
        for st in {stages[0].index: stages[0], stages[-1].index: stages[-1]}.values():
            bad = [d for d in st.devices if not cluster.device(d).trusted]
            if bad:
                out.append(f"stage {st.index} is an endpoint but runs on untrusted {', '.join(bad)}")
    if not policy.enabled:
        return out
    by_boundary: dict[int, list] = {}
    for v in verifiers:
        by_boundary.setdefault(v.boundary, []).append(v)
    stage_devices = {d for st in stages for d in st.devices}
    load: dict[str, int] = {}
    for b in range(len(stages) - 1):
        senders = {"act": stages[b].devices, "grad": stages[b + 1].devices}
        need = [k for k, devs in senders.items() if any(not cluster.device(d).trusted for d in devs)
                and (k == "act" or policy.check_gradients)]
        for direction in need:
            # a watch-only copy is never flagged: it checks nothing
            checkers = [v for v in by_boundary.get(b, []) if direction in v.directions
                        and direction not in getattr(v, "watch_only", ())]
            if not checkers:
                out.append(f"boundary {b} ({direction}) has an untrusted sender and no verifier")
                continue
            untrusted = [d for d in senders[direction] if not cluster.device(d).trusted]
            # several verifiers may split the senders (``senders``; none named: all of them)
            watched = {d: [v for v in checkers if not getattr(v, "senders", ()) or d in v.senders] for d in untrusted}
            out.extend(f"boundary {b} ({direction}): untrusted sender {d} has no verifier"
                       for d, vs in watched.items() if not vs)
            for v in checkers:
                dev = cluster.device(v.device)
                # what needs checking is the untrusted senders' output (a stage may mix trusted replicas in)
                domains = {cluster.device(d).trust for d in untrusted if v in watched[d]}
                if not dev.trusted:
                    out.append(f"verifier {v.device} of boundary {b} is not trusted")
                if dev.trust in domains:
                    out.append(f"verifier {v.device} of boundary {b} is inside the sender's trust domain {dev.trust}")
                role = cluster.host(dev.host).role
                if policy.verifier_placement == "stage" and v.device not in stage_devices:
                    out.append(f"verifier {v.device} runs no stage (policy: stage)")
                if policy.verifier_placement == "cpu" and role != "verifier":
                    out.append(f"verifier {v.device} is not on a CPU verifier host (policy: cpu)")
    for key in {(v.device, v.boundary) for v in verifiers}:  # a boundary's share counts as the boundary
        load[key[0]] = load.get(key[0], 0) + 1
    cap = policy.max_boundaries_per_verifier
    if cap is not None:
        out.extend(f"verifier {d} checks {n} boundaries (at most {cap})" for d, n in load.items() if n > cap)
    return out


def check_solution(solution: Solution, chain: BlockChain, cluster: ClusterSpec, config: TrainingConfig,
                   policy: VerificationPolicy) -> CheckReport:
    """Recompute memory and verification coverage of ``solution``; never trusts the solver's figures.

    ``chain`` and ``config`` must be the ones the solution was made for (same
    microbatch size and count).
    """
    for st in solution.stages:
        for d in st.devices:
            cluster.device(d)  # raises naming an unknown device
    problems = _structure(solution, chain, cluster, config)
    if problems:
        return CheckReport(problems=tuple(problems), memory=())
    used = _memory(solution, chain, cluster, config)
    mem = tuple(DeviceMemory(device=d, used_bytes=b, usable_bytes=memory.usable_memory_bytes(cluster.device(d).spec))
                for d, b in used.items())
    problems += [f"device {m.device} needs {m.used_bytes / 1e9:.2f} GB, has {m.usable_bytes / 1e9:.2f} GB usable"
                 for m in mem if not m.fits]
    problems += _coverage(solution, cluster, policy)
    return CheckReport(problems=tuple(problems), memory=mem)


def assert_valid(solution: Solution, chain: BlockChain, cluster: ClusterSpec, config: TrainingConfig,
                 policy: VerificationPolicy) -> CheckReport:
    """:func:`check_solution`, raising :class:`InvalidInputError` listing the problems if any."""
    report = check_solution(solution, chain, cluster, config, policy)
    if not report.ok:
        raise InvalidInputError("solution check failed", found="; ".join(report.problems[:5]),
                                fix="re-solve; this plan breaks memory or verification rules")
    return report


# ---------------------------------------------------------------------------- the operator's trust

TRUST_HOST_KEYS = ("trust", "trusted", "role")
TRUST_POLICY_KEYS = ("enabled", "trusted_endpoints", "check_gradients", "max_boundaries_per_verifier",
                     "verifier_placement", "ban_excludes_domain")
# What a plan may not relax without the operator's word (`run --no-verify`); the rest only narrows the search.
_REQUIRED_POLICY = ("enabled", "trusted_endpoints", "check_gradients")


def _host_trust(host: Mapping[str, Any]) -> dict[str, Any]:
    return {"trust": host.get("trust"), "trusted": bool(host.get("trusted", False)),
            "role": host.get("role", "worker")}


def trust_part(cluster: Mapping[str, Any], policy: VerificationPolicy) -> dict[str, Any]:
    """The part of a cluster (``ClusterSpec.to_dict()`` form) and policy that decides who is trusted with what."""
    hosts = {h["name"]: _host_trust(h) for h in cluster.get("hosts", ()) if isinstance(h, Mapping)}
    return {"hosts": dict(sorted(hosts.items())), "policy": {k: policy.to_dict()[k] for k in TRUST_POLICY_KEYS}}


def trust_digest(cluster: Mapping[str, Any], policy: VerificationPolicy) -> str:
    """sha256 of :func:`trust_part` (canonical JSON): what a plan pins of the cluster it was made on."""
    canonical = json.dumps(trust_part(cluster, policy), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def trust_changes(plan_cluster: Mapping[str, Any], operator: Mapping[str, Any]) -> list[str]:
    """How a plan's embedded cluster differs from the operator's in who is trusted: a host's trust domain,
    ``trusted`` or ``role``; a host the operator's cluster lacks (one that joined) may only be an untrusted
    worker."""
    mine = {h["name"]: _host_trust(h) for h in operator.get("hosts", ()) if isinstance(h, Mapping)}
    out: list[str] = []
    for host in plan_cluster.get("hosts", ()):
        name, claimed = host.get("name"), _host_trust(host)
        theirs = mine.get(name)
        if theirs is None:
            if claimed["trusted"] or claimed["role"] != "worker":
                out.append(f"host {name}: not in the operator's cluster, trusted {str(claimed['trusted']).lower()} "
                           f"role {claimed['role']} in the plan")
            continue
        out.extend(f"host {name}: {key} {_shown(theirs[key])} in the operator's cluster, {_shown(claimed[key])} "
                   f"in the plan" for key in TRUST_HOST_KEYS if theirs[key] != claimed[key])
    return out


def operator_policy(plan_policy: VerificationPolicy, *, verify: bool) -> VerificationPolicy:
    """The policy a run holds a plan to: the plan's own, but never weaker than the default's checks unless the
    operator switches verification off for this run."""
    if not verify:
        return dataclasses.replace(plan_policy, enabled=False)
    return dataclasses.replace(plan_policy, **{k: True for k in _REQUIRED_POLICY})


def policy_changes(plan_policy: VerificationPolicy, operator: VerificationPolicy) -> list[str]:
    """The trust settings the plan relaxes below the operator's policy (``enabled false`` ...)."""
    mine, theirs = operator.to_dict(), plan_policy.to_dict()
    return [f"policy {k} {_shown(mine[k])} for the operator, {_shown(theirs[k])} in the plan"
            for k in _REQUIRED_POLICY if mine[k] and not theirs[k]]


def _shown(value: Any) -> str:
    return json.dumps(value)
