"""Blame among twins (issue 37): by rate, step flags shared by evidence, alerts never hiding a sender's own
flags, the first flagged step, and a step failure both replicas share."""
from __future__ import annotations

import math

from planner.integrity.blame import STEP_MB, blame_weights, needed
from planner.integrity.monitor import Monitor
from planner.integrity.verifier import Verifier
from planner.verifier_config import VerifierConfig

# issue 37's shape: stage 1 on ranks 1 and 3 (one microbatch each a step), trusted ends 0 and 2
STAGE_OF = {0: 0, 1: 1, 3: 1, 2: 2}
ONE_EACH = {0: 2, 1: 1, 3: 1, 2: 2}


def flag(step: int, mb: int, boundary: int, direction: str, sender: int, reasons=("mad", "l2"), **extra) -> dict:
    scores = {r: 2.0 for r in reasons}
    if "link" in extra:
        scores["link"] = extra.pop("link")
    return {"type": "flag", "step": step, "mb": mb, "boundary": boundary, "direction": direction, "sender": sender,
            "scope": "step" if mb == STEP_MB else "microbatch", "scores": scores, "fences": {},
            "reasons": list(reasons), **extra}


def alert(step: int, boundary: int, direction: str, sender: int) -> dict:
    return flag(step, STEP_MB, boundary, direction, sender, reasons=("spectral",))


def verifier(**context) -> Verifier:
    return Verifier(VerifierConfig().to_dict(), [(0, "grad"), (1, "act")], **context)


def test_a_sender_with_one_microbatch_a_step_is_blamed_when_it_is_flagged():
    assert needed(1, ONE_EACH) == 1 and needed(0, ONE_EACH) == 2 and needed(9, ONE_EACH) == 2
    rate = verifier(stage_of=STAGE_OF, microbatches=ONE_EACH)
    count = verifier()
    for v in (rate, count):
        v.end_step(5, [[flag(5, 0, 1, "act", 1)]])
    assert rate.last_blamed == {1}
    assert count.last_blamed == set()   # two flagged microbatches by count: it would escape every other step


def test_a_step_flag_on_the_honest_twin_is_shared_by_the_attackers_own_flags():
    events = [flag(7, 0, 1, "act", 1), flag(7, STEP_MB, 1, "act", 3, reasons=("binding",))]
    shared = blame_weights(events, stage_of=STAGE_OF, microbatches=ONE_EACH)
    assert shared == {1: 1.0, 3: 0.0}
    assert blame_weights(events)[3] == math.inf   # without twins it took the whole step


def test_twins_step_flags_at_one_boundary_both_stand():
    events = [flag(4, STEP_MB, 1, "act", 1, reasons=("binding",)), flag(4, STEP_MB, 1, "act", 3, reasons=("binding",))]
    assert blame_weights(events, stage_of=STAGE_OF, microbatches=ONE_EACH) == {1: math.inf, 3: math.inf}


def test_an_alert_never_outranks_its_own_senders_flags():
    events = [alert(9, 1, "act", 1), flag(9, 0, 0, "grad", 1)]
    assert blame_weights(events, stage_of=STAGE_OF, microbatches=ONE_EACH) == {1: 1.0}


def test_an_alert_still_explains_another_senders_flag_downstream():
    events = [alert(9, 1, "act", 1), flag(9, 0, 2, "act", 2)]
    assert blame_weights(events, stage_of=STAGE_OF, microbatches=ONE_EACH) == {}


def test_the_first_flagged_step_is_the_first_with_any_flag_not_the_first_blamed():
    v = verifier(stage_of={1: 1}, microbatches={1: 4})
    v.end_step(3, [[flag(3, 0, 1, "act", 1)]])          # an honest lone flag, then a quiet step: forgotten
    v.end_step(4, [[]])
    v.end_step(10, [[flag(10, 0, 1, "act", 1)]])        # one of four: dropped, not blamed
    assert v.last_blamed == set()
    step = 11
    while 1 not in v.banned:
        v.end_step(step, [[flag(step, 0, 1, "act", 1), flag(step, 1, 1, "act", 1)]])
        assert v.unresolved()[1] == 10
        step += 1
    assert v.ban_records()[1] == (10, step - 1)
    restored = verifier(stage_of={1: 1}, microbatches={1: 4})
    restored.restore_bans(v.bans_state())
    assert restored.ban_records() == v.ban_records()


def test_a_step_failure_both_replicas_share_is_the_stages_move():
    mon = Monitor(VerifierConfig(), 1, "act")
    for _ in range(64):
        mon.step_fences["binding"].update(1.0)
    limit = mon.step_fences["binding"].fence()
    assert limit is not None
    failing = ({"binding": 1.5 * limit}, ("binding",), False)
    assert mon._shared_by_twins(1, ("binding",), {1: failing, 3: ({"binding": 0.9 * limit}, (), False)})
    assert not mon._shared_by_twins(1, ("binding",), {1: failing, 3: ({"binding": 0.3 * limit}, (), False)})
    assert not mon._shared_by_twins(1, ("binding",), {1: failing})   # no twin: no witness
