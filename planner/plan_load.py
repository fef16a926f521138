"""Reading a plan file: schema, programs and (optionally) the model's fingerprint."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cost_models.cluster import ClusterSpec
from cost_models.cluster_file import load_cluster
from models import hf
from models.registry import infer_example_inputs
from planner.check import operator_policy, policy_changes, trust_changes, trust_problems
from planner.errors import InvalidInputError, PlanMismatchError
from planner.meta_twin import on_meta
from planner.plan import Plan
from planner.solver.policy import VerificationPolicy
from planner.trace import trace
from planner.validate import validate_programs


def _expected_fingerprint(model: Any, plan: Plan) -> str:
    """The fingerprint of ``model``: a Graph, a BlockChain, a fingerprint string, an
    ``(nn.Module, example_inputs)`` pair, or an ``nn.Module`` alone (its input is then
    guessed from its first layer at the plan's batch and sequence length)."""
    if isinstance(model, str):
        return model
    fingerprint = getattr(model, "fingerprint", None)
    if callable(fingerprint):  # planner.ir.Graph
        return fingerprint()
    if isinstance(fingerprint, str):  # planner.ir.BlockChain
        return fingerprint
    if isinstance(model, tuple) and len(model) == 2 and isinstance(model[0], torch.nn.Module):
        module, inputs = model
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        hf.adapt_if_hf(module)
    elif isinstance(model, torch.nn.Module):
        hf.adapt_if_hf(model)  # as the plan's trace did
        module, inputs = model, infer_example_inputs(model, batch=plan.model.batch, seq=plan.model.seq)
    else:
        raise InvalidInputError("load_plan model=", expected="an nn.Module, (nn.Module, example_inputs), a traced "
                                "Graph, a BlockChain or a fingerprint string", found=type(model).__name__)
    with on_meta(module, inputs) as meta_inputs:  # as the plan was traced, whatever the weights are on
        return trace(module, meta_inputs, name=plan.model.name).fingerprint()


@dataclass(frozen=True, slots=True, kw_only=True)
class OperatorTrust:
    """What the operator says when a plan runs: ``cluster``, the cluster file or packaged name to trust (None:
    the one the plan records having been made from), and ``verify`` (false: `run --no-verify`)."""

    cluster: str | None = None
    verify: bool = True


def _check_trust(plan: Plan, source: str, policy: VerificationPolicy | None = None) -> None:
    """Re-run the trust check of plan time on the plan as read: an edited file that puts an untrusted
    device in a trusted role, or drops a verifier an untrusted sender needs, is refused."""
    cluster = plan.effective_cluster()  # a rank on an excluded host is refused by Plan itself
    devices = tuple(tuple(plan.ranks[r].device for r in plan.stage_ranks(k)) for k in range(plan.num_stages))
    problems = trust_problems(devices, plan.verifiers, cluster, policy or plan.policy)
    if problems:
        raise InvalidInputError(f"{source} breaks its trust policy: {problems[0]}"
                                + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""),
                                fix="re-create the plan with `stagewise plan`; plans are not edited by hand")


def _check_operator_trust(plan: Plan, source: str, operator: OperatorTrust) -> None:
    """Who is trusted comes from the operator's cluster and the policy from the operator's run, not from the
    plan's own copy (every invited worker holds the secret that signs plans): a plan whose copy differs, or
    that relaxes the policy, is refused naming the first change."""
    where = operator.cluster or plan.cluster_source
    if where is not None:
        changes = trust_changes(plan.cluster, _operator_cluster(where, given=operator.cluster is not None).to_dict())
        if changes:
            raise InvalidInputError(f"{source} differs from the operator's cluster {where}: {changes[0]}"
                                    + (f" (and {len(changes) - 1} more)" if len(changes) > 1 else ""),
                                    fix="re-plan on the operator's cluster with `stagewise plan`, or pass the "
                                        "cluster the plan was made on with --cluster")
    policy = operator_policy(plan.policy, verify=operator.verify)
    relaxed = policy_changes(plan.policy, policy)
    cluster = plan.effective_cluster()
    if not plan.policy.enabled and policy.enabled and any(
            not cluster.device(r.device).trusted for r in plan.ranks if r.stage is not None):
        raise InvalidInputError(f"{source} relaxes the operator's policy: {relaxed[0]} (and runs stages on "
                                "untrusted devices)", fix="re-plan with verification, or run it with --no-verify "
                                "if you mean it unverified")
    try:
        _check_trust(plan, source, policy)
    except InvalidInputError as exc:
        if relaxed:
            raise InvalidInputError(f"{source} relaxes the operator's policy: {relaxed[0]} ({exc.what})",
                                    fix="re-plan with verification, or run it with --no-verify if you "
                                        "mean it unverified") from None
        raise


def _operator_cluster(where: str, *, given: bool) -> ClusterSpec:
    try:
        return load_cluster(where)
    except InvalidInputError as exc:
        if given:
            raise
        raise InvalidInputError(f"the operator's cluster {where!r}, recorded in the plan, cannot be read: {exc.what}",
                                expected=exc.expected, found=exc.found,
                                fix="pass the cluster the plan was made on with --cluster NAME|FILE") from None


def _non_finite(token: str) -> Any:
    raise ValueError(f"non-finite number {token}")


def load_plan(path: str | os.PathLike, model: Any = None, *, operator: OperatorTrust | None = None) -> Plan:
    """Read, schema-check and validate a plan file; with ``model``, check it is that model's plan; with
    ``operator`` (a run's), check its trust against the operator's cluster and policy, not its own copy.

    Raises InvalidInputError (unreadable, truncated or malformed file, invalid
    programs) or PlanMismatchError (unknown schema version, other model).
    """
    return plan_from_text(read_plan_text(path), source=plan_source(path), model=model, operator=operator)


def plan_source(path: str | os.PathLike) -> str:
    """How errors name a plan file."""
    return f"plan file {os.fspath(path)}"


def read_plan_text(path: str | os.PathLike) -> str:
    """A plan file's text, read once (whoever checks its signature parses the plan from these same bytes)."""
    source = plan_source(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InvalidInputError(f"{source} does not exist", expected="an existing plan JSON file",
                                found="no such file", fix="check the path, or make one with `stagewise plan`") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"{source} cannot be read", expected="a readable UTF-8 JSON file", found=str(exc),
                                fix="check the file's permissions, or re-create it with `stagewise plan`") from None
    return text


def plan_from_text(text: str, *, source: str, model: Any = None, operator: OperatorTrust | None = None) -> Plan:
    """:func:`load_plan` on a plan file's text already read; ``source`` names the file in errors."""
    try:
        data = json.loads(text, parse_constant=_non_finite)
    except json.JSONDecodeError as exc:
        raise InvalidInputError(f"{source} is not valid JSON (truncated or corrupted?)",
                                found=f"{exc.msg} at line {exc.lineno} column {exc.colno}",
                                fix="re-create it with `stagewise plan`") from None
    except ValueError as exc:  # NaN or Infinity: a plan's figures are finite
        raise InvalidInputError(f"{source} holds a {exc}", expected="finite numbers",
                                fix="re-create it with `stagewise plan`") from None
    plan = Plan.from_dict(data, source=source)
    validate_programs(plan)
    if operator is None:
        _check_trust(plan, source)
    else:
        _check_operator_trust(plan, source, operator)
    if model is not None:
        expected = _expected_fingerprint(model, plan)
        if expected != plan.model.fingerprint:
            raise PlanMismatchError(
                f"{source} was made for another model ({plan.model.spec})",
                expected=f"fingerprint {expected[:16]}...", found=f"{plan.model.fingerprint[:16]}...",
                fix="re-plan for this model with `stagewise plan`, or pass the model the plan was made for")
    return plan
