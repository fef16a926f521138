"""Compile a solver :class:`Solution` into an executable :class:`Plan`.

Steps: check that the solution fits the chain, cluster and configuration;
lay out the ranks (one per (stage, replica) in order, then one per verifier
device that runs no stage); generate the programs (``planner.schedules``,
ordered with the cost model's estimates); validate them
(``planner.validate``). ``plan.predicted`` stays zero here: the planning API
(``planner.api``) fills it by simulating the programs (``planner.simulate.predict``).
"""
from __future__ import annotations

from cost_models.cluster import ClusterSpec
from cost_models.memory import trace_dtype
from cost_models.training import TrainingConfig
from planner.errors import InvalidInputError, PlanMismatchError
from planner.instruction_costs import CostModel
from planner.ir import BlockChain
from planner.plan import Plan
from planner.plan_values import ModelRef, Predicted, RankInfo, StageInfo, VerifierInfo
from planner.schedules import build_programs, max_in_flight
from planner.solver.policy import VerificationPolicy
from planner.solver.problem_build import search_codec
from planner.solver.routing import route
from planner.solver.solution import Solution, shared_boundary_problem
from planner.validate import validate_programs
from planner.verifier_config import DIRECTIONS, VerifierConfig


def _check_inputs(solution: Solution, chain: BlockChain, cluster: ClusterSpec, config: TrainingConfig,
                  model_ref: ModelRef) -> None:
    if solution.num_microbatches != config.num_microbatches:
        raise InvalidInputError("solution microbatches", expected=f"{config.num_microbatches} "
                                f"(global batch {config.global_batch} / microbatch {config.microbatch_size})",
                                found=str(solution.num_microbatches),
                                fix="solve again with this training configuration")
    if solution.schedule != config.schedule:
        raise InvalidInputError("solution schedule", expected=config.schedule, found=solution.schedule,
                                fix="solve again with this training configuration")
    first, last = solution.stages[0].first_block, solution.stages[-1].last_block
    if first != 0 or last != len(chain.blocks) - 1:
        raise InvalidInputError(f"solution stages over {chain.model_name}",
                                expected=f"blocks 0..{len(chain.blocks) - 1}", found=f"{first}..{last}",
                                fix="solve again for this block chain")
    if chain.fingerprint != model_ref.fingerprint:
        raise PlanMismatchError("model reference", expected=f"the chain's fingerprint {chain.fingerprint[:16]}...",
                                found=f"{model_ref.fingerprint[:16]}...")
    if model_ref.dtype != trace_dtype(chain):
        raise InvalidInputError("model reference dtype",
                                expected=f"{trace_dtype(chain)} (what the chain was traced in)", found=model_ref.dtype)
    for st in solution.stages:
        for dev in st.devices:
            cluster.device(dev)  # raises naming the unknown device
    for v in solution.verifiers:
        cluster.device(v.device)
        if not 0 <= v.boundary < len(solution.stages) - 1:
            raise InvalidInputError(f"verifier on {v.device}: boundary",
                                    expected=f"0..{len(solution.stages) - 2}", found=str(v.boundary))
        if not v.directions or any(d not in DIRECTIONS for d in v.directions):
            raise InvalidInputError(f"verifier of boundary {v.boundary}: directions",
                                    expected="a non-empty subset of act, grad", found=repr(v.directions))
        sending = set(solution.stages[v.boundary].devices) | set(solution.stages[v.boundary + 1].devices)
        if not set(v.senders) <= sending:
            raise InvalidInputError(f"verifier of boundary {v.boundary} on {v.device}: senders",
                                    expected=f"devices of stages {v.boundary} and {v.boundary + 1}",
                                    found=", ".join(sorted(set(v.senders) - sending)))
    shared = shared_boundary_problem(solution.verifiers)
    if shared:
        raise InvalidInputError("solution verifiers", expected="one verifier per boundary, or several watching "
                                "disjoint sender subsets", found=shared, fix="solve again")


def _stages(solution: Solution, chain: BlockChain, config: TrainingConfig) -> tuple[StageInfo, ...]:
    out = []
    last = len(solution.stages) - 1
    for st in solution.stages:
        in_bytes = chain.input_bytes if st.first_block == 0 else chain.blocks[st.first_block - 1].out_bytes
        codec = "none" if st.index == last else st.out_codec or search_codec(config.compress)
        out.append(StageInfo(index=st.index, blocks=chain.blocks[st.first_block:st.last_block + 1],
                             in_bytes=in_bytes, recompute=bool(st.recompute), out_codec=codec,
                             allreduce_codec=st.allreduce_codec or "none", audit_every=st.audit_every))
    return tuple(out)


def _ranks(solution: Solution, cluster: ClusterSpec) -> tuple[tuple[RankInfo, ...], tuple[VerifierInfo, ...]]:
    """Stage ranks (stage order, replica order), then verifier-only ranks (first use order)."""
    S = len(solution.stages)
    rows: list[dict] = []
    rank_of_device: dict[str, int] = {}
    for st in solution.stages:
        limits = st.in_flight or tuple(max_in_flight(solution.schedule, st.index, S, n) for n in st.microbatches)
        for replica, (dev, mbs, limit) in enumerate(zip(st.devices, route(st.microbatches), limits)):
            rank_of_device.setdefault(dev, len(rows))
            rows.append(dict(rank=len(rows), device=dev, stage=st.index, replica=replica, microbatches=mbs,
                             max_in_flight=limit))
    for v in solution.verifiers:
        if v.device not in rank_of_device:
            rank_of_device[v.device] = len(rows)
            rows.append(dict(rank=len(rows), device=v.device))
    verifiers = tuple(sorted((VerifierInfo(boundary=v.boundary, rank=rank_of_device[v.device], device=v.device,
                                           directions=tuple(v.directions), watch_only=tuple(v.watch_only),
                                           senders=tuple(v.senders))
                              for v in solution.verifiers),
                             key=lambda v: (v.boundary, v.rank)))
    ranks = []
    for row in rows:
        device = cluster.device(row["device"])
        checks = tuple(dict.fromkeys(v.boundary for v in verifiers if v.rank == row["rank"]))
        ranks.append(RankInfo(host=device.host, device_type=device.type, verifies=checks, **row))
    return tuple(ranks), verifiers


def compile_plan(solution: Solution, chain: BlockChain, cluster: ClusterSpec, config: TrainingConfig,
                 policy: VerificationPolicy, model_ref: ModelRef, *,
                 verifier_config: VerifierConfig | None = None) -> Plan:
    """The executable plan of ``solution`` (see the module docstring)."""
    _check_inputs(solution, chain, cluster, config, model_ref)
    stages = _stages(solution, chain, config)
    ranks, verifiers = _ranks(solution, cluster)
    costs = CostModel(chain=chain, stage_ranges=tuple((s.first_block, s.last_block) for s in stages),
                      ranks=ranks, verifiers=verifiers, cluster=cluster, config=config,
                      recompute=tuple(s.recompute for s in stages), codecs=tuple(s.out_codec for s in stages),
                      allreduce_codecs=tuple(s.allreduce_codec for s in stages))
    programs = build_programs(solution.schedule, len(stages), ranks, verifiers, costs)
    placeholder = Predicted(step_ms=0.0, bubble_fraction=0.0, peak_mem_bytes=(0,) * len(ranks))
    plan = Plan(model=model_ref, cluster=cluster.to_dict(), config=config, policy=policy,
                verifier_config=verifier_config or VerifierConfig(), stages=stages,
                chain_microbatch_size=chain.microbatch_size, tied_params=chain.tied_params, ranks=ranks,
                verifiers=verifiers, programs=programs, report=solution.report, predicted=placeholder)
    validate_programs(plan)
    return plan
