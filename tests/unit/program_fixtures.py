"""Random valid placements on random wide-area clusters, compiled into plans (for the one-cost tests)."""
from __future__ import annotations

import dataclasses

import numpy as np

from cost_models.cluster import ClusterSpec
from cost_models.cluster_file import parse_cluster
from cost_models.memory import trace_dtype
from cost_models.training import TrainingConfig
from planner.compile import compile_plan
from planner.plan_values import ModelRef
from planner.simulate import predict
from planner.solver.objective import Placement, even_split, price_program, violations
from planner.solver.policy import VerificationPolicy
from planner.solver.problem_build import build_problem, scale_chain
from planner.solver.solution import (
    Solution,
    SolveReport,
    StagePlacement,
    VerifierPlacement,
)
from tests.unit.solver_fixtures import GPU_TYPES, random_chain

POLICY = VerificationPolicy(trusted_endpoints=False)


def wide_area_cluster(rng: np.random.Generator, num_devices: int) -> ClusterSpec:
    """Hosts of 1-4 GPUs of random types in 2-4 regions joined by slow links; some untrusted; a CPU verifier."""
    regions = [f"r{i}" for i in range(int(rng.integers(2, 5)))]
    kinds = list(rng.choice(GPU_TYPES, size=3, replace=False))
    hosts, left, i = [], num_devices, 0
    while left > 0:
        n = int(min(left, rng.integers(1, 5)))
        trusted = i == 0 or rng.random() < 0.4
        hosts.append({"name": f"h{i}", "region": str(rng.choice(regions)), "trust": "op" if trusted else f"v{i}",
                      "trusted": bool(trusted), "devices": [{"type": str(rng.choice(kinds)), "count": n}]})
        left, i = left - n, i + 1
    hosts.append({"name": "verifier", "region": regions[0], "trust": "op", "trusted": True, "role": "verifier",
                  "devices": [{"type": "CPU", "count": 1}]})
    used = sorted({h["region"] for h in hosts})
    pairs = [{"between": [a, b], "bandwidth_gbps": float(rng.choice([0.2, 1.0, 5.0])),
              "latency_ms": float(rng.choice([5.0, 40.0, 120.0]))}
             for j, a in enumerate(used) for b in used[j + 1:]]
    links = {"intra_host": {"bandwidth_gbps": 100.0, "latency_ms": 0.01},
             "default": {"bandwidth_gbps": 10.0, "latency_ms": 1.0}, "regions": pairs}
    return parse_cluster({"name": "wide", "hosts": hosts, "links": links})


def stages_of(cuts: list[int], counts: list[int], order: list[str], L: int, M: int) -> list[StagePlacement]:
    """Stages of ``L`` blocks cut at ``cuts``, stage k on the next ``counts[k]`` devices of ``order`` (at
    most ``M``), the microbatches split evenly among them."""
    stages, start = [], 0
    for k, (a, b) in enumerate(zip([0] + cuts, cuts + [L])):
        devs = tuple(order[start:start + min(counts[k], M)])
        start += counts[k]
        stages.append(StagePlacement(index=k, first_block=a, last_block=b - 1, devices=devs,
                                     microbatches=even_split(M, len(devs))))
    return stages


def random_placement(rng: np.random.Generator, problem, cluster: ClusterSpec) -> Placement | None:
    """Contiguous stages on shuffled devices with uneven replica counts, a verifier per checked boundary."""
    L, M = problem.num_blocks, problem.num_microbatches
    gpus = [d.id for h in cluster.hosts if h.role == "worker" for d in h.devices]
    S = int(rng.integers(2, min(6, L, len(gpus)) + 1))
    cuts = sorted(rng.choice(np.arange(1, L), size=S - 1, replace=False).tolist())
    order = list(rng.permutation(gpus))
    counts = [1] * S
    for _ in range(int(rng.integers(0, len(gpus) - S + 1))):
        counts[int(rng.integers(S))] += 1
    stages = stages_of(cuts, counts, order, L, M)
    verifiers = []
    for b in range(S - 1):
        need = tuple(d for d, st in (("act", stages[b]), ("grad", stages[b + 1]))
                     if any(not cluster.device(x).trusted for x in st.devices))
        if need:
            pick = "verifier/0" if rng.random() < 0.5 else next(
                (d for d in stages[0].devices + stages[-1].devices if cluster.device(d).trusted), "verifier/0")
            verifiers.append(VerifierPlacement(boundary=b, device=pick, directions=need))
    placement = Placement(stages=tuple(stages), verifiers=tuple(verifiers), num_microbatches=M)
    return None if violations(problem, placement) else placement


def compiled_case(seed: int, *, schedule: str = "1f1b"):
    """(placement's priced program, compiled plan) of a random valid placement, or None if the draw fails."""
    rng = np.random.default_rng(seed)
    cluster = wide_area_cluster(rng, int(rng.integers(4, 14)))
    chain = random_chain(rng, int(rng.integers(6, 20)), param_scale=float(rng.choice([2e7, 1e8])), act_scale=5e7,
                         out_scale=float(rng.choice([1e6, 1e7])))
    config = TrainingConfig(global_batch=int(rng.choice([8, 16, 32])), microbatch_size=1, schedule=schedule)
    problem = build_problem(scale_chain(chain, 1), cluster, config, POLICY)
    placement = random_placement(rng, problem, cluster)
    if placement is None:
        return None
    return _compiled(problem, placement, chain, cluster, config, POLICY)


def untrusted_pool(rng: np.random.Generator) -> ClusterSpec:
    """A SENTINEL-like pool in small: one trusted host of 2-4 GPUs, 2-5 volunteer hosts of 1-2 GPUs (two
    types), each its own trust domain, no CPU verifier host: only the trusted GPUs can verify."""
    hosts = [{"name": "dc", "region": "dc", "trust": "op", "trusted": True,
              "devices": [{"type": str(rng.choice(["A100-80GB", "A100-40GB", "RTX3090"])),
                           "count": int(rng.integers(2, 5))}]}]
    kinds = list(rng.choice(GPU_TYPES, size=2, replace=False))
    for i in range(int(rng.integers(2, 6))):
        hosts.append({"name": f"v{i}", "region": f"r{i % 2}", "trust": f"v{i}",
                      "devices": [{"type": str(rng.choice(kinds)), "count": int(rng.integers(1, 3))}]})
    links = {"intra_host": {"bandwidth_gbps": 100.0, "latency_ms": 0.01},
             "default": {"bandwidth_gbps": float(rng.choice([0.2, 1.0, 5.0])),
                         "latency_ms": float(rng.choice([1.0, 5.0, 40.0]))}}
    return parse_cluster({"name": "pool", "hosts": hosts, "links": links})


def untrusted_problem(rng: np.random.Generator, blocks: tuple[int, int]):
    """(cluster, chain, config, policy, problem): an ``untrusted_pool``, a random chain of ``blocks`` (low,
    high) blocks of 2e7-1e8 parameters, microbatches of one sample, the default policy."""
    cl = untrusted_pool(rng)
    ch = random_chain(rng, int(rng.integers(*blocks)), param_scale=float(rng.choice([2e7, 1e8])), act_scale=5e7,
                      out_scale=float(rng.choice([1e6, 1e7])))
    cfg = TrainingConfig(global_batch=int(rng.choice([8, 16, 32])), microbatch_size=1)
    policy = VerificationPolicy()
    return cl, ch, cfg, policy, build_problem(scale_chain(ch, 1), cl, cfg, policy)


def replicated_untrusted_case(seed: int, *, split: bool = False, max_stages: int = 5):
    """(priced program, compiled plan) of trusted replicated ends around replicated untrusted middle stages,
    verifiers placed by the solver's greedy (on the trusted stage devices), or None if the draw fails.
    ``split``: every boundary with several senders split over its allowed sites
    (``shared_verifiers.split_boundary``), whether or not that pays; None where none splits."""
    from planner.solver.shared_verifiers import split_boundary
    drawn = replicated_untrusted_placement(seed, max_stages=max_stages)
    if drawn is None:
        return None
    problem, placement, chain, cluster, config, policy = drawn
    if split:
        unsplit = placement
        for b in range(placement.num_stages - 1):
            if sum(v.boundary == b for v in placement.verifiers) == 1:
                placement = split_boundary(problem, placement, b) or placement
        if placement == unsplit:
            return None
    if violations(problem, placement):
        return None
    return _compiled(problem, placement, chain, cluster, config, policy)


def replicated_untrusted_placement(seed: int, *, max_stages: int = 5):
    """(problem, placement, chain, cluster, config, policy) of :func:`replicated_untrusted_case` before any
    split, or None if the draw fails."""
    from planner.solver.verifiers import assign_verifiers
    rng = np.random.default_rng(seed)
    cluster = untrusted_pool(rng)
    chain = random_chain(rng, int(rng.integers(6, 16)), param_scale=float(rng.choice([2e7, 1e8])), act_scale=5e7,
                         out_scale=float(rng.choice([1e6, 1e7])))
    config = TrainingConfig(global_batch=int(rng.choice([8, 16, 32])), microbatch_size=1)
    policy = VerificationPolicy()
    problem = build_problem(scale_chain(chain, 1), cluster, config, policy)
    L, M = problem.num_blocks, problem.num_microbatches
    trusted = [d.id for d in cluster.hosts[0].devices]
    untrusted = [d.id for h in cluster.hosts[1:] for d in h.devices]
    S = int(rng.integers(3, min(max_stages, L) + 1))
    cuts = sorted(rng.choice(np.arange(1, L), size=S - 1, replace=False).tolist())
    cut = int(rng.integers(1, len(trusted)))
    groups = [trusted[:cut], *(list(g) for g in np.array_split(rng.permutation(untrusted), S - 2)), trusted[cut:]]
    if any(not g for g in groups):
        return None
    order = [str(d) for g in groups for d in g]
    stages = tuple(stages_of(cuts, [len(g) for g in groups], order, L, M))
    verifiers = assign_verifiers(problem, stages, M)
    if verifiers is None:
        return None
    placement = Placement(stages=stages, verifiers=verifiers, num_microbatches=M)
    if violations(problem, placement):
        return None
    return problem, placement, chain, cluster, config, policy


def _compiled(problem, placement: Placement, chain, cluster: ClusterSpec, config: TrainingConfig,
              policy: VerificationPolicy):
    priced = price_program(problem, placement)
    stages = tuple(dataclasses.replace(st, in_flight=n) for st, n in zip(placement.stages, priced.in_flight))
    report = SolveReport(method="random", status="FEASIBLE", objective_ms=priced.step_ms, bound_ms=None, gap=None,
                         solve_s=0.0)
    sol = Solution(stages=stages, verifiers=placement.verifiers, num_microbatches=placement.num_microbatches,
                   schedule=config.schedule, predicted_step_ms=priced.step_ms, memory_bytes=(), report=report)
    ref = ModelRef(spec="tests:chain", name=chain.model_name, fingerprint=chain.fingerprint,
                   batch=chain.microbatch_size, dtype=trace_dtype(chain))
    return priced, predict(compile_plan(sol, scale_chain(chain, 1), cluster, config, policy, ref))
