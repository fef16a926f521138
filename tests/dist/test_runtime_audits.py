"""Audits in the running pipeline (issue 37, ``planner.runtime.rank.audits``): the verifier of a replicated
untrusted stage keeps its own copy of the stage at the replicas' weights and recomputes a secret share of their
microbatches. A clean run audits and fails nothing, and trains exactly what a run without audits trains; a
replica that damps its outputs is banned by a failed audit (proof), its twin never."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from planner.integrity.audit import DEFAULT_EVERY
from planner.runtime.launcher.launch import RunBanned, launch
from planner.runtime.options import AUDIT_EVERY, RunOptions
from planner.verifier_config import VerifierConfig
from tests.dist.plans import load_dumps, make_plan

STEPS, ATTACK_START = 6, 2
ATTACKER, TWIN, VERIFIER = 1, 2, 0


def _plan(tmp_path, *, audit_every: int = 0):
    # mlp-tiny in 3 stages, the middle one on two untrusted replicas (ranks 1, 2), the first stage's rank (0,
    # trusted) verifying both of its boundaries both ways (it sees the stage's input, outputs and gradients), as
    # benchmarks/verification_dist.py's replicated shape; a warm-up long enough that the monitors flag nothing
    # in these few steps: what bans here is the audit. The plan audits stage 1 at one in ``audit_every``.
    plan = make_plan("mlp-tiny", microbatch=2, num_microbatches=8, stages=[(0, 1), (2, 3), (4, 5)],
                     replicas={1: (4, 4)}, untrusted=(1, 2), optimizer="adam",
                     verifiers=[(0, 0, ("act", "grad")), (1, 0, ("act", "grad"))],
                     verifier_config=VerifierConfig(warmup=50))
    assert plan.stage_ranks(1) == (ATTACKER, TWIN) and plan.ranks[VERIFIER].stage == 0
    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(st, audit_every=audit_every if st.index == 1
                                                                      else 0) for st in plan.stages))
    return plan.save(tmp_path / "plan.json")


def _audits(result) -> dict:
    return next(r for r in result["ranks"] if r["rank"] == VERIFIER)["verification"]["audits"]


def test_the_options_default_is_the_audit_modules():
    assert AUDIT_EVERY == DEFAULT_EVERY


def test_a_clean_run_audits_both_replicas_fails_none_and_trains_as_without_audits(tmp_path):
    path = _plan(tmp_path)
    results, params = {}, {}
    for every in (2, None):   # the plan audits nothing: only --audit-every 2 does
        dump = tmp_path / f"dump{every}"
        results[every] = launch(RunOptions(plan=str(path), steps=STEPS, timeout_s=60, lr=1e-2, audit_every=every,
                                           dump=str(dump)))
        params[every] = [d["params"] for d in load_dumps(dump, 4)]
    audits = _audits(results[2])
    # each of a replica's 24 microbatches drawn with probability 1/2 (act and grad each): both are audited
    assert audits["run"] >= 2 and audits["failed"] == 0 and not audits["suspended"], audits
    assert set(audits["run_by_sender"]) == {str(ATTACKER), str(TWIN)}
    assert results[2]["audits"] == {"run": audits["run_by_sender"], "failed": {}, "suspended": {},
                                    "signed": {"forged": 0, "voided": 0}}
    assert _audits(results[None])["run"] == 0
    assert not results[2]["banned"]
    for on, off in zip(params[2], params[None]):
        assert on.keys() == off.keys()
        for name in on:
            torch.testing.assert_close(on[name], off[name], rtol=0, atol=0)


def test_a_replica_damping_its_outputs_is_banned_by_a_failed_audit_and_its_twin_is_not(tmp_path):
    path = _plan(tmp_path, audit_every=2)   # no --audit-every: the plan's choice audits the stage
    attack = f"rank={ATTACKER},kind=scale,factor=0.5,start={ATTACK_START}"
    with pytest.raises(RunBanned) as stopped:
        launch(RunOptions(plan=str(path), steps=STEPS + 4, timeout_s=60, lr=1e-2, attacks=(attack,)))
    (notice,) = stopped.value.notices
    # each microbatch audited with probability 1/2: 4 attacked steps of 4 pass unaudited with p = 2^-16
    assert notice.rank == ATTACKER and ATTACK_START <= notice.ban_step <= ATTACK_START + 3, notice
    audits = _audits(stopped.value.result)
    assert audits["failed_by_sender"].get(str(ATTACKER), 0) >= 1 and str(TWIN) not in audits["failed_by_sender"]
    events = next(r for r in stopped.value.result["ranks"] if r["rank"] == VERIFIER)["verification"]["events"]
    failed = [e for e in events if e["type"] == "flag" and "audit" in e["reasons"]]
    assert failed and {(e["sender"], e["direction"]) for e in failed} == {(ATTACKER, "act")}
