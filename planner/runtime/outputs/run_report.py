"""What a run reports: every rank's final record gathered on rank 0, the result (``--report``, rewritten
as the run goes, and ``STAGEWISE_RESULT``) and each rank's ``--dump`` file."""
from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import torch

from planner.errors import ProtocolError
from planner.integrity.drops import DROPS_SCHEMA
from planner.outputs import write_atomic
from planner.runtime.options import RunOptions
from planner.runtime.rank.emulate import Emulation
from planner.runtime.rank.executor import Executor
from planner.runtime.rank.metrics import StepSummary, measured_step_ms
from planner.runtime.rank.rank_setup import RankEnv
from planner.runtime.wire import control
from planner.simulate import simulate, without_verification


class ProgressReport:
    """Rank 0 rewrites ``--report`` as the run goes (at most every ``PERIOD_S``), so a run that fails
    still leaves one with the steps it finished."""

    PERIOD_S = 2.0

    def __init__(self, plan, opts: RunOptions, summaries: list[StepSummary], executor: Executor) -> None:
        self.plan, self.opts, self.summaries, self.executor = plan, opts, summaries, executor
        self.last = -math.inf  # the first finished step is written at once

    def __call__(self, force: bool) -> None:
        if not self.summaries or (not force and time.monotonic() - self.last < self.PERIOD_S):
            return
        self.last = time.monotonic()
        partial = build_result(self.plan, self.opts, self.summaries, [], emulation_on=self.opts.emulate,
                               executor=self.executor)
        write_json(self.opts.report, {**partial, "in_progress": True})


# A count per rank (or stage), by its number as a JSON key.
_BY_NUMBER = {"type": "object", "propertyNames": {"pattern": "^[0-9]{1,9}$"},
              "additionalProperties": {"type": "integer", "minimum": 0}}
# A verifier's audits (``Verifier.summary``): what the run's summary adds up.
_AUDITS_SCHEMA = {"type": "object", "additionalProperties": False,
                  "properties": {"run": {"type": "integer", "minimum": 0}, "failed": {"type": "integer", "minimum": 0},
                                 "run_by_sender": _BY_NUMBER, "failed_by_sender": _BY_NUMBER,
                                 "suspended": _BY_NUMBER, "refuted_flags": {"type": "integer", "minimum": 0},
                                 "signed": {"type": "object", "additionalProperties": False,
                                            "properties": {"forged": {"type": "integer", "minimum": 0},
                                                           "voided": {"type": "integer", "minimum": 0}}}}}

# What every rank sends rank 0 at the end (``rank_final``), checked on receipt.
RANK_FINAL_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["rank", "stage", "device_type", "fwd_factor", "bwd_factor", "verification", "bans", "attacked"],
    "properties": {
        "rank": {"type": "integer", "minimum": 0}, "stage": {"type": ["integer", "null"], "minimum": 0},
        "device_type": {"type": "string"}, "fwd_factor": {"type": "number"}, "bwd_factor": {"type": "number"},
        "verification": {"type": "object", "properties": {"flags": {"type": "integer", "minimum": 0},
                                                          "alerts": {"type": "integer", "minimum": 0},
                                                          "drops": DROPS_SCHEMA,
                                                          "drops_total": {"type": "integer", "minimum": 0},
                                                          "audits": _AUDITS_SCHEMA}},
        "bans": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}, "minItems": 2,
                                            "maxItems": 2}},
        "attacked": {"type": "array", "items": {"type": "array"}},
    },
}


def gather_finals(final: dict[str, Any], env: RankEnv, plan, device: torch.device) -> list[dict[str, Any]] | None:
    """Every rank's final record at the control rank, point to point (None elsewhere). A record must say
    which rank it is, and only a verifier rank may report bans: a rank that claims otherwise broke the
    protocol and is named."""
    got = control.json_to(final, dst=control.CONTROL_RANK, me=env.rank, ranks=range(env.world_size),
                          what="run summary", schema=RANK_FINAL_SCHEMA, device=device,
                          doing="gathering the run summaries")
    if got is None:
        return None
    verifiers = {v.rank for v in plan.verifiers}
    for sender, record in enumerate(got):
        if record["rank"] != sender:
            raise ProtocolError(f"rank {sender} sent the run summary of rank {record['rank']}", sender=sender,
                                expected=f"rank {sender}", found=str(record["rank"]),
                                fix=f"check rank {sender}'s host: it does not run this runtime")
        if record["bans"] and sender not in verifiers:
            raise ProtocolError(f"rank {sender} reported bans, which only verifier ranks decide", sender=sender,
                                expected="no bans from a rank that verifies nothing", found=str(record["bans"])[:200],
                                fix=f"check rank {sender}'s host: it does not run this runtime")
    return got


def rank_final(env: RankEnv, ex: Executor, emulation: Emulation, verify, attacks) -> dict[str, Any]:
    return {"rank": env.rank, "stage": ex.info.stage, "device_type": ex.info.device_type,
            "fwd_factor": emulation.fwd_factor, "bwd_factor": emulation.bwd_factor,
            "verification": verify.summary() if verify is not None else {},
            "bans": list(verify.new_bans) if verify is not None else [],
            "attacked": [list(e) for e in attacks.log()] if attacks is not None else []}


def lead_drops(plan, opts: RunOptions, ranks: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The dropped microbatches (the first ``SUMMARY_DROPS``) and their count, as the lead verifier (the
    lowest verifier rank, trusted) decided them; any other rank's word on drops is not read."""
    if not opts.verify or not plan.verifiers:
        return [], 0
    lead = min(v.rank for v in plan.verifiers)
    record = next((f["verification"] for f in ranks if f["rank"] == lead), {})
    drops = list(record.get("drops", []))
    return drops, int(record.get("drops_total", len(drops)))


def verifier_sum(plan, ranks: list[dict[str, Any]], key: str) -> int:
    """``verification[key]`` summed over the plan's verifier ranks (trusted: only they check tensors); any other
    rank's word on it is not read."""
    checkers = {v.rank for v in plan.verifiers}
    return sum(f["verification"].get(key, 0) for f in ranks if f["rank"] in checkers)


def audit_counts(plan, ranks: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """The replicas' audits (``planner.runtime.rank.audits``) run and failed, per audited rank, and the stages
    whose audits stopped (from which step), as the plan's verifier ranks (trusted) report them; any other rank's
    word on audits is not read."""
    verifiers = {v.rank for v in plan.verifiers}
    out: dict[str, dict[str, int]] = {"run": {}, "failed": {}, "suspended": {}, "signed": {"forged": 0, "voided": 0}}
    for record in ranks:
        if record["rank"] not in verifiers:
            continue
        got = record["verification"].get("audits") or {}
        for key, n in (got.get("signed") or {}).items():   # audits from signed inputs: forgeries, complaints
            out["signed"][key] += n
        for key in ("run", "failed"):
            for sender, n in got.get(f"{key}_by_sender", {}).items():
                out[key][sender] = out[key].get(sender, 0) + n
        for stage, step in got.get("suspended", {}).items():   # stage -> the step its audits stopped
            out["suspended"][stage] = min(step, out["suspended"].get(stage, step))
    return out


def predicted_step_ms(plan, opts: RunOptions) -> float:
    """The plan's step as this run takes it: the plan's own prediction, simulated again where the run clips
    the gradients' norm (one more exchange), accumulates passes or does not verify."""
    if opts.clip_grad is None and opts.accumulate == 1 and (opts.verify or not plan.verifiers):
        return plan.predicted.step_ms
    run = plan if opts.verify else without_verification(plan)
    return simulate(run, clip=opts.clip_grad is not None, accumulate=opts.accumulate).step_ms


def build_result(plan, opts: RunOptions, summaries: list[StepSummary], ranks: list[dict[str, Any]], *,
                 emulation_on: bool, executor: Executor) -> dict[str, Any]:
    measured = measured_step_ms(summaries) if summaries else math.nan
    banned = sorted({r for f in ranks for _, r in f["bans"]})
    flags, alerts = verifier_sum(plan, ranks, "flags"), verifier_sum(plan, ranks, "alerts")
    losses = [round(s.loss, 6) if math.isfinite(s.loss) else None for s in summaries]
    drops, drops_total = lead_drops(plan, opts, ranks)
    evals = [{"step": s.step, "loss": round(s.eval_loss, 6) if math.isfinite(s.eval_loss) else None}
             for s in summaries if s.eval_loss is not None]
    return {"plan": os.fspath(opts.plan), "model": plan.model.spec, "schedule": plan.schedule,
            "num_ranks": plan.num_ranks, "steps": len(summaries), "emulated": emulation_on,
            "emulate_slowdown": opts.emulate_slowdown if emulation_on else 1.0,
            "predicted_step_ms": predicted_step_ms(plan, opts), "measured_step_ms": measured,
            "step_ms": [round(s.step_ms, 3) for s in summaries], "cpu_ms": [round(s.cpu_ms, 3) for s in summaries],
            "losses": losses,
            "final_loss": losses[-1] if losses else None,
            "eval_losses": evals, "final_eval_loss": evals[-1]["loss"] if evals else None,
            "lr": [s.lr for s in summaries], "accumulate": opts.accumulate, "dropped": [s.dropped for s in summaries],
            "microbatches": len(summaries) * plan.num_microbatches, "drops": drops, "drops_total": drops_total,
            "banned": banned, "flags": flags, "alerts": alerts, "attacks": list(opts.attacks), "ranks": ranks,
            "audits": audit_counts(plan, ranks),
            "verified_boundaries": list(dict.fromkeys(v.boundary for v in plan.verifiers)) if opts.verify else [],
            # Steps in which no microbatch trained (all dropped), this run and the runs it resumed.
            "untrained_steps": list(executor.untrained_steps)}


def write_json(path: str, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=1, default=str) + "\n")


def dump_rank(folder: str, rank: int, ex: Executor) -> None:
    """Final parameters, last-step gradients and losses of this rank (for comparing with a reference)."""
    os.makedirs(folder, exist_ok=True)
    params = {n: p.detach().cpu().clone() for n, p in ex.stage.parameters()} if ex.stage is not None else {}
    grads = {n: g.cpu() for n, g in ex.last_grads.items()}
    torch.save({"rank": rank, "stage": ex.info.stage, "params": params, "grads": grads,
                "losses": list(ex.step_losses)}, os.path.join(folder, f"rank{rank}.pt"))

