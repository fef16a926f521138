"""The executable plan: one program per rank plus everything needed to run and check it.

A :class:`Plan` is self-contained: it names the model (with the fingerprint of
the traced graph), embeds the cluster it was made for (``ClusterSpec.to_dict()``),
the training configuration, the verification policy and the monitors'
settings, the stages with their per-microbatch figures, the rank layout and
the programs. The simulator and the runtime need nothing else.

Rank layout: one rank per (stage, replica), stages in order and replicas in
order; then one rank per verifier device that runs no stage. Microbatch ``m``
holds samples ``[m * microbatch_size, (m + 1) * microbatch_size)`` of the step's
global batch.

On disk a plan is JSON (``plan.save``), validated against
``planner/schema/plan.schema.json``; programs are stored as lists of short
instruction strings (see ``planner.instructions``), one list per rank, so that
two plans diff line by line. ``load_plan`` (``planner.plan_load``) rejects anything malformed
before a single instruction runs.

Here: the :class:`Plan` itself, its layout checks and the queries on it. Its parts are in
``planner.plan_values``, its history in ``planner.plan_history``, its JSON form in ``planner.plan_json``.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from cost_models.cluster import ClusterSpec
from cost_models.cluster_file import parse_cluster
from cost_models.training import TrainingConfig
from planner import secret as run_secret
from planner.check import trust_digest
from planner.errors import InvalidInputError, PlanMismatchError

# The string form is documented as plan.py's too (docs/CONTRACTS.md): re-exported.
from planner.instructions import Instruction, format_instruction, parse_instruction  # noqa: F401
from planner.ir import BlockChain, TiedParam
from planner.outputs import write_atomic
from planner.plan_history import HistoryEntry
from planner.plan_json import (
    REPLAN,
    SCHEMA_VERSION,
    from_source,
    plan_fields,
    plan_to_dict,
)
from planner.plan_values import ModelRef, Predicted, RankInfo, StageInfo, VerifierInfo
from planner.solver.policy import VerificationPolicy
from planner.solver.solution import SolveReport, shared_boundary_problem
from planner.verifier_config import VerifierConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """The whole plan; see the module docstring. ``programs[r]`` is rank r's program.

    The stages' block figures are per microbatch of ``chain_microbatch_size``
    samples (the solver may have rescaled the traced chain to the configured
    microbatch); ``model.batch`` stays the batch the fingerprint was traced at.

    ``cluster`` is the cluster as given (``cluster_source`` says where it was read from: a run checks who is
    trusted against that file, or the operator's ``--cluster``, not against this copy); the plan runs on it less ``excluded_hosts`` (lost or banned
    machines, which a re-admission can put back): :meth:`effective_cluster`, which everything that runs,
    simulates or checks the plan reads. ``history``: what made the plan and every change since.
    """

    model: ModelRef
    cluster: Mapping[str, Any]
    config: TrainingConfig
    policy: VerificationPolicy
    stages: tuple[StageInfo, ...]
    ranks: tuple[RankInfo, ...]
    verifiers: tuple[VerifierInfo, ...]
    programs: tuple[tuple[Instruction, ...], ...]
    report: SolveReport
    predicted: Predicted
    chain_microbatch_size: int
    tied_params: tuple[TiedParam, ...] = ()
    verifier_config: VerifierConfig = VerifierConfig()
    excluded_hosts: tuple[str, ...] = ()
    history: tuple[HistoryEntry, ...] = ()
    cluster_source: str | None = None  # the operator's cluster file (or packaged name) the plan was made from
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.schema_version != SCHEMA_VERSION:
            raise PlanMismatchError("plan schema_version", expected=str(SCHEMA_VERSION),
                                    found=str(self.schema_version), fix="re-run `stagewise plan` with this version")
        # A JSON round trip turns tuples into lists: normalise now so load(save(p)) == p.
        object.__setattr__(self, "cluster", json.loads(json.dumps(dict(self.cluster), allow_nan=False)))
        if self.chain_microbatch_size < 1:
            raise InvalidInputError("plan chain_microbatch_size", expected=">= 1",
                                    found=str(self.chain_microbatch_size))
        self._check_excluded()
        self._check_layout()

    def _check_excluded(self) -> None:
        hosts = {h.get("name") for h in self.cluster.get("hosts", ()) if isinstance(h, Mapping)}
        if list(self.excluded_hosts) != sorted(set(self.excluded_hosts)) or not set(self.excluded_hosts) <= hosts:
            raise InvalidInputError("plan excluded_hosts", expected="distinct host names of the plan's cluster, sorted",
                                    found=repr(list(self.excluded_hosts)), fix=REPLAN)
        running = sorted({r.host for r in self.ranks} & set(self.excluded_hosts))
        if running:
            raise InvalidInputError(f"plan ranks on excluded host {running[0]}",
                                    expected="ranks on the hosts left in the plan only", found=repr(running),
                                    fix="re-plan with `stagewise replan` (it places ranks on the remaining hosts)")

    def _check_layout(self) -> None:
        next_block = 0
        for k, st in enumerate(self.stages):
            if st.index != k or st.first_block != next_block:
                raise InvalidInputError(f"plan stage {k}", expected=f"index {k} starting at block {next_block}",
                                        found=f"index {st.index} starting at block {st.first_block}")
            next_block = st.last_block + 1
        for r, info in enumerate(self.ranks):
            if info.rank != r:
                raise InvalidInputError("plan ranks", expected=f"rank {r} at position {r}", found=str(info.rank))
            if info.stage is not None and info.stage >= len(self.stages):
                raise InvalidInputError(f"rank {r} stage", expected=f"< {len(self.stages)}", found=str(info.stage))
        if len(self.programs) < len(self.ranks):
            missing = ", ".join(str(r) for r in range(len(self.programs), len(self.ranks)))
            raise InvalidInputError(f"plan programs: rank(s) {missing} have no program",
                                    expected=f"one program per rank ({len(self.ranks)})",
                                    found=f"{len(self.programs)} programs", fix="re-run `stagewise plan`")
        if len(self.programs) > len(self.ranks):
            raise InvalidInputError("plan programs", expected=f"one program per rank ({len(self.ranks)})",
                                    found=f"{len(self.programs)} programs")
        for r, prog in enumerate(self.programs):
            if not prog:
                raise InvalidInputError(f"rank {r} has no program", expected="at least one instruction",
                                        found="an empty program", fix="re-run `stagewise plan`")
        for v in self.verifiers:
            if (not 0 <= v.rank < len(self.ranks) or not 0 <= v.boundary < len(self.stages) - 1
                    or v.boundary not in self.ranks[v.rank].verifies):
                raise InvalidInputError(f"verifier of boundary {v.boundary}",
                                        expected=f"a boundary < {len(self.stages) - 1}, on a rank < "
                                                 f"{len(self.ranks)} that lists the boundary in `verifies`",
                                        found=f"rank {v.rank}")
        shared = shared_boundary_problem(self.verifiers)
        if shared:
            raise InvalidInputError("plan verifiers", expected="one verifier per boundary, or several watching "
                                    "disjoint sender subsets", found=shared, fix="re-run `stagewise plan`")
        if len(self.predicted.peak_mem_bytes) != len(self.ranks):
            raise InvalidInputError("predicted.peak_mem_bytes", expected=f"{len(self.ranks)} entries (one per rank)",
                                    found=str(len(self.predicted.peak_mem_bytes)))

    # --- queries -----------------------------------------------------------
    def effective_cluster(self) -> ClusterSpec:
        """The cluster the plan runs on: ``cluster`` less ``excluded_hosts`` (and the links only they used)."""
        return parse_cluster(self.cluster).without_hosts(set(self.excluded_hosts))

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def num_microbatches(self) -> int:
        return self.config.num_microbatches

    @property
    def schedule(self) -> str:
        return self.config.schedule

    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        """The ranks of ``stage``'s replicas, in replica order."""
        return tuple(r.rank for r in self.ranks if r.stage == stage)

    def rank_role(self, rank: int) -> str:
        """``stage 2``, ``stage 2.1`` (replica 1 of a replicated stage) or ``verifier``."""
        info = self.ranks[rank]
        if info.stage is None:
            return "verifier"
        replicated = len(self.stage_ranks(info.stage)) > 1
        return f"stage {info.stage}.{info.replica}" if replicated else f"stage {info.stage}"

    def owner(self, stage: int, mb: int) -> int:
        """The rank of the replica of ``stage`` that runs microbatch ``mb``."""
        for r in self.ranks:
            if r.stage == stage and mb in r.microbatches:
                return r.rank
        raise InvalidInputError(f"microbatch {mb} of stage {stage}", expected="a replica that runs it",
                                found="none")

    def chain(self) -> BlockChain:
        """The block chain the plan was made from (the cost models price it)."""
        return BlockChain(model_name=self.model.name, fingerprint=self.model.fingerprint,
                          blocks=tuple(b for st in self.stages for b in st.blocks),
                          input_bytes=self.stages[0].in_bytes, microbatch_size=self.chain_microbatch_size,
                          tied_params=self.tied_params, meta=(("dtype", self.model.dtype),))

    def trust_digest(self) -> str:
        """sha256 of who the plan's cluster trusts and its policy (``planner.check.trust_part``), pinned in the file."""
        return trust_digest(self.cluster, self.policy)

    def verifier(self, boundary: int) -> VerifierInfo | None:
        for v in self.verifiers:
            if v.boundary == boundary:
                return v
        return None

    # --- (de)serialisation ---------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return plan_to_dict({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "plan") -> "Plan":
        fields = plan_fields(data, source)
        with from_source(source):
            return cls(**fields)

    def save(self, path: str | os.PathLike, *, sign: bool = True, secret: bytes | None = None) -> Path:
        """Write the plan as JSON atomically (``planner.outputs``), signed with ``secret`` (default: this
        machine's run secret, ``planner.secret``) unless ``sign`` is false; non-finite numbers are refused."""
        data = self.to_dict()
        try:
            if sign:
                data["signature"] = run_secret.sign(secret or run_secret.run_secret(), data)
            text = json.dumps(data, indent=1, allow_nan=False) + "\n"
        except ValueError as exc:
            raise InvalidInputError("plan figures", expected="finite numbers", found=str(exc),
                                    fix="re-plan: a NaN or infinite figure means a broken cost input") from None
        return write_atomic(path, text)
