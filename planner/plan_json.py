"""A plan's JSON form: its fields as a JSON-ready dict and back, checked against the shipped schema.

Works on the plan's fields (a mapping of field name to value), not on :class:`planner.plan.Plan`,
which builds itself from them: the class's ``to_dict`` / ``from_dict`` call this module.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from collections.abc import Iterator, Mapping
from importlib import resources
from typing import Any

import jsonschema

from cost_models.training import TrainingConfig
from planner.check import trust_digest
from planner.errors import InvalidInputError, PlanMismatchError
from planner.instructions import format_program, parse_program
from planner.ir import Block, TiedParam
from planner.plan_history import HistoryEntry
from planner.plan_values import ModelRef, Predicted, RankInfo, StageInfo, VerifierInfo
from planner.solver.policy import VerificationPolicy
from planner.solver.solution import SolveReport
from planner.verifier_config import VerifierConfig

# 2: verifier_config holds every monitor setting; 3: stages say whether they recompute; 4: excluded hosts and history;
# 5: verifiers' watch_only directions (link test inputs); 6: the policy's audit_within_steps; 7: blocks' bwd_input_flops
# (the input gradients' share of the backward, which prices an audit's recompute).
# Any change to plan.schema.json bumps it (tests/unit/test_schema_version.py pins the schema's hash to it), so
# another version of stagewise refuses a plan by its version, naming which side to upgrade, not by a schema error.
SCHEMA_VERSION = 7
REPLAN = "re-create the plan with `stagewise plan`"


def _plain(obj: Any) -> dict[str, Any]:
    """A flat value dataclass as a JSON-ready dict (tuples become lists)."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def _verifier_dict(v: VerifierInfo) -> dict[str, Any]:
    """A verifier's dict; ``senders`` only where it watches some of them (plans before it stay as they were)."""
    out = _plain(v)
    if not v.senders:
        del out["senders"]
    return out


def plan_to_dict(plan: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON-ready dict of a plan's fields (``plan``: field name -> value)."""
    return {
        "schema_version": plan["schema_version"],
        "model": _plain(plan["model"]),
        "cluster": plan["cluster"],
        "excluded_hosts": list(plan["excluded_hosts"]),
        "config": plan["config"].to_dict(),
        "policy": plan["policy"].to_dict(),
        "verifier_config": plan["verifier_config"].to_dict(),
        "stages": [{"index": st.index, "in_bytes": st.in_bytes, "recompute": st.recompute,
                    "out_codec": st.out_codec, "allreduce_codec": st.allreduce_codec,
                    "audit_every": st.audit_every,
                    "blocks": [_plain(b) for b in st.blocks]} for st in plan["stages"]],
        "chain_microbatch_size": plan["chain_microbatch_size"],
        "tied_params": [_plain(t) for t in plan["tied_params"]],
        "ranks": [_plain(r) for r in plan["ranks"]],
        "verifiers": [_verifier_dict(v) for v in plan["verifiers"]],
        "programs": [list(format_program(p)) for p in plan["programs"]],
        "report": _plain(plan["report"]),
        "predicted": _plain(plan["predicted"]),
        "history": [_plain(e) for e in plan["history"]],
        "cluster_source": plan["cluster_source"],
        "trust_digest": trust_digest(plan["cluster"], plan["policy"]),
    }


def _tupled(d: Mapping[str, Any]) -> dict[str, Any]:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}


@contextlib.contextmanager
def from_source(source: str) -> Iterator[None]:
    """Bad input met inside is reported as ``source``'s (the file's), with how to re-create the plan."""
    try:
        yield
    except InvalidInputError as exc:
        if exc.what.startswith(source):
            raise
        raise type(exc)(f"{source}: {exc.what}", expected=exc.expected, found=exc.found,
                        fix=exc.fix or REPLAN) from None


def plan_fields(data: Mapping[str, Any], source: str) -> dict[str, Any]:
    """A plan's fields (field name -> value) from its JSON form ``data``, read from ``source``; checked
    against the schema first, and every part checked as it is built."""
    if not isinstance(data, Mapping):
        raise InvalidInputError(f"{source}", expected="a JSON object", found=type(data).__name__)
    data = {k: v for k, v in data.items() if k != "signature"}  # the file's, checked by the runtime
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        newer = isinstance(version, int) and version > SCHEMA_VERSION
        raise PlanMismatchError(f"{source}: schema_version", expected=str(SCHEMA_VERSION), found=repr(version),
                                fix="a newer stagewise wrote it: upgrade this one (`pip install -U stagewise`) "
                                    "or re-create the plan with it (`stagewise plan`)" if newer else
                                "re-create the plan with this version of stagewise (`stagewise plan`)")
    _validate_schema(data, source)
    with from_source(source):
        programs = []
        for r, texts in enumerate(data["programs"]):
            try:
                programs.append(parse_program(texts))
            except InvalidInputError as exc:
                raise InvalidInputError(f"{source}: $.programs[{r}]: {exc.what}", expected=exc.expected,
                                        found=exc.found, fix=exc.fix or REPLAN) from None
        return {
            "schema_version": version,
            "model": ModelRef(**data["model"]),
            "cluster": data["cluster"],
            "excluded_hosts": tuple(data["excluded_hosts"]),
            "config": TrainingConfig.from_dict(data["config"]),
            "policy": VerificationPolicy.from_dict(data["policy"]),
            "verifier_config": VerifierConfig.from_dict(data["verifier_config"]),
            "stages": tuple(StageInfo(index=st["index"], in_bytes=st["in_bytes"], recompute=st["recompute"],
                                   out_codec=st.get("out_codec", "none"),
                                   allreduce_codec=st.get("allreduce_codec", "none"),
                                   audit_every=st.get("audit_every", 0),
                                   blocks=tuple(Block(**_tupled(b)) for b in st["blocks"]))
                         for st in data["stages"]),
            "chain_microbatch_size": data["chain_microbatch_size"],
            "tied_params": tuple(TiedParam(**_tupled(t)) for t in data["tied_params"]),
            "ranks": tuple(RankInfo(**_tupled(r)) for r in data["ranks"]),
            "verifiers": tuple(VerifierInfo(**_tupled(v)) for v in data["verifiers"]),
            "programs": tuple(programs),
            "report": SolveReport(**_tupled(data["report"])),
            "predicted": Predicted(**_tupled(data["predicted"])),
            "history": tuple(HistoryEntry(**_tupled(e)) for e in data["history"]),
            "cluster_source": data.get("cluster_source"),  # absent in older plans
        }



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
