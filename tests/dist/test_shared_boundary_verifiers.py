"""Several verifiers share one boundary's replicas (issue 36): a replicated untrusted stage's two replicas,
each watched by its own verifier (the trusted first and last stages', each checking one replica at both
boundaries). A clean run bans nobody and trains as the single-verifier plan does; an attacker replica is
flagged by its own verifier alone, and banned. mlp-tiny, 4 gloo processes."""
from __future__ import annotations

import pytest
import torch

from planner.runtime.launcher.launch import RunBanned, launch
from planner.runtime.options import RunOptions
from planner.verifier_config import VerifierConfig
from tests.dist.plans import make_plan

STEPS, ATTACK_START = 4, 2
ATTACKER, ITS_VERIFIER, OTHER_VERIFIER = 2, 3, 0
SPLIT = [(0, 0, ("grad",), (1,)), (1, 0, ("act",), (1,)),     # rank 0 watches replica h1 (rank 1)
         (0, 3, ("grad",), (2,)), (1, 3, ("act",), (2,))]     # rank 3 watches replica h2 (rank 2)
SINGLE = [(0, 0, ("grad",)), (1, 3, ("act",))]                 # each boundary's consumer watches both


def _plan(tmp_path, verifiers, name: str):
    plan = make_plan("mlp-tiny", microbatch=2, num_microbatches=4, stages=[(0, 1), (2, 3), (4, 5)],
                     replicas={1: (2, 2)}, untrusted=(1, 2), verifiers=verifiers,
                     verifier_config=VerifierConfig(warmup=2, ban_false_steps=100))
    assert plan.stage_ranks(1) == (1, 2) and len(plan.ranks) == 4
    return plan, plan.save(tmp_path / f"{name}.json")


def _verification(result: dict, rank: int) -> dict:
    return next(r for r in result["ranks"] if r["rank"] == rank)["verification"]


def test_split_verifiers_compile_one_copy_per_replica_to_its_own_verifier(tmp_path):
    plan, _ = _plan(tmp_path, SPLIT, "split")
    copies = {(r, ins.peer) for r in (1, 2) for ins in plan.programs[r] if ins.op.startswith("SEND")
              and ins.peer in (0, 3) and not (ins.op == "SEND_F" and ins.peer == 3)
              and not (ins.op == "SEND_B" and ins.peer == 0)}
    assert copies == {(1, 0), (2, 3)}   # each replica copies only to the verifier that covers it
    assert {(v.boundary, v.rank, v.senders) for v in plan.verifiers} == \
        {(0, 0, ("h1/0",)), (1, 0, ("h1/0",)), (0, 3, ("h2/0",)), (1, 3, ("h2/0",))}


def test_clean_split_run_bans_nobody_and_trains_like_one_verifier_per_boundary(tmp_path):
    _, split = _plan(tmp_path, SPLIT, "split")
    _, single = _plan(tmp_path, SINGLE, "single")
    got = launch(RunOptions(plan=str(split), steps=STEPS, timeout_s=60))
    want = launch(RunOptions(plan=str(single), steps=STEPS, timeout_s=60))
    assert got["banned"] == [] and got["flags"] == 0 and got["dropped"] == [0] * STEPS
    assert got["verified_boundaries"] == [0, 1]
    for rank in (OTHER_VERIFIER, ITS_VERIFIER):   # each checked its own replica's half of every boundary
        checked = {(m["boundary"], m["direction"]): m["checked"] for m in _verification(got, rank)["monitors"]}
        assert checked == {(0, "grad"): STEPS * 2, (1, "act"): STEPS * 2}, checked
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]))


def test_an_attacked_replica_is_flagged_by_its_own_verifier_and_banned(tmp_path):
    _, split = _plan(tmp_path, SPLIT, "split")
    attack = f"rank={ATTACKER},kind=scale,factor=inf,start={ATTACK_START},dir=both"
    with pytest.raises(RunBanned) as stopped:
        launch(RunOptions(plan=str(split), steps=STEPS, timeout_s=60, attacks=(attack,)))
    (notice,) = stopped.value.notices
    assert notice.rank == ATTACKER and notice.first_flagged_step == ATTACK_START
    result = stopped.value.result

    def boundary_flags(rank: int) -> set[int]:
        return {e["sender"] for e in _verification(result, rank)["events"] if e["type"] == "flag" and "stage" not in e}
    assert boundary_flags(ITS_VERIFIER) == {ATTACKER}
    assert boundary_flags(OTHER_VERIFIER) == set()   # it never sees the attacker's tensors
