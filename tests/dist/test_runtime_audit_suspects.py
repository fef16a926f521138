"""A suspect is audited from copies too (issue 37): where the auditor of an untrusted stage holds no input, the
trusted upstream rank that copies it the audited inputs hears the same verdict every rank does, so a sender that
verdict left unresolved has every microbatch of the next step audited from copies, not only the secret draw's
(``audit_inputs.agreed_suspects``). With a draw of one in a million, only suspicion audits the attacker."""
from __future__ import annotations

import dataclasses

import pytest

from planner.runtime.launcher.launch import RunBanned, launch
from planner.runtime.options import RunOptions
from planner.simulate_audits import audit_site
from planner.solver.audit_price import AuditWhere
from tests.dist.plans import make_plan

STEPS, ATTACK_START, NEVER = 14, 7, 10 ** 6


def _plan(tmp_path):
    # mlp-tiny in 3 stages, the middle one on two untrusted replicas (ranks 1 and 2, 4 microbatches each); rank 0
    # (trusted) verifies boundary 0, the last rank (trusted) boundary 1 and audits the middle stage from rank 0's
    # copies. The default warm-up (5 steps): the monitors flag the attack, the audit proves it.
    plan = make_plan("mlp-tiny", microbatch=2, num_microbatches=8, stages=[(0, 1), (2, 3), (4, 5)],
                     replicas={1: (4, 4)}, untrusted=(1, 2), optimizer="adam",
                     verifiers=[(0, 0, ("act", "grad")), (1, 3, ("act", "grad"))])
    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(st, audit_every=NEVER if st.index == 1 else 0)
                                                  for st in plan.stages))
    where = audit_site(plan, 1)
    assert isinstance(where, AuditWhere) and where.copied_from == (0,) and where.auditor == 3, where
    return plan.save(tmp_path / "plan.json")


def test_a_sender_left_unresolved_has_every_microbatch_audited_from_copies_and_is_proven(tmp_path):
    path = _plan(tmp_path)
    attacker, twin = 1, 2
    # half its outputs infinite: the monitors flag them (dropped, so the ban test alone takes long: before suspects
    # were audited from copies this run banned nobody in 14 steps), and the verdict leaves the attacker unresolved
    attack = f"rank={attacker},kind=scale,factor=inf,p=0.5,start={ATTACK_START},dir=act"
    with pytest.raises(RunBanned) as stopped:
        launch(RunOptions(plan=str(path), steps=STEPS, timeout_s=90, lr=1e-2, attacks=(attack,)))
    (notice,) = stopped.value.notices
    # flagged at 7, unresolved from then: all of step 8 audited from copies, recomputed in step 9, banned there
    assert notice.rank == attacker and notice.first_flagged_step == ATTACK_START, notice
    assert notice.ban_step <= ATTACK_START + 3, notice
    audits = next(r for r in stopped.value.result["ranks"] if r["rank"] == 3)["verification"]["audits"]
    # one in a million drawn: every audit is a suspicion audit, of every one of the suspect's 4 microbatches a step
    assert audits["run_by_sender"].get(str(attacker), 0) >= 4 and str(twin) not in audits["run_by_sender"], audits
    assert audits["failed_by_sender"].get(str(attacker), 0) >= 1, audits
