"""The twin of an attacker is never banned (issue 37): every attack of the suite, damped outputs and all-reduce
poisoning, on one replica of a replicated untrusted stage, in the emulation of ``benchmarks/verification_twins.py``
(one microbatch a replica a step, one verifier without a link test, audits of one in four microbatches), three
seeds; and the attacker is banned within 10 steps of the start (the audit's windows: at most 6)."""
from __future__ import annotations

import pytest
import torch

from benchmarks.verification_twins import ATTACKER, ATTACKS, TWIN, twin_run

torch.set_num_threads(1)

STEPS, START = 36, 14
FAST = ("mixed", "params-scale3", "delay")   # issue 37's honest-twin ban, the all-reduce's, a stale replica


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("attack", [a if a in FAST else pytest.param(a, marks=pytest.mark.slow) for a in ATTACKS])
def test_the_twin_of_an_attacker_is_never_banned(attack, seed):
    row = twin_run(attack, seed=seed, steps=STEPS, start=START)
    assert not row["twin_banned"] and set(row["banned"]) <= {ATTACKER}, row["bans"]
    assert row["attacker_ban_delay"] is not None and row["attacker_ban_delay"] <= 10, row["bans"]
    assert row["audit_fails"][str(TWIN)] == 0


def test_without_audits_the_twin_is_still_never_banned():
    row = twin_run("mixed", seed=0, steps=STEPS, start=START, audit_every=0)
    assert not row["twin_banned"] and row["audits"] == 0, row["bans"]


def test_a_clean_run_bans_nobody():
    row = twin_run(None, seed=0, steps=STEPS, start=START)
    assert row["banned"] == [] and row["flags"] == 0 and sum(row["audit_fails"].values()) == 0
