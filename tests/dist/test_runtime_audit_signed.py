"""Audits from signed inputs (issue 37, ``planner.runtime.rank.audit_signed``): a stage fed by an untrusted stage
is audited on the inputs its replica forwards, each under the signature of the upstream rank that sent it.

mlp-tiny in 4 stages, one rank each: stage 0 (rank 0) and stage 3 (rank 3) trusted, stages 1 and 2 untrusted;
rank 0 verifies boundary 0, rank 3 boundaries 1 and 2 (so it audits stage 2, whose input comes from the
untrusted stage 1). A clean run audits, fails and voids nothing and trains exactly what a run without audits
trains; stage 2 adding noise to its outputs is banned by a failed audit, stage 1 never; stage 2 forwarding its
auditor another input than it was sent (a forgery its signature does not cover) is banned, stage 1 never."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from planner.errors import InvalidInputError
from planner.runtime.launcher.launch import RunBanned, launch
from planner.runtime.options import RunOptions
from planner.simulate_audits import audit_site
from planner.solver.audit_price import AuditWhere
from planner.verifier_config import VerifierConfig
from tests.dist.plans import load_dumps, make_plan

STEPS, ATTACK_START = 6, 2
AUDITOR, UPSTREAM, AUDITED = 3, 1, 2


def _plan(tmp_path, *, every: int):
    # a long warm-up: what bans is the audit
    plan = make_plan("mlp-tiny", microbatch=2, num_microbatches=8, stages=[(0, 0), (1, 2), (3, 4), (5, 5)],
                     untrusted=(UPSTREAM, AUDITED), optimizer="adam",
                     verifiers=[(0, 0, ("act", "grad")), (1, AUDITOR, ("act", "grad")), (2, AUDITOR, ("act", "grad"))],
                     verifier_config=VerifierConfig(warmup=50))
    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(st, audit_every=every if st.index == 2 else 0)
                                                  for st in plan.stages))
    where = audit_site(plan, 2)
    assert isinstance(where, AuditWhere) and where.signed_by == (UPSTREAM,) and where.copied_from == (AUDITED,) \
        and where.auditor == AUDITOR, where
    return plan.save(tmp_path / "plan.json")


def _audits(result) -> dict:
    return next(r for r in result["ranks"] if r["rank"] == AUDITOR)["verification"]["audits"]


def test_a_clean_stage_fed_by_an_untrusted_one_is_audited_and_trains_as_without_audits(tmp_path):
    path = _plan(tmp_path, every=4)
    results, params = {}, {}
    for every in (None, 0):   # the plan's one in 4, then none
        dump = tmp_path / f"dump{every}"
        results[every] = launch(RunOptions(plan=str(path), steps=STEPS, timeout_s=60, lr=1e-2, audit_every=every,
                                           dump=str(dump)))
        params[every] = [d["params"] for d in load_dumps(dump, 4)]
    audits = _audits(results[None])
    # each of the stage's 48 microbatches drawn with probability 1/4 (none: p = 1e-6)
    assert 1 <= audits["run"] <= 8 * STEPS and audits["failed"] == 0 and not audits["suspended"], audits
    assert audits["signed"] == {"forged": 0, "voided": 0}, audits
    assert _audits(results[0])["run"] == 0 and not results[None]["banned"]
    for on, off in zip(params[None], params[0]):
        assert on.keys() == off.keys()
        for name in on:
            torch.testing.assert_close(on[name], off[name], rtol=0, atol=0)


@pytest.mark.parametrize("attack", ["kind=noise,std=0.2", "kind=noise,std=0.2,dir=inputs"])
def test_a_stage_corrupting_its_outputs_or_forging_its_inputs_is_banned_and_its_upstream_is_not(tmp_path, attack):
    path = _plan(tmp_path, every=2)
    with pytest.raises(RunBanned) as stopped:
        launch(RunOptions(plan=str(path), steps=STEPS + 4, timeout_s=60, lr=1e-2,
                          attacks=(f"rank={AUDITED},{attack},start={ATTACK_START}",)))
    (notice,) = stopped.value.notices
    # each microbatch audited with probability 1/2: 4 attacked steps of 8 pass unaudited with p = 2^-32
    assert notice.rank == AUDITED and ATTACK_START <= notice.ban_step <= ATTACK_START + 3, notice
    audits = _audits(stopped.value.result)
    assert audits["failed_by_sender"].get(str(AUDITED), 0) >= 1 and str(UPSTREAM) not in audits["failed_by_sender"]
    assert (audits["signed"]["forged"] >= 1) == ("dir=inputs" in attack), audits


@pytest.mark.parametrize("rank,every", [(UPSTREAM, None), (AUDITED, 0)])
def test_forging_inputs_where_no_replica_forwards_any_is_refused_before_a_process_starts(tmp_path, rank, every):
    # rank 1 signs but forwards nothing; with audits off (0) nobody forwards: the attack would do nothing
    path = _plan(tmp_path, every=4)
    with pytest.raises(InvalidInputError, match="dir=inputs on a replica of a stage audited from signed inputs"):
        launch(RunOptions(plan=str(path), steps=STEPS, timeout_s=60, audit_every=every,
                          attacks=(f"rank={rank},kind=noise,std=0.2,dir=inputs",)))
