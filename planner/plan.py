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
two plans diff line by line. ``load_plan`` rejects anything malformed before a
single instruction runs.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

import jsonschema

from cost_models.cluster import ClusterSpec
from cost_models.cluster_file import parse_cluster
from cost_models.training import TrainingConfig
from planner import secret as run_secret
from planner.errors import InvalidInputError, PlanMismatchError
from planner.instructions import (  # noqa: F401
    Instruction,
    format_instruction,
    format_program,
    parse_instruction,
    parse_program,
)
from planner.ir import Block, BlockChain, TiedParam, dtype_bytes
from planner.outputs import write_atomic
from planner.solver.policy import VerificationPolicy
from planner.solver.solution import SolveReport
from planner.verifier_config import DIRECTIONS, VerifierConfig

# 2: verifier_config holds every monitor setting; 3: stages say whether they recompute; 4: excluded hosts and history;
# 5: verifiers' watch_only directions (link test inputs)
SCHEMA_VERSION = 5
_REPLAN = "re-create the plan with `stagewise plan`"


def _check_non_negative(owner: str, obj: Any, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if value < 0:
            raise InvalidInputError(f"{owner}.{name}", expected=">= 0", found=repr(value))


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelRef:
    """Which model a plan is for: how to build it (``spec``) and the fingerprint of its trace.

    ``batch`` is the microbatch size the graph was traced at, ``dtype`` the
    dtype it was traced in (the block figures are at that size and dtype);
    ``seq`` the sequence length for language models (None otherwise).
    """

    spec: str
    name: str
    fingerprint: str
    batch: int
    seq: int | None = None
    dtype: str = "float32"

    def __post_init__(self) -> None:
        dtype_bytes(self.dtype)
        if not self.spec or not self.fingerprint:
            raise InvalidInputError("model reference", expected="a non-empty spec and fingerprint",
                                    found=f"spec={self.spec!r} fingerprint={self.fingerprint!r}")
        if self.batch < 1 or (self.seq is not None and self.seq < 1):
            raise InvalidInputError("model reference batch/seq", expected=">= 1",
                                    found=f"batch={self.batch} seq={self.seq}")


@dataclass(frozen=True, slots=True, kw_only=True)
class StageInfo:
    """Stage ``index``: a contiguous run of the chain's blocks (``planner.ir.Block``, per microbatch
    at the traced batch size).

    ``node_names``/``module_paths``/``param_names`` say what the runtime builds;
    ``boundary_nodes`` name the producers of the activation sent on.
    ``in_bytes`` is what the stage receives per microbatch (the model input
    for stage 0); ``out_bytes`` what it sends on (its last block's). Totals
    (``fwd_flops``, ``param_bytes``, ...) sum the blocks. ``recompute``: every block is checkpointed
    (its forward runs again in the backward; only block inputs stay saved).
    """

    index: int
    blocks: tuple[Block, ...]
    in_bytes: int
    recompute: bool = False

    def __post_init__(self) -> None:
        if not self.blocks:
            raise InvalidInputError(f"stage {self.index}", expected="at least one block", found="none")
        first = self.blocks[0].index
        if tuple(b.index for b in self.blocks) != tuple(range(first, first + len(self.blocks))):
            raise InvalidInputError(f"stage {self.index} blocks", expected="consecutive block indices",
                                    found=repr(tuple(b.index for b in self.blocks)))
        _check_non_negative(f"stage {self.index}", self, ("in_bytes",))

    @property
    def first_block(self) -> int:
        return self.blocks[0].index

    @property
    def last_block(self) -> int:
        return self.blocks[-1].index

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def block_names(self) -> tuple[str, ...]:
        return tuple(b.name for b in self.blocks)

    def _concat(self, name: str) -> tuple[str, ...]:
        return tuple(x for b in self.blocks for x in getattr(b, name))

    def _sum(self, name: str) -> int:
        return sum(getattr(b, name) for b in self.blocks)

    node_names = property(lambda self: self._concat("node_names"))
    module_paths = property(lambda self: tuple(dict.fromkeys(self._concat("module_paths"))))
    param_names = property(lambda self: tuple(dict.fromkeys(self._concat("param_names"))))
    boundary_nodes = property(lambda self: self.blocks[-1].boundary_nodes)
    fwd_flops = property(lambda self: self._sum("fwd_flops"))
    bwd_flops = property(lambda self: self._sum("bwd_flops"))
    param_count = property(lambda self: self._sum("param_count"))
    param_bytes = property(lambda self: self._sum("param_bytes"))
    saved_act_bytes = property(lambda self: self._sum("saved_act_bytes"))
    mem_traffic_bytes = property(lambda self: self._sum("mem_traffic_bytes"))
    out_bytes = property(lambda self: self.blocks[-1].out_bytes)


@dataclass(frozen=True, slots=True, kw_only=True)
class RankInfo:
    """One process of the plan.

    A stage rank has ``stage``/``replica`` set and runs ``microbatches``
    (ascending ids), keeping at most ``max_in_flight`` microbatches' activations
    alive at once. ``verifies`` lists the boundaries this rank checks (a
    verifier-only rank has no stage).
    """

    rank: int
    host: str
    device: str
    device_type: str
    stage: int | None = None
    replica: int | None = None
    microbatches: tuple[int, ...] = ()
    max_in_flight: int = 0
    verifies: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if (self.stage is None) != (self.replica is None):
            raise InvalidInputError(f"rank {self.rank}", expected="stage and replica both set or both null",
                                    found=f"stage={self.stage} replica={self.replica}")
        if self.stage is None and (self.microbatches or not self.verifies):
            raise InvalidInputError(f"rank {self.rank}",
                                    expected="a stage, or (verifier-only) boundaries to verify and no microbatches",
                                    found=f"microbatches={self.microbatches} verifies={self.verifies}")
        if self.stage is not None and not (1 <= self.max_in_flight <= len(self.microbatches)):
            raise InvalidInputError(f"rank {self.rank} max_in_flight",
                                    expected=f"1..{len(self.microbatches)} (its microbatch count)",
                                    found=str(self.max_in_flight))
        if list(self.microbatches) != sorted(set(self.microbatches)):
            raise InvalidInputError(f"rank {self.rank} microbatches", expected="distinct ascending ids",
                                    found=repr(self.microbatches))

    @property
    def is_verifier(self) -> bool:
        return bool(self.verifies)

    @property
    def runs_stage(self) -> bool:
        return self.stage is not None


@dataclass(frozen=True, slots=True, kw_only=True)
class VerifierInfo:
    """The verifier of boundary ``boundary`` (stage b -> b+1) runs on ``rank``. ``watch_only``: the
    directions it sees only as a link test's input (a trusted sender's), never flagging them."""

    boundary: int
    rank: int
    device: str
    directions: tuple[str, ...] = DIRECTIONS
    watch_only: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.directions or any(d not in DIRECTIONS for d in self.directions):
            raise InvalidInputError(f"verifier of boundary {self.boundary} directions",
                                    expected="a non-empty subset of act, grad", found=repr(self.directions))
        if not set(self.watch_only) <= set(self.directions):
            raise InvalidInputError(f"verifier of boundary {self.boundary} watch_only",
                                    expected=f"a subset of its directions {list(self.directions)}",
                                    found=repr(self.watch_only), fix="re-run `stagewise plan`")

    def label(self) -> str:
        """``act+grad``, or ``grad; act for the link test`` where a trusted sender's copy is only watched."""
        checked = "+".join(d for d in self.directions if d not in self.watch_only)
        watched = "+".join(self.watch_only)
        return f"{checked}; {watched} for the link test" if watched else checked


@dataclass(frozen=True, slots=True, kw_only=True)
class Predicted:
    """What the simulator predicts for one optimizer step of the compiled programs."""

    step_ms: float
    bubble_fraction: float
    peak_mem_bytes: tuple[int, ...]  # per rank

    def __post_init__(self) -> None:
        if self.step_ms < 0 or not 0.0 <= self.bubble_fraction <= 1.0:
            raise InvalidInputError("predicted metrics", expected="step_ms >= 0 and 0 <= bubble_fraction <= 1",
                                    found=f"{self.step_ms}, {self.bubble_fraction}")


HISTORY_EVENTS = ("planned", "failure", "ban", "manual", "readmit", "join")
_WHEN_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def utc_stamp(moment: datetime | None = None) -> str:
    """``moment`` (default: now) as the history's UTC time stamp, e.g. ``2026-12-03T09:34:24Z``."""
    return (moment or datetime.now(timezone.utc)).astimezone(timezone.utc).strftime(_WHEN_FORMAT)


@dataclass(frozen=True, slots=True, kw_only=True)
class HistoryEntry:
    """One step of a plan's history: what happened, to which hosts, why, when, and what the plan was before.

    ``event``: ``planned`` (the original plan), ``failure`` (re-planned after a lost host), ``ban`` (after a
    ban), ``manual`` (hosts excluded by the operator), ``readmit`` (hosts put back) or ``join`` (hosts that
    joined a running run at a checkpoint: excluded ones back, or new ones added to the cluster).
    ``excluded_hosts`` are every host the step left out (those of ``excluded_domains`` included);
    ``readmitted_hosts`` those it put back (for ``join``: those that joined). ``previous_ranks`` /
    ``previous_step_ms``: the replaced plan's rank count and simulated step (None for ``planned``).
    """

    event: str
    when_utc: str
    reason: str
    excluded_hosts: tuple[str, ...] = ()
    excluded_domains: tuple[str, ...] = ()
    readmitted_hosts: tuple[str, ...] = ()
    previous_ranks: int | None = None
    previous_step_ms: float | None = None

    def __post_init__(self) -> None:
        if self.event not in HISTORY_EVENTS:
            raise InvalidInputError("plan history event", expected=" or ".join(HISTORY_EVENTS), found=repr(self.event))
        try:
            datetime.strptime(self.when_utc, _WHEN_FORMAT)
        except (TypeError, ValueError):
            raise InvalidInputError("plan history time", expected="UTC as YYYY-MM-DDTHH:MM:SSZ",
                                    found=repr(self.when_utc)) from None
        original = self.event == "planned"
        changed = bool(self.excluded_hosts or self.readmitted_hosts)
        if original == changed or original != (self.previous_ranks is None) or \
                (self.previous_ranks is None) != (self.previous_step_ms is None):
            raise InvalidInputError(f"plan history entry {self.event!r} of {self.when_utc}",
                                    expected="the original plan with no hosts and no previous plan, or a change "
                                             "of hosts with the previous plan's ranks and step",
                                    found=f"hosts excluded {list(self.excluded_hosts)}, re-admitted "
                                          f"{list(self.readmitted_hosts)}, previous ranks {self.previous_ranks}")
        back_only = bool(self.readmitted_hosts) and not self.excluded_hosts
        if self.event == "join" and not back_only:
            raise InvalidInputError(f"plan history entry 'join' of {self.when_utc}",
                                    expected="hosts that joined and none excluded",
                                    found=f"excluded {list(self.excluded_hosts)}, joined {list(self.readmitted_hosts)}")
        if self.event != "join" and (self.event == "readmit") != back_only:
            raise InvalidInputError(f"plan history entry {self.event!r} of {self.when_utc}",
                                    expected="readmit exactly when hosts are re-admitted and none excluded",
                                    found=f"excluded {list(self.excluded_hosts)}, "
                                          f"re-admitted {list(self.readmitted_hosts)}")
        if set(self.excluded_hosts) & set(self.readmitted_hosts):
            raise InvalidInputError("plan history entry", expected="a host excluded or re-admitted, not both",
                                    found=repr(sorted(set(self.excluded_hosts) & set(self.readmitted_hosts))))

    def summary(self) -> str:
        """One line: ``2026-12-03T09:34:24Z ban: excluded vol3 (domain vol3): flagged 9 times (was 8 ranks, ...)``."""
        what = []
        if self.excluded_hosts:
            domains = f" (domain {', '.join(self.excluded_domains)})" if self.excluded_domains else ""
            what.append(f"excluded {', '.join(self.excluded_hosts)}{domains}")
        if self.readmitted_hosts:
            what.append(f"{'joined' if self.event == 'join' else 're-admitted'} {', '.join(self.readmitted_hosts)}")
        was = "" if self.previous_step_ms is None else \
            f" (was {self.previous_ranks} ranks, simulated step {self.previous_step_ms:.3f} ms)"
        return f"{self.when_utc} {self.event}: {'; '.join(what + [self.reason])}{was}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """The whole plan; see the module docstring. ``programs[r]`` is rank r's program.

    The stages' block figures are per microbatch of ``chain_microbatch_size``
    samples (the solver may have rescaled the traced chain to the configured
    microbatch); ``model.batch`` stays the batch the fingerprint was traced at.

    ``cluster`` is the cluster as given; the plan runs on it less ``excluded_hosts`` (lost or banned
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
                                    found=repr(list(self.excluded_hosts)), fix=_REPLAN)
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
        seen: set[int] = set()
        for v in self.verifiers:
            if (not 0 <= v.rank < len(self.ranks) or not 0 <= v.boundary < len(self.stages) - 1
                    or v.boundary in seen or v.boundary not in self.ranks[v.rank].verifies):
                raise InvalidInputError(f"verifier of boundary {v.boundary}",
                                        expected=f"one per boundary < {len(self.stages) - 1}, on a rank < "
                                                 f"{len(self.ranks)} that lists the boundary in `verifies`",
                                        found=f"rank {v.rank}")
            seen.add(v.boundary)
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

    def verifier(self, boundary: int) -> VerifierInfo | None:
        for v in self.verifiers:
            if v.boundary == boundary:
                return v
        return None

    # --- (de)serialisation ---------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return _plan_to_dict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "plan") -> "Plan":
        return _plan_from_dict(data, source)

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


# --- dict conversion --------------------------------------------------------------

def _plain(obj: Any) -> dict[str, Any]:
    """A flat value dataclass as a JSON-ready dict (tuples become lists)."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def _plan_to_dict(plan: Plan) -> dict[str, Any]:
    return {
        "schema_version": plan.schema_version,
        "model": _plain(plan.model),
        "cluster": plan.cluster,
        "excluded_hosts": list(plan.excluded_hosts),
        "config": plan.config.to_dict(),
        "policy": plan.policy.to_dict(),
        "verifier_config": plan.verifier_config.to_dict(),
        "stages": [{"index": st.index, "in_bytes": st.in_bytes, "recompute": st.recompute,
                    "blocks": [_plain(b) for b in st.blocks]} for st in plan.stages],
        "chain_microbatch_size": plan.chain_microbatch_size,
        "tied_params": [_plain(t) for t in plan.tied_params],
        "ranks": [_plain(r) for r in plan.ranks],
        "verifiers": [_plain(v) for v in plan.verifiers],
        "programs": [list(format_program(p)) for p in plan.programs],
        "report": _plain(plan.report),
        "predicted": _plain(plan.predicted),
        "history": [_plain(e) for e in plan.history],
    }


def _tupled(d: Mapping[str, Any]) -> dict[str, Any]:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}


def _plan_from_dict(data: Mapping[str, Any], source: str) -> Plan:
    if not isinstance(data, Mapping):
        raise InvalidInputError(f"{source}", expected="a JSON object", found=type(data).__name__)
    data = {k: v for k, v in data.items() if k != "signature"}  # the file's, checked by the runtime
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise PlanMismatchError(f"{source}: schema_version", expected=str(SCHEMA_VERSION), found=repr(version),
                                fix="re-create the plan with this version of stagewise (`stagewise plan`)")
    _validate_schema(data, source)
    try:
        programs = []
        for r, texts in enumerate(data["programs"]):
            try:
                programs.append(parse_program(texts))
            except InvalidInputError as exc:
                raise InvalidInputError(f"{source}: $.programs[{r}]: {exc.what}", expected=exc.expected,
                                        found=exc.found, fix=exc.fix or _REPLAN) from None
        return Plan(
            schema_version=version,
            model=ModelRef(**data["model"]),
            cluster=data["cluster"],
            excluded_hosts=tuple(data["excluded_hosts"]),
            config=TrainingConfig.from_dict(data["config"]),
            policy=VerificationPolicy.from_dict(data["policy"]),
            verifier_config=VerifierConfig.from_dict(data["verifier_config"]),
            stages=tuple(StageInfo(index=st["index"], in_bytes=st["in_bytes"], recompute=st["recompute"],
                                   blocks=tuple(Block(**_tupled(b)) for b in st["blocks"]))
                         for st in data["stages"]),
            chain_microbatch_size=data["chain_microbatch_size"],
            tied_params=tuple(TiedParam(**_tupled(t)) for t in data["tied_params"]),
            ranks=tuple(RankInfo(**_tupled(r)) for r in data["ranks"]),
            verifiers=tuple(VerifierInfo(**_tupled(v)) for v in data["verifiers"]),
            programs=tuple(programs),
            report=SolveReport(**_tupled(data["report"])),
            predicted=Predicted(**_tupled(data["predicted"])),
            history=tuple(HistoryEntry(**_tupled(e)) for e in data["history"]),
        )
    except InvalidInputError as exc:
        if exc.what.startswith(source):
            raise
        raise type(exc)(f"{source}: {exc.what}", expected=exc.expected, found=exc.found,
                        fix=exc.fix or _REPLAN) from None


@functools.lru_cache(maxsize=1)
def plan_schema() -> dict[str, Any]:
    """The JSON Schema shipped as package data (planner/schema/plan.schema.json)."""
    text = resources.files("planner").joinpath("schema/plan.schema.json").read_text(encoding="utf-8")
    return json.loads(text)


def _validate_schema(data: Mapping[str, Any], source: str) -> None:
    validator = jsonschema.Draft202012Validator(plan_schema())
    error = jsonschema.exceptions.best_match(validator.iter_errors(data))
    if error is not None:
        raise InvalidInputError(f"{source}: {error.json_path}: {error.message}",
                                fix="re-create the plan with `stagewise plan` (hand edits must follow "
                                    "planner/schema/plan.schema.json)")

