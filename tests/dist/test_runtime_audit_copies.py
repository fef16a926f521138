"""Audits from copied inputs (issue 37, ``planner.runtime.rank.audits``): where the verifier of an untrusted
stage's outputs does not verify its input boundary, the trusted upstream rank copies it the audited microbatches'
inputs at the step's end (it shares the auditor's secret schedule; the replica does not), and the auditor, which
runs the trusted stage after, its own gradients sent (``audit_grads``). A clean run of a stage
with one untrusted replica audits and fails nothing and trains exactly what a run without audits trains; a
replica adding noise to its outputs is banned by a failed audit, its twin never."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from planner.runtime.launcher.launch import RunBanned, launch
from planner.runtime.options import RunOptions
from planner.simulate_audits import audit_site
from planner.solver.audit_price import AuditWhere
from planner.verifier_config import VerifierConfig
from tests.dist.plans import load_dumps, make_plan

STEPS, ATTACK_START, EVERY = 6, 2, 4


def _plan(tmp_path, *, replicas: tuple[int, ...], every: int = EVERY):
    # mlp-tiny in 3 stages; the middle one untrusted (one replica, or two); rank 0 (stage 0, trusted) verifies
    # boundary 0, the last stage's rank (trusted) boundary 1: no verifier holds the middle stage's input, so
    # its auditor (the last rank) hears the audited inputs from rank 0. A long warm-up: what bans is the audit.
    middle = tuple(range(1, 1 + len(replicas)))
    last = middle[-1] + 1
    plan = make_plan("mlp-tiny", microbatch=2, num_microbatches=8, stages=[(0, 1), (2, 3), (4, 5)],
                     replicas={1: replicas}, untrusted=middle, optimizer="adam",
                     verifiers=[(0, 0, ("act", "grad")), (1, last, ("act", "grad"))],
                     verifier_config=VerifierConfig(warmup=50))
    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(st, audit_every=every if st.index == 1 else 0)
                                                  for st in plan.stages))
    where = audit_site(plan, 1)
    assert isinstance(where, AuditWhere) and where.copied_from == (0,) and where.auditor == last, where
    return plan.save(tmp_path / "plan.json"), last


def _audits(result, auditor: int) -> dict:
    return next(r for r in result["ranks"] if r["rank"] == auditor)["verification"]["audits"]


def test_a_clean_single_replica_is_audited_from_copies_and_trains_as_without_audits(tmp_path):
    path, auditor = _plan(tmp_path, replicas=(8,))
    results, params = {}, {}
    for every in (None, 0):   # the plan's one in 4, then none
        dump = tmp_path / f"dump{every}"
        results[every] = launch(RunOptions(plan=str(path), steps=STEPS, timeout_s=60, lr=1e-2, audit_every=every,
                                           dump=str(dump)))
        params[every] = [d["params"] for d in load_dumps(dump, 3)]
    audits = _audits(results[None], auditor)
    # each of the replica's 48 microbatches drawn with probability 1/4 (none: p = 1e-6), output and input gradient
    # (the auditor runs the trusted stage after: it keeps the gradients it sends, ``audit_grads``)
    assert 2 <= audits["run"] <= 2 * 8 * STEPS and audits["run"] % 2 == 0, audits
    assert audits["failed"] == 0 and not audits["suspended"], audits
    assert _audits(results[0], auditor)["run"] == 0 and not results[None]["banned"]
    for on, off in zip(params[None], params[0]):
        assert on.keys() == off.keys()
        for name in on:
            torch.testing.assert_close(on[name], off[name], rtol=0, atol=0)


def test_a_replica_adding_noise_is_banned_by_an_audit_from_copies_and_its_twin_is_not(tmp_path):
    path, auditor = _plan(tmp_path, replicas=(4, 4), every=2)
    attacker, twin = 1, 2
    attack = f"rank={attacker},kind=noise,std=0.2,start={ATTACK_START}"
    with pytest.raises(RunBanned) as stopped:
        launch(RunOptions(plan=str(path), steps=STEPS + 4, timeout_s=60, lr=1e-2, attacks=(attack,)))
    (notice,) = stopped.value.notices
    # each microbatch audited with probability 1/2: 4 attacked steps of 4 pass unaudited with p = 2^-16
    # audits from copies recompute during the next step (no checkpoint, not the last): the ban comes a step after
    # the audited step, which is its first flagged step (recovery resumes from before it)
    assert notice.rank == attacker and ATTACK_START <= notice.first_flagged_step <= ATTACK_START + 3, notice
    assert notice.ban_step == notice.first_flagged_step + 1, notice
    audits = _audits(stopped.value.result, auditor)
    assert audits["failed_by_sender"].get(str(attacker), 0) >= 1 and str(twin) not in audits["failed_by_sender"]


def test_a_resumed_run_audits_from_the_checkpoint_and_still_bans(tmp_path):
    # every microbatch audited: a copy that did not start from the checkpoint would fail the honest step 4
    path, auditor = _plan(tmp_path, replicas=(4, 4), every=1)
    ckpt = str(tmp_path / "ckpt")
    launch(RunOptions(plan=str(path), steps=4, timeout_s=60, lr=1e-2, checkpoint_dir=ckpt, checkpoint_every=2))
    attack = "rank=1,kind=noise,std=0.2,start=5"
    with pytest.raises(RunBanned) as stopped:
        launch(RunOptions(plan=str(path), steps=8, timeout_s=60, lr=1e-2, checkpoint_dir=ckpt, checkpoint_every=2,
                          resume=True, attacks=(attack,)))
    (notice,) = stopped.value.notices
    assert notice.rank == 1 and notice.first_flagged_step == 5, notice
    audits = _audits(stopped.value.result, auditor)
    assert audits["run"] >= 8 and audits["failed_by_sender"].get("1", 0) >= 1 and "2" not in audits["failed_by_sender"]
